#include "validate_serving.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "abi_struct.h"
#include "checked_arith.h"
#include "error.h"
#include "validate_checks.h"

namespace fkda {

using namespace checks;

namespace {

std::string str(int64_t x) { return std::to_string(x); }

// The axes from `first_packed` on must be packed (the [H, V, K] of a state),
// the axes before it are free but must not make elements overlap.
void check_packed_from(const fkda_tensor& t, const char* name, int32_t first_packed) {
  if (is_empty(t)) return;
  std::vector<int64_t> packed(size_t(t.rank), 0);
  int64_t expected = 1;
  bool ok = true;
  for (int32_t i = t.rank - 1; i >= first_packed; --i) {
    packed[size_t(i)] = expected;
    if (t.shape[i] > 1 && t.strides[i] != expected) ok = false;
    expected = saturating_mul(expected, t.shape[i]);
  }
  if (!ok) {
    std::string want = "[";
    for (int32_t i = 0; i < t.rank; ++i)
      want += (i ? ", " : "") + (i < first_packed ? std::string("*") : str(packed[size_t(i)]));
    invalid(std::string(name) + ": each state must be contiguous, expected strides " + want + "], got " +
            join(t.strides, t.rank));
  }
  check_no_overlap(t, name);
}

// The state shape of the plan's layout, after the given leading extents.
std::vector<int64_t> state_shape(const Plan& plan, std::initializer_list<int64_t> leading) {
  std::vector<int64_t> shape(leading);
  shape.push_back(plan.num_heads);
  if (plan.state_layout == FKDA_STATE_LAYOUT_VK) {
    shape.push_back(plan.head_dim_v);
    shape.push_back(plan.head_dim_k);
  } else {
    shape.push_back(plan.head_dim_k);
    shape.push_back(plan.head_dim_v);
  }
  return shape;
}

void check_shape(const fkda_tensor& t, const char* name, const std::vector<int64_t>& shape) {
  bool ok = t.rank == int32_t(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] == kAny || t.shape[i] == shape[i];
  if (ok) return;
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] == kAny ? "*" : str(shape[i]));
  invalid(std::string(name) + ": expected shape " + want + "], got " + join(t.shape, t.rank));
}

PoolView check_pool(const Plan& plan, const fkda_tensor& t) {
  if (present(t) && t.dtype != plan.state_dtype) {
    invalid("state_pool: expected dtype " + dtype_name(plan.state_dtype) + " (the plan's state_dtype), got " +
            dtype_name(t.dtype));
  }
  check_tensor(t, "state_pool", {plan.state_dtype}, {kAny, kAny, kAny, kAny}, Strides::kRows);
  check_shape(t, "state_pool", state_shape(plan, {kAny}));
  check_packed_from(t, "state_pool", 1);
  return PoolView{t.data, t.shape[0], used_stride(t, 0)};
}

IndexView index_view(const fkda_tensor& t) {
  IndexView view;
  if (!present(t)) return view;
  view.data = t.data;
  view.dtype = t.dtype;
  view.rows = t.shape[0];
  view.cols = t.rank == 2 ? t.shape[1] : 1;
  view.stride_row = used_stride(t, 0);
  view.stride_col = t.rank == 2 ? used_stride(t, 1) : 0;
  return view;
}

// [rows] (cols == 0) or [rows, cols] (cols may be kAny) integers, any strides.
IndexView check_indices(const fkda_tensor& t, const char* name, int64_t rows, int64_t cols, bool allow_bool = false) {
  const std::initializer_list<int32_t> integers = {FKDA_DTYPE_I32, FKDA_DTYPE_I64};
  const std::initializer_list<int32_t> flags = {FKDA_DTYPE_BOOL, FKDA_DTYPE_I32, FKDA_DTYPE_I64};
  if (cols == 0) {
    check_tensor(t, name, allow_bool ? flags : integers, {rows}, Strides::kFree);
  } else {
    check_tensor(t, name, allow_bool ? flags : integers, {rows, cols}, Strides::kFree);
  }
  return index_view(t);
}

// [first, last) byte addresses a checked tensor can touch; empty when it has
// no elements. check_tensor has bounded the span, so nothing here overflows.
std::pair<uintptr_t, uintptr_t> byte_range(const fkda_tensor& t) {
  if (is_empty(t)) return {0, 0};
  int64_t last = 0;
  for (int32_t i = 0; i < t.rank; ++i) last += (t.shape[i] - 1) * used_stride(t, i);
  const uintptr_t first = reinterpret_cast<uintptr_t>(t.data);
  return {first, first + uintptr_t(last + 1) * uintptr_t(element_bytes(t.dtype))};
}

struct Named {
  const fkda_tensor* tensor;
  const char* name;
};

// What a call writes must not share memory with anything else it touches
// (the pool is read and written on purpose, and so is an in-place state).
void check_disjoint(const Named& written, const std::vector<Named>& others) {
  if (!present(*written.tensor)) return;
  const auto [w_first, w_last] = byte_range(*written.tensor);
  if (w_first == w_last) return;
  for (const Named& other : others) {
    if (!present(*other.tensor) || other.tensor == written.tensor) continue;
    const auto [o_first, o_last] = byte_range(*other.tensor);
    if (o_first < w_last && w_first < o_last) {
      invalid(std::string(written.name) + ": overlaps " + other.name + "; an output needs memory of its own");
    }
  }
}

void check_gpu_rows(const Plan& plan, const std::vector<Named>& tensors) {
  if (plan.backend != FKDA_BACKEND_GPU) return;
  for (const Named& t : tensors)
    if (present(*t.tensor) && !is_empty(*t.tensor)) check_gpu_alignment(*t.tensor, t.name);
}

std::string slot_name(const char* tensor, const IndexView& view, int64_t row, int64_t col) {
  std::string name = std::string(tensor) + "[" + str(row) + "]";
  if (view.cols > 1 || view.stride_col != 0) name += "[" + str(col) + "]";
  return name;
}

// A slot inside the pool; `where` names the element ("state_indices[3]").
void check_slot(int64_t slot, const PoolView& pool, const std::string& where, int64_t seq) {
  if (slot >= pool.slots || slot < 0) {
    invalid(where + ": slot " + str(slot) + " is outside the pool's " + str(pool.slots) + " slots (sequence " +
            str(seq) + ")");
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
              "; two sequences writing one slot in a call is undefined");
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

void validate_fwd_serving(const Plan& plan, const fkda_fwd_args& a, PrefillProblem& p) {
  const int64_t N = p.num_seqs;

  if (present(a.state_pool)) p.pool = check_pool(plan, a.state_pool);
  if (present(a.state_indices)) {
    if (!present(a.state_pool)) invalid("state_indices: given without state_pool");
    if (present(a.initial_state) || present(a.final_state)) {
      invalid("state_indices: the states come from state_pool, so initial_state and final_state must be absent");
    }
    p.state_indices = check_indices(a.state_indices, "state_indices", N, 0);
  }
  if (present(a.has_initial_state)) {
    if (!present(a.initial_state) && !present(a.state_indices)) {
      invalid("has_initial_state: given without initial_state or state_indices");
    }
    p.has_initial_state = check_indices(a.has_initial_state, "has_initial_state", N, 0, true);
  }

  if (present(a.checkpoint_offsets)) {
    p.checkpoint_offsets = check_indices(a.checkpoint_offsets, "checkpoint_offsets", N, kAny);
    if (present(a.checkpoints) == present(a.checkpoint_slots)) {
      invalid("checkpoint_offsets: needs exactly one destination, checkpoints or checkpoint_slots");
    }
  } else if (present(a.checkpoints) || present(a.checkpoint_slots)) {
    invalid(std::string(present(a.checkpoints) ? "checkpoints" : "checkpoint_slots") +
            ": given without checkpoint_offsets");
  }
  const int64_t C = p.checkpoint_offsets.cols;
  if (present(a.checkpoints)) {
    check_tensor(a.checkpoints, "checkpoints", {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {N, C, kAny, kAny, kAny},
                 Strides::kRows);
    check_shape(a.checkpoints, "checkpoints", state_shape(plan, {N, C}));
    check_packed_from(a.checkpoints, "checkpoints", 2);
    p.checkpoints = a.checkpoints.data;
    p.checkpoint_dtype = a.checkpoints.dtype;
    p.checkpoint_stride_n = used_stride(a.checkpoints, 0);
    p.checkpoint_stride_c = used_stride(a.checkpoints, 1);
  }
  if (present(a.checkpoint_slots)) {
    if (!present(a.state_pool)) invalid("checkpoint_slots: given without state_pool");
    p.checkpoint_slots = check_indices(a.checkpoint_slots, "checkpoint_slots", N, C);
  }
  if (present(a.state_pool) && !present(a.state_indices) && !present(a.checkpoint_slots)) {
    invalid("state_pool: given without state_indices or checkpoint_slots");
  }

  // Everything the call touches; outputs are checked against all of it.
  const std::vector<Named> touched = {
      {&a.q, "q"},         {&a.k, "k"},           {&a.v, "v"},
      {&a.g, "g"},         {&a.beta, "beta"},     {&a.A_log, "A_log"},
      {&a.dt_bias, "dt_bias"}, {&a.initial_state, "initial_state"}, {&a.cu_seqlens, "cu_seqlens"},
      {&a.state_pool, "state_pool"}, {&a.state_indices, "state_indices"},
      {&a.has_initial_state, "has_initial_state"}, {&a.checkpoint_offsets, "checkpoint_offsets"},
      {&a.checkpoint_slots, "checkpoint_slots"}, {&a.out, "out"}, {&a.final_state, "final_state"},
      {&a.checkpoints, "checkpoints"}};
  check_disjoint({&a.out, "out"}, touched);
  check_disjoint({&a.checkpoints, "checkpoints"}, touched);
  check_disjoint({&a.state_pool, "state_pool"}, touched);
  std::vector<Named> final_others(touched);
  final_others.erase(std::remove_if(final_others.begin(), final_others.end(),
                                    [](const Named& n) { return std::string(n.name) == "initial_state"; }),
                     final_others.end());
  check_disjoint({&a.final_state, "final_state"}, final_others);

  check_residency(plan, {{a.state_pool.data, "state_pool"},
                         {a.state_indices.data, "state_indices"},
                         {a.has_initial_state.data, "has_initial_state"},
                         {a.checkpoint_offsets.data, "checkpoint_offsets"},
                         {a.checkpoints.data, "checkpoints"},
                         {a.checkpoint_slots.data, "checkpoint_slots"}});
  check_gpu_rows(plan, {{&a.state_pool, "state_pool"}, {&a.checkpoints, "checkpoints"}});
  if (plan.backend == FKDA_BACKEND_CPU) check_prefill_contents(p, plan.debug_checks);
}

void check_prefill_contents(const PrefillProblem& p, bool check_shared_slots) {
  SlotClaims claims(check_shared_slots);
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t length = sequence_tokens(p.cu_seqlens, p.seq_len, n).length();
    if (p.state_indices.present()) {
      const int64_t slot = p.state_indices.at(n);
      const std::string where = slot_name("state_indices", p.state_indices, n, 0);
      if (is_null_slot(slot, p.null_slot_rule)) continue;  // padding: nothing read or written
      check_slot(slot, p.pool, where, n);
      claims.write(slot, n, where);
    }
    if (!p.checkpoint_offsets.present()) continue;
    int64_t previous = 0;
    for (int64_t c = 0; c < p.checkpoint_offsets.cols; ++c) {
      const int64_t offset = p.checkpoint_offsets.at(n, c);
      if (offset < 0) continue;
      const std::string where = "checkpoint_offsets[" + str(n) + "][" + str(c) + "]";
      if (offset % 16 != 0 || offset < 16 || offset > length) {
        invalid(where + ": " + str(offset) + " is not a multiple of 16 in [16, " + str(length) + "] (sequence " +
                str(n) + " has " + str(length) + " tokens)");
      }
      if (offset <= previous) {
        invalid(where + ": " + str(offset) + " follows " + str(previous) + "; a sequence's offsets must ascend");
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
    if (length == 0) continue;  // touches nothing
    if (p.indices_are_table && length > W) {
      invalid("state_indices: sequence " + str(n) + " has " + str(length) + " tokens but the slot table has " +
              str(W) + " columns, one per token");
    }
    int64_t start_column = 0;
    if (p.num_accepted_tokens.present()) {
      const int64_t accepted = p.num_accepted_tokens.at(n);
      if (accepted < 1 || accepted > W) {
        invalid("num_accepted_tokens[" + str(n) + "]: " + str(accepted) + " is outside [1, " + str(W) +
                "] (the slot table's columns)");
      }
      start_column = accepted - 1;
    }
    const int64_t start = p.state_indices.at(n, start_column);
    const std::string start_where = slot_name("state_indices", p.state_indices, n, start_column);
    if (is_null_slot(start, p.null_slot_rule)) continue;  // padding
    check_slot(start, p.pool, start_where, n);
    claims.read(start, n, start_where);
    if (!p.indices_are_table) {
      claims.write(start, n, start_where);
      continue;
    }
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

DecodeProblem validate_decode(const Plan& plan, const fkda_decode_args* args, const void* workspace,
                              size_t workspace_bytes) {
  if (args == nullptr) invalid("args: NULL");
  const fkda_decode_args a = read_versioned(*args, fkda_decode_args FKDA_DECODE_ARGS_INIT,
                                            sizeof(fkda_decode_args), "args", "FKDA_DECODE_ARGS_INIT");
  const Activations activations{a.q, a.k, a.v, a.g, a.beta, a.A_log, a.dt_bias, a.out};
  const auto [B, T] = check_activations(plan, activations);
  const int64_t N = check_cu_seqlens(a.cu_seqlens, B);
  if (!present(a.cu_seqlens) && T > kMaxDecodeTokens) {
    invalid("q: fkda_decode takes at most " + str(kMaxDecodeTokens) + " tokens per sequence, got T = " + str(T) +
            " (fkda_fwd takes longer ones)");
  }

  DecodeProblem p;
  p.pool = check_pool(plan, a.state_pool);
  if (!present(a.state_indices)) invalid("state_indices: required tensor is missing (data NULL, rank 0)");
  if (a.state_indices.rank == 2) {
    p.state_indices = check_indices(a.state_indices, "state_indices", N, kAny);
    p.indices_are_table = true;
    if (p.state_indices.cols < 1) invalid("state_indices: a slot table needs at least one column, got 0");
    if (!present(a.cu_seqlens) && T > p.state_indices.cols) {
      invalid("state_indices: " + str(T) + " tokens per sequence but the slot table has " +
              str(p.state_indices.cols) + " columns, one per token");
    }
  } else {
    p.state_indices = check_indices(a.state_indices, "state_indices", N, 0);
  }
  if (present(a.num_accepted_tokens)) {
    if (!p.indices_are_table) {
      invalid("num_accepted_tokens: needs state_indices as an [N, W] slot table, got rank " +
              str(a.state_indices.rank));
    }
    p.num_accepted_tokens = check_indices(a.num_accepted_tokens, "num_accepted_tokens", N, 0);
  }
  if (!std::isfinite(a.scale)) invalid("scale: must be finite, got " + std::to_string(a.scale));

  const std::vector<Named> touched = {
      {&a.q, "q"},         {&a.k, "k"},           {&a.v, "v"},           {&a.g, "g"},
      {&a.beta, "beta"},   {&a.A_log, "A_log"},   {&a.dt_bias, "dt_bias"}, {&a.cu_seqlens, "cu_seqlens"},
      {&a.state_indices, "state_indices"}, {&a.num_accepted_tokens, "num_accepted_tokens"},
      {&a.state_pool, "state_pool"}, {&a.out, "out"}};
  check_disjoint({&a.out, "out"}, touched);
  check_disjoint({&a.state_pool, "state_pool"}, touched);

  check_residency(plan, {{a.q.data, "q"}, {a.k.data, "k"}, {a.v.data, "v"}, {a.g.data, "g"},
                         {a.beta.data, "beta"}, {a.A_log.data, "A_log"}, {a.dt_bias.data, "dt_bias"},
                         {a.out.data, "out"}, {a.state_pool.data, "state_pool"},
                         {a.state_indices.data, "state_indices"},
                         {a.num_accepted_tokens.data, "num_accepted_tokens"}, {a.cu_seqlens.data, "cu_seqlens"}});
  check_gpu_rows(plan, {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.g, "g"}, {&a.out, "out"},
                        {&a.dt_bias, "dt_bias"}, {&a.state_pool, "state_pool"}});
  // No workspace today: any pointer and size, NULL included, is accepted.
  (void)workspace;
  (void)workspace_bytes;

  fill_shared_fields(plan, activations, a.cu_seqlens, B, T, N, a.scale, p);
  if (plan.backend == FKDA_BACKEND_CPU) {
    if (present(a.cu_seqlens)) check_cu_seqlens_contents(a.cu_seqlens, T);
    check_decode_contents(p, plan.debug_checks);
  }
  return p;
}

}  // namespace fkda
