// SPDX-License-Identifier: MIT
// fkda_decode's arguments: activations, the pool, the slot table and its
// accepted counts, on the generic checks of validate_checks.h.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "abi_struct.h"
#include "error.h"
#include "validate.h"
#include "validate_checks.h"
#include "validate_contents.h"
#include "validate_layer.h"

namespace fkda {

using namespace checks;

namespace {

std::string str(int64_t x) { return std::to_string(x); }

}  // namespace

DecodeProblem validate_decode(const Plan& plan, const fkda_decode_args* args, const void* workspace,
                              size_t workspace_bytes) {
  const fkda_decode_args a = read_versioned(args, "args");
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

  LayerCall layer;
  layer.batch = B;
  layer.tokens = T;
  layer.conv_state_rows = p.pool.slots;
  layer.rows_are = "the pool's slots";
  if (p.indices_are_table) {
    layer.conv_refusal = FKDA_ERROR_UNSUPPORTED;
    layer.conv_refusal_reason =
        "fkda_decode with an [N, W] slot table (speculative verify) takes no convolution: a rejected draft "
        "would need the convolution state of every column";
  }
  p.layer = check_layer_step(plan, a.layer, layer);

  // The pool and the conv states are read and written; out only written;
  // the rest only read.
  check_no_shared_memory(with_layer_operands(
      {Operand::tensor(a.q, "q", false), Operand::tensor(a.k, "k", false), Operand::tensor(a.v, "v", false),
       Operand::tensor(a.g, "g", false), Operand::tensor(a.beta, "beta", false),
       Operand::tensor(a.A_log, "A_log", false), Operand::tensor(a.dt_bias, "dt_bias", false),
       Operand::tensor(a.cu_seqlens, "cu_seqlens", false), Operand::tensor(a.state_indices, "state_indices", false),
       Operand::tensor(a.num_accepted_tokens, "num_accepted_tokens", false),
       Operand::tensor(a.state_pool, "state_pool", true), Operand::tensor(a.out, "out", true)},
      a.layer));

  check_residency(plan, with_layer_pointers(
                            {{a.q.data, "q"}, {a.k.data, "k"}, {a.v.data, "v"}, {a.g.data, "g"},
                             {a.beta.data, "beta"}, {a.A_log.data, "A_log"}, {a.dt_bias.data, "dt_bias"},
                             {a.out.data, "out"}, {a.state_pool.data, "state_pool"},
                             {a.state_indices.data, "state_indices"},
                             {a.num_accepted_tokens.data, "num_accepted_tokens"}, {a.cu_seqlens.data, "cu_seqlens"}},
                            a.layer));
  check_gpu_rows(plan, with_layer_rows({{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.g, "g"}, {&a.out, "out"},
                                        {&a.dt_bias, "dt_bias"}, {&a.state_pool, "state_pool"}},
                                       a.layer));
  // No workspace today: any pointer and size, NULL included, is accepted.
  (void)workspace;
  (void)workspace_bytes;

  fill_recurrence_call(plan, activations, a.cu_seqlens, B, T, N, a.scale, p);
  if (plan.backend == FKDA_BACKEND_CPU) {
    if (present(a.cu_seqlens)) check_cu_seqlens_contents(a.cu_seqlens, T);
    check_decode_contents(p, plan.debug_checks);
  }
  return p;
}

}  // namespace fkda
