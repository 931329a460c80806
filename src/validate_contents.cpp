// SPDX-License-Identifier: MIT
#include "validate_contents.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "error.h"
#include "validate_checks.h"

namespace fkda {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

std::string of_sequence(int64_t n) { return " (sequence " + str(n) + ")"; }

std::string slot_name(const char* tensor, const IndexView& view, int64_t row, int64_t col) {
  std::string name = std::string(tensor) + "[" + str(row) + "]";
  if (view.cols > 1 || view.stride_col != 0) name += "[" + str(col) + "]";
  return name;
}

// A slot inside the pool; `where` names the element ("state_indices[3]").
void check_slot(int64_t slot, const PoolView& pool, const std::string& where, int64_t seq) {
  if (slot >= pool.slots || slot < 0) {
    invalid(where + ": slot " + str(slot) + " is outside the pool's " + str(pool.slots) + " slots" +
            of_sequence(seq));
  }
}

// Which sequence writes and reads each slot, to report two sequences that
// would race on one slot. Does nothing unless enabled (debug checks).
class SlotClaims {
 public:
  explicit SlotClaims(bool enabled) : enabled_(enabled) {}
  void write(int64_t slot, int64_t seq, const std::string& where) {
    if (!enabled_) return;
    const auto [it, fresh] = writers_.emplace(slot, seq);
    if (!fresh && it->second != seq) {
      invalid(where + ": slot " + str(slot) + " is also written by sequence " + str(it->second) +
              "; two sequences writing one slot in a call is undefined" + of_sequence(seq));
    }
  }
  void read(int64_t slot, int64_t seq, std::string where) {
    if (enabled_) reads_.push_back({slot, seq, std::move(where)});
  }
  // Reads are checked once every write is known.
  void check_reads() const {
    for (const Read& r : reads_) {
      const auto it = writers_.find(r.slot);
      if (it != writers_.end() && it->second != r.seq) {
        invalid(r.where + ": sequence " + str(r.seq) + " starts from slot " + str(r.slot) +
                ", which sequence " + str(it->second) + " writes in the same call");
      }
    }
  }

 private:
  struct Read {
    int64_t slot, seq;
    std::string where;
  };
  bool enabled_;
  std::unordered_map<int64_t, int64_t> writers_;
  std::vector<Read> reads_;
};

}  // namespace

namespace checks {

// Offset i ends sequence i - 1 and starts sequence i: messages name the
// sequence the bad offset bounds.
void check_cu_seqlens_contents(const fkda_tensor& cu, int64_t total_tokens) {
  const int64_t count = cu.shape[0];
  const SeqOffsets offsets{cu.data, cu.dtype, cu.strides[0]};
  if (offsets.at(0) != 0) {
    invalid("cu_seqlens: must start at 0, got cu_seqlens[0] = " + str(offsets.at(0)) + " (the start of sequence 0)");
  }
  for (int64_t i = 1; i < count; ++i) {
    const int64_t previous = offsets.at(i - 1), current = offsets.at(i);
    if (current < previous) {
      invalid("cu_seqlens: must be non-decreasing, but cu_seqlens[" + str(i) + "] = " + str(current) +
              " < cu_seqlens[" + str(i - 1) + "] = " + str(previous) + " (sequence " + str(i - 1) + " would have " +
              str(current - previous) + " tokens)");
    }
  }
  const int64_t last = offsets.at(count - 1);
  if (last != total_tokens) {
    invalid("cu_seqlens: must end at T = " + str(total_tokens) + " (the packed token count of q), got cu_seqlens[" +
            str(count - 1) + "] = " + str(last) + " (the end of sequence " + str(count - 2) + ")");
  }
}

}  // namespace checks

void check_prefill_contents(const PrefillProblem& p, bool check_shared_slots) {
  SlotClaims claims(check_shared_slots);
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t length = sequence_tokens(p.cu_seqlens, p.seq_len, n).length();
    if (p.state_indices.present()) {
      const int64_t slot = p.state_indices.at(n);
      const std::string where = slot_name("state_indices", p.state_indices, n, 0);
      // Padding: nothing of the sequence is read, its checkpoints neither.
      if (is_null_slot(slot, p.null_slot_rule)) continue;
      check_slot(slot, p.pool, where, n);
      claims.write(slot, n, where);
    }
    if (!p.checkpoint_offsets.present()) continue;
    int64_t previous = 0;
    for (int64_t c = 0; c < p.checkpoint_offsets.cols; ++c) {
      const int64_t offset = p.checkpoint_offsets.at(n, c);
      if (offset < 0) continue;  // no checkpoint: its slot is not read
      const std::string where = "checkpoint_offsets[" + str(n) + "][" + str(c) + "]";
      if (offset % 16 != 0 || offset < 16 || offset > length) {
        invalid(where + ": " + str(offset) + " is not a multiple of 16 in [16, " + str(length) + "] (sequence " +
                str(n) + " has " + str(length) + " tokens)");
      }
      if (offset <= previous) {
        invalid(where + ": " + str(offset) + " follows " + str(previous) + "; a sequence's offsets must ascend" +
                of_sequence(n));
      }
      previous = offset;
      if (!p.checkpoint_slots.present()) continue;
      const int64_t slot = p.checkpoint_slots.at(n, c);
      const std::string slot_where = "checkpoint_slots[" + str(n) + "][" + str(c) + "]";
      if (is_null_slot(slot, p.null_slot_rule)) continue;
      check_slot(slot, p.pool, slot_where, n);
      claims.write(slot, n, slot_where);
    }
  }
  claims.check_reads();
}

void check_decode_contents(const DecodeProblem& p, bool check_shared_slots) {
  SlotClaims claims(check_shared_slots);
  const int64_t W = p.state_indices.cols;
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t length = sequence_tokens(p.cu_seqlens, p.seq_len, n).length();
    if (length > kMaxDecodeTokens) {
      invalid("cu_seqlens: sequence " + str(n) + " has " + str(length) + " tokens; fkda_decode takes at most " +
              str(kMaxDecodeTokens) + " per sequence (fkda_fwd takes longer ones)");
    }
    // A zero-length sequence touches nothing: its indices and count are not read.
    if (length == 0) continue;
    if (p.indices_are_table && length > W) {
      invalid("state_indices: sequence " + str(n) + " has " + str(length) + " tokens but the slot table has " +
              str(W) + " columns, one per token");
    }
    int64_t start_column = 0;
    if (p.num_accepted_tokens.present()) {
      const int64_t accepted = p.num_accepted_tokens.at(n);
      if (accepted < 1 || accepted > W) {
        invalid("num_accepted_tokens[" + str(n) + "]: " + str(accepted) + " is outside [1, " + str(W) +
                "] (the slot table's columns)" + of_sequence(n));
      }
      start_column = accepted - 1;
    }
    const int64_t start = p.state_indices.at(n, start_column);
    const std::string start_where = slot_name("state_indices", p.state_indices, n, start_column);
    // Padding: the sequence's other columns are not read.
    if (is_null_slot(start, p.null_slot_rule)) continue;
    check_slot(start, p.pool, start_where, n);
    claims.read(start, n, start_where);
    if (!p.indices_are_table) {
      claims.write(start, n, start_where);
      continue;
    }
    // Columns past the sequence's length are not read.
    for (int64_t t = 0; t < length; ++t) {
      const int64_t slot = p.state_indices.at(n, t);
      const std::string where = slot_name("state_indices", p.state_indices, n, t);
      if (is_null_slot(slot, p.null_slot_rule)) continue;
      check_slot(slot, p.pool, where, n);
      claims.write(slot, n, where);
    }
  }
  claims.check_reads();
}

}  // namespace fkda
