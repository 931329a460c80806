// SPDX-License-Identifier: MIT
// fkda_fwd's arguments: activations, states (plain or in a pool by slot),
// checkpoints and the workspace, on the generic checks of validate_checks.h.
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "abi_struct.h"
#include "dtype_name.h"
#include "error.h"
#include "layer_step.h"
#include "validate.h"
#include "validate_checks.h"
#include "validate_contents.h"
#include "validate_layer.h"

namespace fkda {

using namespace checks;

namespace {

// States in a pool, has_initial_state and checkpoints (the 0.2 fields):
// their descriptors, and which combinations the header allows.
void check_serving(const Plan& plan, const fkda_fwd_args& a, PrefillProblem& p) {
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
}

// What the layer step may take in this call: the convolution only on plans
// created for it, whose workspace holds the convolved q, k and v; conv
// states in the rows the recurrent states have (pool slots or sequences).
// Checkpoints into pool slots write conv states to pool slots too, so they
// need the conv states to be rows of the pool, which only state_indices says.
LayerCall layer_call(const Plan& plan, const fkda_fwd_args& a, const PrefillProblem& p) {
  LayerCall call;
  call.batch = p.batch;
  call.tokens = p.seq_len;
  if (present(a.state_indices)) {
    call.conv_state_rows = p.pool.slots;
    call.rows_are = "the pool's slots, as the call takes state_indices";
  } else {
    call.conv_state_rows = p.num_seqs;
    call.rows_are = "one per sequence, as the call takes no state_indices";
  }
  if (!plan.layer_step) {
    call.conv_refusal = FKDA_ERROR_INVALID_ARGUMENT;
    call.conv_refusal_reason =
        "the convolution needs a plan created with layer_step = 1 (its workspace holds the convolved q, k and v)";
  }
  if (present(a.checkpoint_slots) && !present(a.state_indices)) {
    call.conv_state_refusal =
        "checkpoint_slots write conv states into rows of the pool, which the conv states are only with "
        "state_indices";
  }
  return call;
}

}  // namespace

PrefillProblem validate_fwd(const Plan& plan, const fkda_fwd_args* args, const void* workspace,
                            size_t workspace_bytes) {
  const fkda_fwd_args a = read_versioned(args, "args");
  const Activations activations{a.q, a.k, a.v, a.g, a.beta, a.A_log, a.dt_bias, a.out};
  const auto [B, T] = check_activations(plan, activations);
  const int64_t N = check_cu_seqlens(a.cu_seqlens, B);

  for (const auto& [t, name] : {std::pair<const fkda_tensor&, const char*>{a.initial_state, "initial_state"},
                                {a.final_state, "final_state"}}) {
    if (!present(t)) continue;
    if (t.dtype != plan.state_dtype) {
      invalid(std::string(name) + ": expected dtype " + dtype_name(plan.state_dtype) +
              " (the plan's state_dtype), got " + dtype_name(t.dtype));
    }
    const Extents shape = state_shape(plan, {N});
    check_tensor(t, name, {plan.state_dtype}, {shape[0], shape[1], shape[2], shape[3]}, Strides::kPacked);
  }

  if (!std::isfinite(a.scale)) invalid("scale: must be finite, got " + std::to_string(a.scale));

  PrefillProblem p;
  fill_recurrence_call(plan, activations, a.cu_seqlens, B, T, N, a.scale, p);
  p.initial_state = present(a.initial_state) ? a.initial_state.data : nullptr;
  p.final_state = present(a.final_state) ? a.final_state.data : nullptr;
  check_serving(plan, a, p);
  p.layer = check_layer_step(plan, a.layer, layer_call(plan, a, p));
  if (plan.layer_step) {
    p.conv_staged_projections = staged_projections(plan.backend);
    p.conv_staging_bytes = conv_staging_bytes(B * T, plan.num_heads, plan.head_dim_k, plan.backend);
    p.conv_weight_table = stages_conv_weight_table(plan.backend);
  }

  const size_t required = plan.workspace_size(B * T, N);
  // Written: out, final_state, checkpoints, the pool (read too), the conv
  // states (read too) and the workspace, all workspace_bytes of it (the CPU
  // backend scales its workers to what it is lent); final_state may be
  // initial_state itself, nothing between.
  check_no_shared_memory(
      with_layer_operands(
          {Operand::tensor(a.q, "q", false), Operand::tensor(a.k, "k", false), Operand::tensor(a.v, "v", false),
           Operand::tensor(a.g, "g", false), Operand::tensor(a.beta, "beta", false),
           Operand::tensor(a.A_log, "A_log", false), Operand::tensor(a.dt_bias, "dt_bias", false),
           Operand::tensor(a.initial_state, "initial_state", false), Operand::tensor(a.cu_seqlens, "cu_seqlens", false),
           Operand::tensor(a.state_indices, "state_indices", false),
           Operand::tensor(a.has_initial_state, "has_initial_state", false),
           Operand::tensor(a.checkpoint_offsets, "checkpoint_offsets", false),
           Operand::tensor(a.checkpoint_slots, "checkpoint_slots", false),
           Operand::tensor(a.state_pool, "state_pool", true), Operand::tensor(a.out, "out", true),
           Operand::tensor(a.final_state, "final_state", true), Operand::tensor(a.checkpoints, "checkpoints", true),
           Operand::bytes(workspace, workspace_bytes, "workspace", true)},
          a.layer),
      {{"initial_state", "final_state"}});

  ArgList<Located> located = with_layer_pointers({{a.q.data, "q"},
                                                  {a.k.data, "k"},
                                                  {a.v.data, "v"},
                                                  {a.g.data, "g"},
                                                  {a.beta.data, "beta"},
                                                  {a.A_log.data, "A_log"},
                                                  {a.dt_bias.data, "dt_bias"},
                                                  {a.out.data, "out"},
                                                  {a.initial_state.data, "initial_state"},
                                                  {a.final_state.data, "final_state"},
                                                  {a.cu_seqlens.data, "cu_seqlens"},
                                                  {a.state_pool.data, "state_pool"},
                                                  {a.state_indices.data, "state_indices"},
                                                  {a.has_initial_state.data, "has_initial_state"},
                                                  {a.checkpoint_offsets.data, "checkpoint_offsets"},
                                                  {a.checkpoints.data, "checkpoints"},
                                                  {a.checkpoint_slots.data, "checkpoint_slots"}},
                                                 a.layer);
  if (required > 0 && workspace != nullptr) located.push_back({workspace, "workspace"});
  // Where the tensors live before whether the workspace suffices: a tensor
  // in the wrong memory is the first thing a caller has to fix.
  check_residency(plan, located);
  check_workspace(workspace, workspace_bytes, required,
                  std::to_string(B * T) + " tokens in " + std::to_string(N) + " sequences", "fkda_plan_workspace_size");


  // The kernels move rows of 8 bf16 (or 4 f32) in 16-byte accesses.
  check_gpu_rows(plan, with_layer_rows({{&a.q, "q"},
                                        {&a.k, "k"},
                                        {&a.v, "v"},
                                        {&a.g, "g"},
                                        {&a.out, "out"},
                                        {&a.dt_bias, "dt_bias"},
                                        {&a.initial_state, "initial_state"},
                                        {&a.final_state, "final_state"},
                                        {&a.state_pool, "state_pool"},
                                        {&a.checkpoints, "checkpoints"}},
                                       a.layer));

  if (plan.backend == FKDA_BACKEND_CPU) {
    if (present(a.cu_seqlens)) check_cu_seqlens_contents(a.cu_seqlens, T);
    check_prefill_contents(p, plan.debug_checks);
  }
  return p;
}

}  // namespace fkda
