// SPDX-License-Identifier: MIT
#include "validate_transitions.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "abi_struct.h"
#include "checked_arith.h"
#include "error.h"
#include "validate_checks.h"

namespace fkda {
namespace {

using namespace checks;

std::string str(int64_t value) { return std::to_string(value); }

}  // namespace

TransitionProblem validate_transitions(const Plan& plan, const fkda_transition_args* args, const void* workspace,
                                       size_t workspace_bytes) {
  if (args == nullptr) invalid("args: NULL");
  const fkda_transition_args a = read_versioned(args, "args");
  const int64_t H = plan.num_heads, K = plan.head_dim_k, V = plan.head_dim_v;
  // k fixes B and T, as q does in fkda_fwd.
  check_tensor(a.k, "k", {FKDA_DTYPE_BF16}, {kAny, kAny, kAny, kAny}, Strides::kRows);
  if (a.k.shape[2] != H) {
    invalid("k: expected " + str(H) + " heads (the plan's num_heads) on axis 2, got shape " + join(a.k.shape, 4));
  }
  if (a.k.shape[3] != K) invalid("k: expected head dim " + str(K) + " on axis 3, got shape " + join(a.k.shape, 4));
  const int64_t B = a.k.shape[0], T = a.k.shape[1];
  check_tensor(a.v, "v", {FKDA_DTYPE_BF16}, {B, T, H, V}, Strides::kRows);
  check_gate_inputs(plan, {a.g, a.beta, a.A_log, a.dt_bias}, B, T);
  const int64_t N = check_cu_seqlens(a.cu_seqlens, B);

  check_tensor(a.transition_m, "transition_m", {FKDA_DTYPE_F32}, {N, H, K, K}, Strides::kPacked);
  // E has the shape of a state in the plan's layout.
  const Extents e = state_shape(plan, {N});
  check_tensor(a.transition_e, "transition_e", {FKDA_DTYPE_F32}, {e[0], e[1], e[2], e[3]}, Strides::kPacked);

  int64_t total_tokens = 0;
  if (mul_overflows(B, T, &total_tokens)) invalid("k: batch " + str(B) + " times " + str(T) + " tokens overflows");
  const size_t required = plan.transitions_workspace_size(total_tokens, N);
  // Written: both transitions and the workspace, all workspace_bytes of it.
  check_no_shared_memory(
      {Operand::tensor(a.k, "k", false), Operand::tensor(a.v, "v", false), Operand::tensor(a.g, "g", false),
       Operand::tensor(a.beta, "beta", false), Operand::tensor(a.A_log, "A_log", false),
       Operand::tensor(a.dt_bias, "dt_bias", false), Operand::tensor(a.cu_seqlens, "cu_seqlens", false),
       Operand::tensor(a.transition_m, "transition_m", true), Operand::tensor(a.transition_e, "transition_e", true),
       Operand::bytes(workspace, workspace_bytes, "workspace", true)});
  ArgList<Located> located = {{a.k.data, "k"},
                              {a.v.data, "v"},
                              {a.g.data, "g"},
                              {a.beta.data, "beta"},
                              {a.A_log.data, "A_log"},
                              {a.dt_bias.data, "dt_bias"},
                              {a.cu_seqlens.data, "cu_seqlens"},
                              {a.transition_m.data, "transition_m"},
                              {a.transition_e.data, "transition_e"}};
  if (required > 0) located.push_back({workspace, "workspace"});
  check_residency(plan, located);
  check_gpu_rows(plan, {{&a.k, "k"}, {&a.v, "v"}, {&a.g, "g"}, {&a.dt_bias, "dt_bias"},
                        {&a.transition_m, "transition_m"}, {&a.transition_e, "transition_e"}});
  if (plan.backend != FKDA_BACKEND_GPU && present(a.cu_seqlens)) check_cu_seqlens_contents(a.cu_seqlens, T);
  check_workspace(workspace, workspace_bytes, required,
                  str(total_tokens) + " tokens in " + str(N) + " sequences",
                  "fkda_plan_transitions_workspace_size");

  TransitionProblem p;
  const fkda_tensor none = FKDA_TENSOR_NONE;  // no q, no out
  fill_recurrence_call(plan, {none, a.k, a.v, a.g, a.beta, a.A_log, a.dt_bias, none}, a.cu_seqlens, B, T, N, 1.f, p);
  p.transition_m = static_cast<float*>(a.transition_m.data);
  p.transition_e = static_cast<float*>(a.transition_e.data);
  return p;
}

ApplyProblem validate_apply(const Plan& plan, const fkda_apply_args* args, const void* workspace,
                            size_t workspace_bytes) {
  if (args == nullptr) invalid("args: NULL");
  const fkda_apply_args a = read_versioned(args, "args");
  const int64_t H = plan.num_heads, K = plan.head_dim_k;
  // transition_m fixes R and N.
  check_tensor(a.transition_m, "transition_m", {FKDA_DTYPE_F32}, {kAny, kAny, H, K, K}, Strides::kPacked);
  const int64_t R = a.transition_m.shape[0], N = a.transition_m.shape[1];
  const Extents e = state_shape(plan, {R, N});
  check_tensor(a.transition_e, "transition_e", {FKDA_DTYPE_F32}, {e[0], e[1], e[2], e[3], e[4]}, Strides::kPacked);
  const Extents state = state_shape(plan, {N});
  auto check_state = [&](const fkda_tensor& t, const char* name) {
    if (t.dtype != plan.state_dtype && present(t)) {
      invalid(std::string(name) + ": expected dtype " + dtype_name(plan.state_dtype) +
              " (the plan's state_dtype), got " + dtype_name(t.dtype));
    }
    check_tensor(t, name, {plan.state_dtype}, {state[0], state[1], state[2], state[3]}, Strides::kPacked);
  };
  if (present(a.initial_state)) check_state(a.initial_state, "initial_state");
  check_state(a.final_state, "final_state");
  // initial_state may be final_state itself (updated in place), nothing between.
  check_no_shared_memory({Operand::tensor(a.transition_m, "transition_m", false),
                          Operand::tensor(a.transition_e, "transition_e", false),
                          Operand::tensor(a.initial_state, "initial_state", false),
                          Operand::tensor(a.final_state, "final_state", true)},
                         {{"initial_state", "final_state"}});

  check_residency(plan, {{a.transition_m.data, "transition_m"},
                         {a.transition_e.data, "transition_e"},
                         {a.initial_state.data, "initial_state"},
                         {a.final_state.data, "final_state"}});
  check_gpu_rows(plan, {{&a.transition_m, "transition_m"}, {&a.transition_e, "transition_e"},
                        {&a.initial_state, "initial_state"}, {&a.final_state, "final_state"}});
  // No workspace is needed: any pointer and size are accepted.
  (void)workspace;
  (void)workspace_bytes;

  ApplyProblem p;
  p.num_transitions = R;
  p.num_seqs = N;
  p.num_heads = plan.num_heads;
  p.head_dim_k = plan.head_dim_k;
  p.head_dim_v = plan.head_dim_v;
  p.transition_m = static_cast<const float*>(a.transition_m.data);
  p.transition_e = static_cast<const float*>(a.transition_e.data);
  p.initial_state = present(a.initial_state) && !is_empty(a.initial_state) ? a.initial_state.data : nullptr;
  p.final_state = a.final_state.data;
  p.state_dtype = plan.state_dtype;
  p.state_layout = plan.state_layout;
  return p;
}

}  // namespace fkda
