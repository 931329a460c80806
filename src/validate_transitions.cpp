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

// g, beta, A_log and dt_bias under the plan's gate and beta modes, with the
// messages fkda_fwd gives for them.
void check_gate(const Plan& plan, const fkda_transition_args& a, int64_t B, int64_t T) {
  const int64_t H = plan.num_heads, K = plan.head_dim_k;
  const std::string gate = std::string("the plan's gate is ") + gate_mode_name(plan.gate_mode);
  if (plan.gate_mode == FKDA_GATE_LOG_DECAY) {
    check_tensor(a.g, "g", {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {B, T, H, K}, Strides::kRows);
    if (present(a.A_log)) invalid("A_log: must be absent: " + gate + ", g is the log-decay itself");
    if (present(a.dt_bias)) invalid("dt_bias: must be absent: " + gate + ", g is the log-decay itself");
  } else {
    if (present(a.g) && a.g.dtype == FKDA_DTYPE_F32) {
      invalid("g: expected dtype bf16 (" + gate + "; f32 g is taken with the log-decay gate only), got f32");
    }
    check_tensor(a.g, "g", {FKDA_DTYPE_BF16}, {B, T, H, K}, Strides::kRows);
    if (plan.gate_mode == FKDA_GATE_SOFTPLUS && !present(a.A_log)) {
      invalid("A_log: required tensor is missing (data NULL, rank 0): " + gate +
              ", -exp(A_log) * softplus(g + dt_bias)");
    }
    if (present(a.A_log)) check_tensor(a.A_log, "A_log", {FKDA_DTYPE_F32}, {H}, Strides::kPacked);
    if (present(a.dt_bias)) check_tensor(a.dt_bias, "dt_bias", {FKDA_DTYPE_F32}, {H, K}, Strides::kPacked);
  }
  check_tensor(a.beta, "beta", {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {B, T, H}, Strides::kFree);
}

// The bytes a non-empty packed tensor covers.
struct ByteRange {
  uintptr_t begin = 0, end = 0;
};

ByteRange bytes_of(const fkda_tensor& t) {
  if (!present(t) || is_empty(t)) return {};
  int64_t count = 1;
  for (int32_t i = 0; i < t.rank; ++i) count *= t.shape[i];  // packed and checked: fits
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + uintptr_t(count * element_bytes(t.dtype))};
}

bool overlap(const ByteRange& a, const ByteRange& b) {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

void check_disjoint(const fkda_tensor& written, const char* written_name, const fkda_tensor& other,
                    const char* other_name) {
  if (overlap(bytes_of(written), bytes_of(other))) {
    invalid(std::string(written_name) + ": overlaps " + other_name + "; an output needs memory of its own");
  }
}

void check_workspace(const void* workspace, size_t workspace_bytes, size_t required, const std::string& sizes,
                     const char* size_call) {
  if (workspace_bytes < required) {
    fail(FKDA_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes: " + std::to_string(workspace_bytes) + " bytes given, " +
                                             std::to_string(required) + " needed for " + sizes + " (" +
                                             size_call + ")");
  }
  if (required > 0 && workspace == nullptr) {
    invalid("workspace: NULL, but " + std::to_string(required) + " bytes are needed");
  }
  if (required > 0 && reinterpret_cast<uintptr_t>(workspace) % 16 != 0) invalid("workspace: must be 16-byte aligned");
}

// GPU plans: rows of 16 bytes, like fkda_fwd's tensors.
void check_gpu_rows(const Plan& plan, std::initializer_list<std::pair<const fkda_tensor*, const char*>> rows) {
  if (plan.backend != FKDA_BACKEND_GPU) return;
  for (const auto& [tensor, name] : rows) {
    if (present(*tensor) && !is_empty(*tensor)) check_gpu_alignment(*tensor, name);
  }
}

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
  check_gate(plan, a, B, T);
  const int64_t N = check_cu_seqlens(a.cu_seqlens, B);

  const bool vk = plan.state_layout == FKDA_STATE_LAYOUT_VK;
  check_tensor(a.transition_m, "transition_m", {FKDA_DTYPE_F32}, {N, H, K, K}, Strides::kPacked);
  if (vk) {
    check_tensor(a.transition_e, "transition_e", {FKDA_DTYPE_F32}, {N, H, V, K}, Strides::kPacked);
  } else {
    check_tensor(a.transition_e, "transition_e", {FKDA_DTYPE_F32}, {N, H, K, V}, Strides::kPacked);
  }
  check_disjoint(a.transition_e, "transition_e", a.transition_m, "transition_m");

  int64_t total_tokens = 0;
  if (mul_overflows(B, T, &total_tokens)) invalid("k: batch " + str(B) + " times " + str(T) + " tokens overflows");
  const size_t required = plan.transitions_workspace_size(total_tokens, N);
  std::vector<Located> located = {{a.k.data, "k"},
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
  p.batch = B;
  p.seq_len = T;
  p.num_seqs = N;
  p.num_heads = plan.num_heads;
  p.head_dim_k = plan.head_dim_k;
  p.head_dim_v = plan.head_dim_v;
  p.k = act_view(a.k);
  p.v = act_view(a.v);
  p.g = act_view(a.g);
  p.beta = act_view(a.beta);
  p.A_log = present(a.A_log) && !is_empty(a.A_log) ? static_cast<const float*>(a.A_log.data) : nullptr;
  p.dt_bias = present(a.dt_bias) && !is_empty(a.dt_bias) ? static_cast<const float*>(a.dt_bias.data) : nullptr;
  p.gate.gate_mode = plan.gate_mode;
  p.gate.beta_mode = plan.beta_mode;
  p.gate.g_is_f32 = a.g.dtype == FKDA_DTYPE_F32;
  p.gate.beta_is_f32 = a.beta.dtype == FKDA_DTYPE_F32;
  if (present(a.cu_seqlens)) p.cu_seqlens = SeqOffsets{a.cu_seqlens.data, a.cu_seqlens.dtype, a.cu_seqlens.strides[0]};
  p.transition_m = static_cast<float*>(a.transition_m.data);
  p.transition_e = static_cast<float*>(a.transition_e.data);
  p.state_layout = plan.state_layout;
  p.lower_bound = plan.lower_bound.load();
  p.debug_checks = plan.debug_checks;
  return p;
}

ApplyProblem validate_apply(const Plan& plan, const fkda_apply_args* args, const void* workspace,
                            size_t workspace_bytes) {
  if (args == nullptr) invalid("args: NULL");
  const fkda_apply_args a = read_versioned(args, "args");
  const int64_t H = plan.num_heads, K = plan.head_dim_k, V = plan.head_dim_v;
  const bool vk = plan.state_layout == FKDA_STATE_LAYOUT_VK;
  // transition_m fixes R and N.
  check_tensor(a.transition_m, "transition_m", {FKDA_DTYPE_F32}, {kAny, kAny, H, K, K}, Strides::kPacked);
  const int64_t R = a.transition_m.shape[0], N = a.transition_m.shape[1];
  if (vk) {
    check_tensor(a.transition_e, "transition_e", {FKDA_DTYPE_F32}, {R, N, H, V, K}, Strides::kPacked);
  } else {
    check_tensor(a.transition_e, "transition_e", {FKDA_DTYPE_F32}, {R, N, H, K, V}, Strides::kPacked);
  }
  auto check_state = [&](const fkda_tensor& t, const char* name) {
    if (t.dtype != plan.state_dtype && present(t)) {
      invalid(std::string(name) + ": expected dtype " + dtype_name(plan.state_dtype) +
              " (the plan's state_dtype), got " + dtype_name(t.dtype));
    }
    if (vk) {
      check_tensor(t, name, {plan.state_dtype}, {N, H, V, K}, Strides::kPacked);
    } else {
      check_tensor(t, name, {plan.state_dtype}, {N, H, K, V}, Strides::kPacked);
    }
  };
  if (present(a.initial_state)) check_state(a.initial_state, "initial_state");
  check_state(a.final_state, "final_state");
  check_disjoint(a.final_state, "final_state", a.transition_m, "transition_m");
  check_disjoint(a.final_state, "final_state", a.transition_e, "transition_e");
  // The same buffer is an update in place; any other overlap would read
  // elements already written.
  if (present(a.initial_state) && a.initial_state.data != a.final_state.data) {
    check_disjoint(a.final_state, "final_state", a.initial_state, "initial_state (other than in place)");
  }

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
