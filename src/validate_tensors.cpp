// SPDX-License-Identifier: MIT
// The generic checks of tensor descriptors (validate_checks.h).
#include "validate_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "checked_arith.h"
#include "gpu/cuda_driver.h"
#include "dtype_name.h"
#include "error.h"

namespace fkda {
namespace checks {

int64_t element_bytes(int32_t dtype) {
  switch (dtype) {
    case FKDA_DTYPE_BF16:
    case FKDA_DTYPE_F16: return 2;
    case FKDA_DTYPE_F32:
    case FKDA_DTYPE_I32: return 4;
    case FKDA_DTYPE_I64: return 8;
    default: return 1;
  }
}

std::string join(const int64_t* values, int32_t count) {
  std::string out = "[";
  for (int32_t i = 0; i < count; ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

bool present(const fkda_tensor& t) { return !(t.data == nullptr && t.rank == 0); }

bool is_empty(const fkda_tensor& t) {
  for (int32_t i = 0; i < t.rank; ++i)
    if (t.shape[i] == 0) return true;
  return false;
}

namespace {

std::string hex_address(const void* data) {
  char text[2 + 2 * sizeof(uintptr_t) + 1];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(data)));
  return text;
}

// The memory a non-empty tensor covers must be able to exist: its byte span
// (first element to the end of the last one) fits in int64, and data + span
// does not run past the end of the address space. Anything else would only
// be addressable through wrapped-around offsets.
void check_span(const fkda_tensor& t, const char* name) {
  auto impossible = [&](const std::string& why) {
    invalid(std::string(name) + ": shape " + join(t.shape, t.rank) + " with strides " + join(t.strides, t.rank) +
            " " + why);
  };
  int64_t last = 0;  // element offset of the last element
  for (int32_t i = 0; i < t.rank; ++i) {
    if (t.shape[i] <= 1) continue;
    int64_t step = 0;
    if (mul_overflows(t.shape[i] - 1, t.strides[i], &step) || add_overflows(last, step, &last)) {
      impossible("spans more than 2^63 elements");
    }
  }
  int64_t bytes = 0;
  if (add_overflows(last, 1, &last) || mul_overflows(last, element_bytes(t.dtype), &bytes)) {
    impossible("spans more than 2^63 bytes");
  }
  if (reinterpret_cast<uintptr_t>(t.data) > std::numeric_limits<uintptr_t>::max() - uint64_t(bytes)) {
    impossible("runs past the end of the address space from data " + hex_address(t.data));
  }
}

}  // namespace

// The stride of an axis of extent 1 is never used, so it is not checked;
// nor is anything of an empty tensor but its rank, dtype and extents.
void check_tensor(const fkda_tensor& t, const char* name, std::initializer_list<int32_t> dtypes,
                  std::initializer_list<int64_t> shape, Strides strides) {
  // The name becomes a string only in a message that is thrown: a valid
  // call allocates nothing here.
  if (!present(t)) invalid(std::string(name) + ": required tensor is missing (data NULL, rank 0)");
  bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.dtype) != dtypes.end();
  if (!dtype_ok) {
    std::string expected;
    for (int32_t d : dtypes) expected += (expected.empty() ? "" : " or ") + dtype_name(d);
    invalid(std::string(name) + ": expected dtype " + expected + ", got " + dtype_name(t.dtype));
  }
  const int32_t rank = static_cast<int32_t>(shape.size());
  if (t.rank != rank) {
    invalid(std::string(name) + ": expected rank " + std::to_string(rank) + ", got " + std::to_string(t.rank));
  }
  int32_t axis = 0;
  for (int64_t expected : shape) {
    if (t.shape[axis] < 0) {
      invalid(std::string(name) + ": negative extent " + std::to_string(t.shape[axis]) + " on axis " +
              std::to_string(axis));
    }
    if (expected != kAny && t.shape[axis] != expected) {
      std::vector<int64_t> want(shape);
      std::string want_text = "[";
      for (size_t i = 0; i < want.size(); ++i)
        want_text += (i ? ", " : "") + (want[i] == kAny ? std::string("*") : std::to_string(want[i]));
      invalid(std::string(name) + ": expected shape " + want_text + "], got " + join(t.shape, t.rank));
    }
    ++axis;
  }
  if (is_empty(t)) return;
  if (t.data == nullptr) invalid(std::string(name) + ": data is NULL");
  for (int32_t i = 0; i < rank; ++i) {
    if (t.shape[i] > 1 && t.strides[i] < 0) {
      invalid(std::string(name) + ": negative strides are not supported, got " + join(t.strides, rank));
    }
  }
  check_span(t, name);
  if (reinterpret_cast<uintptr_t>(t.data) % element_bytes(t.dtype) != 0) {
    invalid(std::string(name) + ": data " + hex_address(t.data) + " is not aligned to its " +
            std::to_string(element_bytes(t.dtype)) + "-byte elements");
  }
  if (strides != Strides::kFree && t.shape[rank - 1] > 1 && t.strides[rank - 1] != 1) {
    invalid(std::string(name) + ": the last axis must be contiguous (stride 1), got strides " +
            join(t.strides, rank));
  }
  if (strides == Strides::kPacked) {
    int64_t expected = 1;
    for (int32_t i = rank - 1; i >= 0; --i) {
      if (t.shape[i] > 1 && t.strides[i] != expected) {
        std::vector<int64_t> packed(rank);
        int64_t s = 1;
        for (int32_t j = rank - 1; j >= 0; --j) { packed[j] = s; s = saturating_mul(s, t.shape[j]); }
        invalid(std::string(name) + ": expected contiguous strides " + join(packed.data(), rank) + ", got " +
                join(t.strides, rank));
      }
      expected = saturating_mul(expected, t.shape[i]);
    }
  }
}

// Sufficient test: sorted by stride, each axis steps past everything the
// smaller axes reach. Runs after check_tensor, so the reaches are bounded
// by the tensor's span; saturation keeps the last one from wrapping.
void check_no_overlap(const fkda_tensor& t, const char* name) {
  if (is_empty(t)) return;
  int32_t axes[FKDA_MAX_RANK];
  int32_t count = 0;
  for (int32_t i = 0; i < t.rank && i < FKDA_MAX_RANK; ++i)
    if (t.shape[i] > 1) axes[count++] = i;
  for (int32_t i = 1; i < count; ++i)  // by stride; at most FKDA_MAX_RANK axes
    for (int32_t j = i; j > 0 && t.strides[axes[j]] < t.strides[axes[j - 1]]; --j) std::swap(axes[j], axes[j - 1]);
  int64_t reach = 1;  // elements spanned by the axes seen so far
  for (int32_t c = 0; c < count; ++c) {
    const int32_t axis = axes[c];
    if (t.strides[axis] < reach) {
      invalid(std::string(name) + ": strides " + join(t.strides, t.rank) +
              " make elements overlap; an output needs distinct addresses");
    }
    reach = saturating_mul(t.strides[axis], t.shape[axis]);
  }
}

int64_t used_stride(const fkda_tensor& t, int32_t axis) {
  return is_empty(t) || t.shape[axis] <= 1 ? 0 : t.strides[axis];
}

ActView act_view(const fkda_tensor& t) {
  ActView view;
  view.data = t.data;
  view.stride_b = used_stride(t, 0);
  view.stride_t = used_stride(t, 1);
  view.stride_h = used_stride(t, 2);
  return view;
}

void fill_recurrence_call(const Plan& plan, const Activations& a, const fkda_tensor& cu_seqlens, int64_t batch,
                          int64_t tokens, int64_t num_seqs, float scale, RecurrenceCall& call) {
  call.batch = batch;
  call.seq_len = tokens;
  call.num_seqs = num_seqs;
  call.num_heads = plan.num_heads;
  call.head_dim_k = plan.head_dim_k;
  call.head_dim_v = plan.head_dim_v;
  call.q = act_view(a.q);
  call.k = act_view(a.k);
  call.v = act_view(a.v);
  call.g = act_view(a.g);
  call.beta = act_view(a.beta);
  call.out = act_view(a.out);
  call.A_log = present(a.A_log) && !is_empty(a.A_log) ? static_cast<const float*>(a.A_log.data) : nullptr;
  call.dt_bias = present(a.dt_bias) && !is_empty(a.dt_bias) ? static_cast<const float*>(a.dt_bias.data) : nullptr;
  call.gate.gate_mode = plan.gate_mode;
  call.gate.beta_mode = plan.beta_mode;
  call.gate.g_is_f32 = a.g.dtype == FKDA_DTYPE_F32;
  call.gate.beta_is_f32 = a.beta.dtype == FKDA_DTYPE_F32;
  call.state_dtype = plan.state_dtype;
  call.state_layout = plan.state_layout;
  call.null_slot_rule = plan.null_slot_rule;
  if (present(cu_seqlens)) call.cu_seqlens = SeqOffsets{cu_seqlens.data, cu_seqlens.dtype, cu_seqlens.strides[0]};
  call.scale = scale;
  call.lower_bound = plan.lower_bound.load();
  call.debug_checks = plan.debug_checks;
}

// GPU kernels move rows of 8 bf16 in 16-byte accesses.
void check_gpu_alignment(const fkda_tensor& t, const char* name) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) {
    invalid(std::string(name) + ": GPU plans need 16-byte aligned data");
  }
  for (int32_t i = 0; i + 1 < t.rank; ++i) {
    if (t.shape[i] > 1 && t.strides[i] % 8 != 0) {
      invalid(std::string(name) + ": GPU plans need strides that are multiples of 8 elements "
              "(16 bytes), got " + join(t.strides, t.rank));
    }
  }
}

namespace {

// Where a pointer lives, through the driver's unified addressing.
enum class Residency { kUnknown, kHost, kDevice };

struct PointerInfo {
  Residency residency = Residency::kUnknown;
  int device = -1;
};

PointerInfo pointer_info(const cuda::Driver& d, const void* data) {
  PointerInfo info;
  unsigned int memory_type = 0;
  int ordinal = -1;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* values[] = {&memory_type, &ordinal};
  CUresult result = d.cuPointerGetAttributes(2, attributes, values,
                                             reinterpret_cast<CUdeviceptr>(data));
  // Memory the driver does not know (plain malloc, stack) reports no type.
  if (result != CUDA_SUCCESS || memory_type == 0) {
    info.residency = Residency::kHost;
  } else if (memory_type == CU_MEMORYTYPE_DEVICE || memory_type == CU_MEMORYTYPE_UNIFIED) {
    info.residency = Residency::kDevice;
    info.device = ordinal;
  } else {
    info.residency = Residency::kHost;
  }
  return info;
}

}  // namespace

void check_residency(const Plan& plan, const ArgList<Located>& pointers) {
  if (plan.backend == FKDA_BACKEND_GPU) {
    const cuda::Driver* d = cuda::driver();
    CUdevice device = cuda::current_device();
    for (const Located& l : pointers) {
      if (l.data == nullptr) continue;
      PointerInfo info = pointer_info(*d, l.data);
      if (info.residency != Residency::kDevice) {
        invalid(std::string(l.name) + ": host memory passed to a GPU plan (expected device memory "
                "on device " + std::to_string(device) + ")");
      }
      if (info.device != device) {
        invalid(std::string(l.name) + ": memory on device " + std::to_string(info.device) +
                ", but the current context is on device " + std::to_string(device));
      }
    }
    return;
  }
  // A CPU plan dereferences every pointer on the host: device memory would
  // fault, so catch it when the process runs CUDA. Otherwise there can be no
  // device memory, and loading the driver here would start CUDA for a
  // CPU-only caller.
  const cuda::Driver* d = cuda::driver_if_started();
  if (d == nullptr) return;
  for (const Located& l : pointers) {
    if (l.data == nullptr) continue;
    if (pointer_info(*d, l.data).residency == Residency::kDevice) {
      invalid(std::string(l.name) + ": device memory passed to a CPU plan (expected host memory)");
    }
  }
}

// g, beta, A_log and dt_bias under the plan's gate and beta modes.
void check_gate_inputs(const Plan& plan, const GateInputs& a, int64_t B, int64_t T) {
  const int64_t H = plan.num_heads, K = plan.head_dim_k;
  const auto gate = [&] { return std::string("the plan's gate is ") + gate_mode_name(plan.gate_mode); };
  if (plan.gate_mode == FKDA_GATE_LOG_DECAY) {
    check_tensor(a.g, "g", {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {B, T, H, K}, Strides::kRows);
    if (present(a.A_log)) invalid("A_log: must be absent: " + gate() + ", g is the log-decay itself");
    if (present(a.dt_bias)) invalid("dt_bias: must be absent: " + gate() + ", g is the log-decay itself");
  } else {
    if (present(a.g) && a.g.dtype == FKDA_DTYPE_F32) {
      invalid("g: expected dtype bf16 (" + gate() + "; f32 g is taken with the log-decay gate only), got f32");
    }
    check_tensor(a.g, "g", {FKDA_DTYPE_BF16}, {B, T, H, K}, Strides::kRows);
    if (plan.gate_mode == FKDA_GATE_SOFTPLUS && !present(a.A_log)) {
      invalid("A_log: required tensor is missing (data NULL, rank 0): " + gate() +
              ", -exp(A_log) * softplus(g + dt_bias)");
    }
    if (present(a.A_log)) check_tensor(a.A_log, "A_log", {FKDA_DTYPE_F32}, {H}, Strides::kPacked);
    if (present(a.dt_bias)) check_tensor(a.dt_bias, "dt_bias", {FKDA_DTYPE_F32}, {H, K}, Strides::kPacked);
  }
  // beta has no packed axis of its own: any strides.
  check_tensor(a.beta, "beta", {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {B, T, H}, Strides::kFree);
}


ActivationExtents check_activations(const Plan& plan, const Activations& a) {
  const int64_t H = plan.num_heads, K = plan.head_dim_k, V = plan.head_dim_v;
  check_tensor(a.q, "q", {FKDA_DTYPE_BF16}, {kAny, kAny, kAny, kAny}, Strides::kRows);
  if (a.q.shape[2] != H) {
    invalid("q: expected " + std::to_string(H) + " heads (the plan's num_heads) on axis 2, got shape " +
            join(a.q.shape, 4));
  }
  if (a.q.shape[3] != K) {
    invalid("q: expected head dim " + std::to_string(K) + " on axis 3, got shape " + join(a.q.shape, 4));
  }
  const int64_t B = a.q.shape[0], T = a.q.shape[1];
  check_tensor(a.k, "k", {FKDA_DTYPE_BF16}, {B, T, H, K}, Strides::kRows);
  check_tensor(a.v, "v", {FKDA_DTYPE_BF16}, {B, T, H, V}, Strides::kRows);
  check_gate_inputs(plan, {a.g, a.beta, a.A_log, a.dt_bias}, B, T);
  check_tensor(a.out, "out", {FKDA_DTYPE_BF16}, {B, T, H, V}, Strides::kRows);
  check_no_overlap(a.out, "out");
  // out holds B * T * H * V distinct elements inside a span that fits in
  // int64, so the callers' B * T cannot overflow; checked all the same.
  int64_t total_tokens = 0;
  if (mul_overflows(B, T, &total_tokens)) {
    invalid("q: batch " + std::to_string(B) + " times " + std::to_string(T) + " tokens overflows");
  }
  return {B, T};
}

int64_t check_cu_seqlens(const fkda_tensor& cu, int64_t batch) {
  if (!present(cu)) return batch;
  check_tensor(cu, "cu_seqlens", {FKDA_DTYPE_I64, FKDA_DTYPE_I32}, {kAny}, Strides::kFree);
  if (cu.shape[0] < 2) {
    invalid("cu_seqlens: needs N + 1 >= 2 offsets, got " + std::to_string(cu.shape[0]));
  }
  if (cu.shape[0] > 1 && cu.strides[0] <= 0) {
    invalid("cu_seqlens: stride must be positive, got " + std::to_string(cu.strides[0]));
  }
  if (batch != 1) {
    invalid("cu_seqlens: varlen input packs all sequences into one row, so q's batch size must "
            "be 1, got " + std::to_string(batch));
  }
  return cu.shape[0] - 1;
}

namespace {

std::string str(int64_t x) { return std::to_string(x); }

}  // namespace

void check_packed_from(const fkda_tensor& t, const char* name, int32_t first_packed) {
  if (is_empty(t)) return;
  int64_t packed[FKDA_MAX_RANK] = {};
  int64_t expected = 1;
  bool ok = true;
  for (int32_t i = std::min(t.rank, int32_t(FKDA_MAX_RANK)) - 1; i >= first_packed; --i) {
    packed[i] = expected;
    if (t.shape[i] > 1 && t.strides[i] != expected) ok = false;
    expected = saturating_mul(expected, t.shape[i]);
  }
  if (!ok) {
    std::string want = "[";
    for (int32_t i = 0; i < t.rank && i < FKDA_MAX_RANK; ++i)
      want += (i ? ", " : "") + (i < first_packed ? std::string("*") : str(packed[i]));
    invalid(std::string(name) + ": each state must be contiguous, expected strides " + want + "], got " +
            join(t.strides, t.rank));
  }
  check_no_overlap(t, name);
}

Extents state_shape(const Plan& plan, std::initializer_list<int64_t> leading) {
  Extents shape;
  for (int64_t extent : leading) shape.at[shape.rank++] = extent;
  const bool vk = plan.state_layout == FKDA_STATE_LAYOUT_VK;
  shape.at[shape.rank++] = plan.num_heads;
  shape.at[shape.rank++] = vk ? plan.head_dim_v : plan.head_dim_k;
  shape.at[shape.rank++] = vk ? plan.head_dim_k : plan.head_dim_v;
  return shape;
}

void check_shape(const fkda_tensor& t, const char* name, const Extents& shape) {
  bool ok = t.rank == shape.rank;
  for (int32_t i = 0; ok && i < shape.rank; ++i) ok = shape[i] == kAny || t.shape[i] == shape[i];
  if (ok) return;
  std::string want = "[";
  for (int32_t i = 0; i < shape.rank; ++i) want += (i ? ", " : "") + (shape[i] == kAny ? "*" : str(shape[i]));
  invalid(std::string(name) + ": expected shape " + want + "], got " + join(t.shape, t.rank));
}

PoolView check_pool(const Plan& plan, const fkda_tensor& t, const char* name) {
  if (present(t) && t.dtype != plan.state_dtype) {
    invalid(std::string(name) + ": expected dtype " + dtype_name(plan.state_dtype) +
            " (the plan's state_dtype), got " + dtype_name(t.dtype));
  }
  check_tensor(t, name, {plan.state_dtype}, {kAny, kAny, kAny, kAny}, Strides::kRows);
  check_shape(t, name, state_shape(plan, {kAny}));
  check_packed_from(t, name, 1);
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

IndexView check_indices(const fkda_tensor& t, const char* name, int64_t rows, int64_t cols, bool allow_bool) {
  const std::initializer_list<int32_t> integers = {FKDA_DTYPE_I32, FKDA_DTYPE_I64};
  const std::initializer_list<int32_t> flags = {FKDA_DTYPE_BOOL, FKDA_DTYPE_I32, FKDA_DTYPE_I64};
  if (cols == 0) {
    check_tensor(t, name, allow_bool ? flags : integers, {rows}, Strides::kFree);
  } else {
    check_tensor(t, name, allow_bool ? flags : integers, {rows, cols}, Strides::kFree);
  }
  return index_view(t);
}

void check_workspace(const void* workspace, size_t workspace_bytes, size_t required, const std::string& sizes,
                     const char* size_call) {
  if (workspace_bytes < required) {
    fail(FKDA_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes: " + std::to_string(workspace_bytes) + " bytes given, " +
                                             std::to_string(required) + " needed for " + sizes + " (" + size_call +
                                             ")");
  }
  if (required > 0 && workspace == nullptr) {
    invalid("workspace: NULL, but " + std::to_string(required) + " bytes are needed");
  }
  if (required > 0 && reinterpret_cast<uintptr_t>(workspace) % 16 != 0) invalid("workspace: must be 16-byte aligned");
}

void check_gpu_rows(const Plan& plan, const ArgList<Named>& tensors) {
  if (plan.backend != FKDA_BACKEND_GPU) return;
  for (const Named& t : tensors)
    if (present(*t.tensor) && !is_empty(*t.tensor)) check_gpu_alignment(*t.tensor, t.name);
}

// check_tensor has bounded the span, so nothing here overflows.
Operand Operand::tensor(const fkda_tensor& t, const char* name, bool written) {
  Operand o{name, 0, 0, written};
  if (!present(t) || is_empty(t)) return o;
  int64_t last = 0;
  for (int32_t i = 0; i < t.rank; ++i) last += (t.shape[i] - 1) * used_stride(t, i);
  o.first = reinterpret_cast<uintptr_t>(t.data);
  o.last = o.first + uintptr_t(last + 1) * uintptr_t(element_bytes(t.dtype));
  return o;
}

Operand Operand::bytes(const void* data, size_t size, const char* name, bool written) {
  Operand o{name, 0, 0, written};
  if (data == nullptr || size == 0) return o;
  o.first = reinterpret_cast<uintptr_t>(data);
  o.last = size > std::numeric_limits<uintptr_t>::max() - o.first ? std::numeric_limits<uintptr_t>::max()
                                                                   : o.first + size;
  return o;
}

// Spans, not elements: two views that interleave without sharing an
// element are refused too. No caller needs an output threaded through the
// gaps of another argument, and the span test has no blind spot.
void check_no_shared_memory(const ArgList<Operand>& operands,
                            std::initializer_list<std::pair<const char*, const char*>> in_place) {
  auto may_be_same = [&](const Operand& a, const Operand& b) {
    for (const auto& [read, written] : in_place) {
      if ((std::strcmp(a.name, read) == 0 && std::strcmp(b.name, written) == 0) ||
          (std::strcmp(a.name, written) == 0 && std::strcmp(b.name, read) == 0)) {
        return true;
      }
    }
    return false;
  };
  for (size_t j = 0; j < operands.size(); ++j) {
    const Operand& b = operands[j];
    if (b.first == b.last) continue;
    for (size_t i = 0; i < j; ++i) {
      const Operand& a = operands[i];
      if (a.first == a.last || !(a.written || b.written)) continue;
      if (!(a.first < b.last && b.first < a.last)) continue;
      const bool identical = a.first == b.first && a.last == b.last;
      const Operand& named = b.written ? b : a;
      const Operand& other = b.written ? a : b;
      if (may_be_same(a, b)) {
        if (identical) continue;
        invalid(std::string(named.name) + ": partly overlaps " + other.name +
                "; the two may be the very same memory (updated in place) or disjoint, nothing between");
      }
      invalid(std::string(named.name) + ": overlaps " + other.name + "; memory a call writes must not be " +
              "shared with any other argument");
    }
  }
}

}  // namespace checks
}  // namespace fkda
