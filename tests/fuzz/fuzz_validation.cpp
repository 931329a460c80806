// libFuzzer target over the argument checks of the C ABI, on CPU plans.
//
// Each fkda_fwd input builds a valid call, then applies faults to it: an
// extent, a stride, a dtype, a data pointer moved or replaced, a workspace,
// a scale. Whatever the faults:
//  - the library touches no memory outside the buffers the call describes
//    (ASan) and computes no size that overflows (UBSan);
//  - a call the header forbids (a span that cannot exist, a misaligned or
//    NULL pointer, a negative stride, a wrong rank or dtype) is rejected;
//  - a call without faults succeeds;
//  - a rejected call's message starts with the name of an argument, and no
//    output, in-place state or workspace byte has changed.
// Calls whose descriptors are possible but reach past the buffers the
// harness allocated are not made: no library can tell those from valid ones.
// The other inputs drive fkda_plan_workspace_size (and the GPU sizing
// behind it) and fkda_plan_create with arbitrary values.
//
// Input layout (tests/fuzz/make_seeds.py writes inputs in it): read front to
// back, every read past the end is 0; "pick n" is one byte modulo n.
//   pick 3: 0 fkda_fwd, 1 workspace sizes, 2 fkda_plan_create
//   fkda_fwd: pick kMaxHeads (heads - 1), flags byte (kFlag*), leniency
//     byte (kLenient*), then batched: pick kMaxBatch + 1 (B), pick
//     kMaxTokens + 1 (T); varlen: pick kMaxSeqs (N - 1) and N times pick
//     kMaxTokens + 1 (lengths); then faults to the end: pick kTargets (a
//     tensor of kSlots, or kScalars), pick field, value
//   workspace sizes: pick kMaxSizingHeads (heads - 1), value (total_tokens), value
//     (num_seqs), 4 bytes (raw num_heads of the GPU sizing)
//   fkda_plan_create: value for each field of fkda_plan_desc in order,
//     then 4 bytes (the float passed to fkda_set_lower_bound)
//   value: pick 4: 0 pick kEdges, 1 eight bytes little-endian, 2 current
//     plus a signed byte, 3 current shifted left by pick 64
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "error.h"
#include "flashkda.h"
#include "gpu/gpu_backend.h"

namespace {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return at_ >= size_; }
  uint8_t byte() { return at_ < size_ ? data_[at_++] : 0; }
  uint64_t bytes(int count) {
    uint64_t value = 0;
    for (int i = 0; i < count; ++i) value |= uint64_t(byte()) << (8 * i);
    return value;
  }
  size_t pick(size_t n) { return byte() % n; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

// Values on the edges of the checks: element and row sizes, 32-bit limits,
// powers near 2^63, and an address 1 KiB below the end of the address space.
constexpr int64_t kEdges[] = {
    0, 1, -1, 2, 3, 7, 8, 15, 16, 17, 127, 128, 129, 255, 256, 1024, int64_t(1) << 16,
    (int64_t(1) << 31) - 1, int64_t(1) << 31, int64_t(1) << 32, int64_t(1) << 40, int64_t(1) << 61,
    int64_t(1) << 62, (int64_t(1) << 62) + 1, kMax / 3, kMax - 1, kMax, kMin, kMin + 1, -1024,
    -(int64_t(1) << 62)};

int64_t value(Input& in, int64_t current) {
  switch (in.pick(4)) {
    case 0: return kEdges[in.pick(sizeof kEdges / sizeof kEdges[0])];
    case 1: return int64_t(in.bytes(8));
    case 2: return int64_t(uint64_t(current) + uint64_t(int64_t(int8_t(in.byte()))));
    default: return int64_t(uint64_t(current) << in.pick(64));
  }
}

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz_validation: %s\n", what.c_str());
  std::abort();
}

// One allocation of exactly the bytes a valid descriptor spans, so that ASan
// reports any access past it.
struct Buffer {
  std::unique_ptr<unsigned char[]> bytes;
  size_t size = 0;
  explicit Buffer(size_t n, unsigned char fill = 0) : bytes(new unsigned char[n > 0 ? n : 1]), size(n) {
    std::memset(bytes.get(), fill, size);
  }
  uintptr_t begin() const { return reinterpret_cast<uintptr_t>(bytes.get()); }
};

// Bytes of each fkda_dtype, in the enum's order (INVALID as 1).
constexpr int64_t kElementBytes[] = {1, 2, 2, 4, 4, 8, 1};

int64_t element_bytes(int32_t dtype) {
  return dtype >= 0 && dtype < int32_t(sizeof kElementBytes / sizeof kElementBytes[0]) ? kElementBytes[dtype] : 1;
}

bool present(const fkda_tensor& t) { return !(t.data == nullptr && t.rank == 0); }

// A tensor argument: what the header demands of it, and the buffer behind it.
struct Slot {
  const char* name;
  fkda_tensor* tensor;
  const Buffer* buffer;  // nullptr: absent in the valid call
  bool required;
  int32_t rank;
  std::vector<int32_t> dtypes;
};

// How a tensor's descriptor relates to its buffer.
enum class Reach {
  kInside,     // everything it can address lies in the buffer (or nothing: empty or absent)
  kForbidden,  // the header rejects it: the call must fail
  kOutside,    // possible, but past the buffer: the call is not made
};

Reach reach(const Slot& s) {
  const fkda_tensor& t = *s.tensor;
  if (!present(t)) return s.required ? Reach::kForbidden : Reach::kInside;
  if (t.rank != s.rank) return Reach::kForbidden;
  if (std::find(s.dtypes.begin(), s.dtypes.end(), t.dtype) == s.dtypes.end()) return Reach::kForbidden;
  bool empty = false;
  for (int32_t i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0) return Reach::kForbidden;
    empty = empty || t.shape[i] == 0;
  }
  if (empty) return Reach::kInside;
  if (t.data == nullptr) return Reach::kForbidden;
  __int128 last = 0;
  for (int32_t i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 1) continue;
    if (t.strides[i] < 0) return Reach::kForbidden;
    const __int128 step = __int128(t.shape[i] - 1) * t.strides[i];
    if (step > kMax) return Reach::kForbidden;  // and keeps the sum within __int128
    last += step;
  }
  const int64_t size = element_bytes(t.dtype);
  const __int128 span = (last + 1) * size;
  const uintptr_t data = reinterpret_cast<uintptr_t>(t.data);
  if (span > kMax || __int128(data) + span > (__int128(1) << 64)) return Reach::kForbidden;
  if (data % uintptr_t(size) != 0) return Reach::kForbidden;
  if (s.buffer == nullptr || data < s.buffer->begin() ||
      __int128(data) + span > __int128(s.buffer->begin()) + __int128(s.buffer->size)) {
    return Reach::kOutside;
  }
  return Reach::kInside;
}

bool names_an_argument(const std::string& message, const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    if (message.compare(0, n.size() + 1, n + ":") == 0) return true;
  }
  return false;
}

bool untouched(const Buffer& b, unsigned char canary) {
  return std::all_of(b.bytes.get(), b.bytes.get() + b.size, [&](unsigned char c) { return c == canary; });
}

// The valid call's options.
constexpr uint8_t kFlagVarlen = 1, kFlagBf16State = 2, kFlagKvLayout = 4, kFlagInitialState = 8,
                  kFlagFinalState = 16, kFlagInPlace = 32, kFlagI32Offsets = 64, kFlagPadded = 128;
// Descriptors the header allows although they look odd: junk strides on the
// tensors of a call without tokens, and on axes of extent 1.
constexpr uint8_t kLenientEmptyStrides = 1, kLenientUnitAxisStrides = 2;

// Valid calls stay small: what passes validation runs the CPU backend under
// the sanitizers, a few milliseconds a chunk. Two of each make every axis
// one that strides matter on; 17 tokens make two chunks.
constexpr size_t kMaxHeads = 2, kMaxBatch = 2, kMaxSeqs = 3, kMaxTokens = 17;
// Sizing runs nothing: more heads, so that sequences times heads can overflow.
constexpr size_t kMaxSizingHeads = 4;

constexpr int kSlots = 11;  // q k v g beta A_log dt_bias out initial_state final_state cu_seqlens
constexpr int kScalars = kSlots;
constexpr int kTargets = kSlots + 1;
constexpr int kTensorFields = 17;
constexpr int kScalarFields = 5;
constexpr unsigned char kCanary = 0xA5;
constexpr int64_t kD = 128;

fkda_tensor describe(const Buffer& buffer, int32_t dtype, std::vector<int64_t> shape,
                     std::vector<int64_t> strides) {
  fkda_tensor t = FKDA_TENSOR_NONE;
  t.data = buffer.bytes.get();
  t.dtype = dtype;
  t.rank = int32_t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

size_t span_bytes(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, int64_t size) {
  int64_t last = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    last += (shape[i] - 1) * strides[i];
  }
  return size_t((last + 1) * size);
}

// Strides the header says are never looked at: all of an empty tensor's,
// and those of axes of extent 1.
void junk_strides(fkda_tensor& t, uint8_t lenient) {
  bool empty = false;
  for (int32_t i = 0; i < t.rank; ++i) empty = empty || t.shape[i] == 0;
  for (int32_t i = 0; i < t.rank; ++i) {
    if (empty && (lenient & kLenientEmptyStrides)) t.strides[i] = i % 2 ? 0 : -(int64_t(1) << 62);
    else if (t.shape[i] == 1 && (lenient & kLenientUnitAxisStrides)) t.strides[i] = -3;
  }
}

void apply_tensor_fault(Input& in, fkda_tensor& t) {
  const size_t field = in.pick(kTensorFields);
  switch (field) {
    case 0: t.data = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(t.data) + uint64_t(value(in, 0))); break;
    case 1: t.data = reinterpret_cast<void*>(uintptr_t(value(in, 0))); break;
    case 2: t.dtype = int32_t(value(in, t.dtype)); break;
    case 3: t.rank = int32_t(value(in, t.rank)); break;
    case 16: t = FKDA_TENSOR_NONE; break;
    default:
      if (field < 10) t.shape[field - 4] = value(in, t.shape[field - 4]);
      else t.strides[field - 10] = value(in, t.strides[field - 10]);
  }
}

void fuzz_fwd(Input& in) {
  const int64_t H = 1 + int64_t(in.pick(kMaxHeads));
  const uint8_t flags = in.byte(), lenient = in.byte();
  const bool varlen = flags & kFlagVarlen;
  std::vector<int64_t> offsets = {0};
  int64_t B = 1, T = 0;
  if (varlen) {
    const size_t N = 1 + in.pick(kMaxSeqs);
    for (size_t n = 0; n < N; ++n) offsets.push_back(offsets.back() + int64_t(in.pick(kMaxTokens + 1)));
    T = offsets.back();
  } else {
    B = int64_t(in.pick(kMaxBatch + 1));
    T = int64_t(in.pick(kMaxTokens + 1));
  }
  const int64_t N = varlen ? int64_t(offsets.size()) - 1 : B;

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(H);
  desc.backend = FKDA_BACKEND_CPU;
  desc.state_dtype = flags & kFlagBf16State ? FKDA_DTYPE_BF16 : FKDA_DTYPE_F32;
  desc.state_layout = flags & kFlagKvLayout ? FKDA_STATE_LAYOUT_KV : FKDA_STATE_LAYOUT_VK;
  fkda_plan_t plan = nullptr;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) finding("a valid CPU plan was refused");

  // Activations, with a gap after each head's row when padded.
  const int64_t pad = flags & kFlagPadded ? 8 : 0;
  const std::vector<int64_t> act_shape = {B, T, H, kD};
  const std::vector<int64_t> act_strides = {T * H * (kD + pad), H * (kD + pad), kD + pad, 1};
  const std::vector<int64_t> beta_shape = {B, T, H};
  const std::vector<int64_t> beta_strides = {T * (H + pad), H + pad, 1};
  const size_t act_bytes = span_bytes(act_shape, act_strides, 2);
  Buffer q(act_bytes, 0x3e), k(act_bytes, 0xbe), v(act_bytes, 0x3f), g(act_bytes, 0x3d), out(act_bytes, kCanary);
  Buffer beta(span_bytes(beta_shape, beta_strides, 2), 0x3e);
  Buffer A_log(size_t(H) * 4), dt_bias(size_t(H * kD) * 4);
  const int32_t state_dtype = desc.state_dtype;
  const std::vector<int64_t> state_shape = {N, H, kD, kD};
  const std::vector<int64_t> state_strides = {H * kD * kD, kD * kD, kD, 1};
  const size_t state_bytes = span_bytes(state_shape, state_strides, element_bytes(state_dtype));
  const bool in_place = flags & kFlagInPlace;
  Buffer initial_state(state_bytes, kCanary), final_state(in_place ? 0 : state_bytes, kCanary);
  const bool i32_offsets = flags & kFlagI32Offsets;
  const int64_t offset_stride = pad ? 2 : 1;
  Buffer cu_seqlens(size_t((int64_t(offsets.size()) - 1) * offset_stride + 1) * (i32_offsets ? 4 : 8));
  for (size_t i = 0; i < offsets.size(); ++i) {
    unsigned char* at = cu_seqlens.bytes.get() + i * size_t(offset_stride) * (i32_offsets ? 4 : 8);
    if (i32_offsets) {
      const int32_t o = int32_t(offsets[i]);
      std::memcpy(at, &o, 4);
    } else {
      std::memcpy(at, &offsets[i], 8);
    }
  }
  const Buffer& final_buffer = in_place ? initial_state : final_state;

  fkda_fwd_args a = FKDA_FWD_ARGS_INIT;
  a.q = describe(q, FKDA_DTYPE_BF16, act_shape, act_strides);
  a.k = describe(k, FKDA_DTYPE_BF16, act_shape, act_strides);
  a.v = describe(v, FKDA_DTYPE_BF16, act_shape, act_strides);
  a.g = describe(g, FKDA_DTYPE_BF16, act_shape, act_strides);
  a.out = describe(out, FKDA_DTYPE_BF16, act_shape, act_strides);
  a.beta = describe(beta, FKDA_DTYPE_BF16, beta_shape, beta_strides);
  a.A_log = describe(A_log, FKDA_DTYPE_F32, {H}, {1});
  a.dt_bias = describe(dt_bias, FKDA_DTYPE_F32, {H, kD}, {kD, 1});
  if (flags & kFlagInitialState) a.initial_state = describe(initial_state, state_dtype, state_shape, state_strides);
  if (flags & kFlagFinalState) a.final_state = describe(final_buffer, state_dtype, state_shape, state_strides);
  if (varlen) a.cu_seqlens = describe(cu_seqlens, i32_offsets ? FKDA_DTYPE_I32 : FKDA_DTYPE_I64,
                                      {int64_t(offsets.size())}, {offset_stride});
  a.scale = 0.088f;
  for (fkda_tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.out, &a.beta, &a.A_log, &a.dt_bias, &a.initial_state,
                         &a.final_state}) {
    if (present(*t)) junk_strides(*t, lenient);
  }

  size_t workspace_bytes = 0;
  if (fkda_plan_workspace_size(plan, B * T, N, &workspace_bytes) != FKDA_SUCCESS) {
    finding("workspace size of a valid call refused: " + std::string(fkda_last_error()));
  }
  Buffer workspace(workspace_bytes, kCanary);
  void* workspace_data = workspace.bytes.get();

  const std::vector<int32_t> bf16 = {FKDA_DTYPE_BF16}, f32 = {FKDA_DTYPE_F32}, state = {state_dtype};
  const Slot slots[kSlots] = {
      {"q", &a.q, &q, true, 4, bf16},
      {"k", &a.k, &k, true, 4, bf16},
      {"v", &a.v, &v, true, 4, bf16},
      {"g", &a.g, &g, true, 4, bf16},
      {"beta", &a.beta, &beta, true, 3, bf16},
      {"A_log", &a.A_log, &A_log, true, 1, f32},
      {"dt_bias", &a.dt_bias, &dt_bias, true, 2, f32},
      {"out", &a.out, &out, true, 4, bf16},
      {"initial_state", &a.initial_state, &initial_state, false, 4, state},
      {"final_state", &a.final_state, &final_buffer, false, 4, state},
      {"cu_seqlens", &a.cu_seqlens, &cu_seqlens, false, 1, {FKDA_DTYPE_I32, FKDA_DTYPE_I64}},
  };

  bool faulted = false;
  for (int count = 0; count < 12 && !in.done(); ++count) {
    faulted = true;
    const size_t target = in.pick(kTargets);
    if (target < size_t(kSlots)) {
      apply_tensor_fault(in, *slots[target].tensor);
      continue;
    }
    switch (in.pick(kScalarFields)) {
      case 0: workspace_data = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(workspace_data) + uint64_t(value(in, 0))); break;
      case 1: workspace_bytes = size_t(value(in, int64_t(workspace_bytes))); break;
      case 2: {
        const uint32_t bits = uint32_t(value(in, 0));
        std::memcpy(&a.scale, &bits, 4);
        break;
      }
      case 3: a.struct_size = size_t(value(in, int64_t(a.struct_size))); break;
      default: {
        const size_t i = in.pick(offsets.size());
        const int64_t o = value(in, offsets[i]);
        unsigned char* at = cu_seqlens.bytes.get() + i * size_t(offset_stride) * (i32_offsets ? 4 : 8);
        if (i32_offsets) {
          const int32_t narrow = int32_t(o);
          std::memcpy(at, &narrow, 4);
        } else {
          std::memcpy(at, &o, 8);
        }
      }
    }
  }

  bool forbidden = a.struct_size != sizeof(fkda_fwd_args) || !std::isfinite(a.scale) ||
                   workspace_data == nullptr || reinterpret_cast<uintptr_t>(workspace_data) % 16 != 0;
  bool outside = reinterpret_cast<uintptr_t>(workspace_data) < workspace.begin() ||
                 __int128(reinterpret_cast<uintptr_t>(workspace_data)) + workspace_bytes >
                     __int128(workspace.begin()) + workspace.size;
  for (const Slot& s : slots) {
    const Reach r = reach(s);
    forbidden = forbidden || r == Reach::kForbidden;
    outside = outside || r == Reach::kOutside;
  }
  // Nothing is read when a forbidden descriptor is rejected, so the call is
  // safe to make even when another one reaches past its buffer.
  if (outside && !forbidden) {
    fkda_plan_destroy(plan);
    return;
  }

  const fkda_status status = fkda_fwd(plan, &a, workspace_data, workspace_bytes, nullptr);
  const std::string message = fkda_last_error();
  if (status == FKDA_SUCCESS) {
    if (forbidden) finding("a call the header forbids was accepted");
    if (!message.empty()) finding("a successful call left a message: " + message);
  } else {
    if (!faulted) finding("a valid call was rejected: " + message);
    static const std::vector<std::string> names = {
        "args", "plan", "q", "k", "v", "g", "beta", "A_log", "dt_bias", "out", "initial_state", "final_state",
        "cu_seqlens", "scale", "workspace", "workspace_bytes"};
    if (!names_an_argument(message, names)) finding("a rejection names no argument: '" + message + "'");
    const Buffer* written_buffers[] = {&out, &final_buffer, &workspace};
    for (const Buffer* written : written_buffers) {
      if (!untouched(*written, kCanary)) finding("a rejected call wrote to an output (" + message + ")");
    }
  }
  fkda_plan_destroy(plan);
}

void fuzz_workspace_sizes(Input& in) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(1 + in.pick(kMaxSizingHeads));
  desc.backend = FKDA_BACKEND_CPU;
  fkda_plan_t plan = nullptr;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) finding("a valid CPU plan was refused");
  const int64_t total_tokens = value(in, 0), num_seqs = value(in, 0);
  size_t bytes = 0;
  const fkda_status status = fkda_plan_workspace_size(plan, total_tokens, num_seqs, &bytes);
  const std::string message = fkda_last_error();
  const bool valid = total_tokens >= 0 && num_seqs >= 0;
  if (valid && (status != FKDA_SUCCESS || bytes == 0)) finding("CPU workspace size refused: " + message);
  if (!valid && (status != FKDA_ERROR_INVALID_ARGUMENT ||
                 !names_an_argument(message, {"total_tokens", "num_seqs"}))) {
    finding("negative sizes not rejected by name: " + message);
  }
  fkda_plan_destroy(plan);
  // The GPU sizing cannot be reached through a plan on a machine without a
  // GPU; it is called directly. It may refuse (UNSUPPORTED), never overflow.
  const int32_t gpu_heads = int32_t(uint32_t(in.bytes(4)));
  try {
    fkda::gpu::workspace_size(total_tokens, num_seqs, gpu_heads);
  } catch (const fkda::Error& e) {
    if (e.status != FKDA_ERROR_UNSUPPORTED) finding("GPU workspace sizing failed with " + e.message);
  }
}

void fuzz_plan_create(Input& in) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.struct_size = size_t(value(in, int64_t(desc.struct_size)));
  desc.num_heads = int32_t(value(in, desc.num_heads));
  desc.head_dim_k = int32_t(value(in, desc.head_dim_k));
  desc.head_dim_v = int32_t(value(in, desc.head_dim_v));
  desc.state_dtype = int32_t(value(in, desc.state_dtype));
  desc.state_layout = int32_t(value(in, desc.state_layout));
  desc.backend = int32_t(value(in, desc.backend));
  const uint32_t floor_bits = uint32_t(value(in, 0));
  std::memcpy(&desc.lower_bound, &floor_bits, 4);
  desc.null_slot_rule = int32_t(value(in, desc.null_slot_rule));
  desc.debug_checks = int32_t(value(in, desc.debug_checks));
  fkda_plan_t plan = nullptr;
  const fkda_status status = fkda_plan_create(&desc, &plan);
  if (status != FKDA_SUCCESS) {
    if (plan != nullptr) finding("a refused plan was returned");
    if (!names_an_argument(fkda_last_error(), {"desc", "desc.num_heads", "desc.head_dim_k", "desc.head_dim_v",
                                               "desc.state_dtype", "desc.state_layout", "desc.backend",
                                               "desc.lower_bound", "desc.null_slot_rule", "desc.debug_checks"})) {
      finding(std::string("a refused plan names no field: ") + fkda_last_error());
    }
    return;
  }
  const uint32_t bits = uint32_t(in.bytes(4));
  float lower_bound = 0;
  std::memcpy(&lower_bound, &bits, 4);
  const bool in_range = lower_bound >= -5.f && lower_bound <= 0.f;
  if ((fkda_set_lower_bound(plan, lower_bound) == FKDA_SUCCESS) != in_range) {
    finding("fkda_set_lower_bound disagrees with [-5, 0] for " + std::to_string(lower_bound));
  }
  fkda_plan_destroy(plan);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  switch (in.pick(3)) {
    case 0: fuzz_fwd(in); break;
    case 1: fuzz_workspace_sizes(in); break;
    default: fuzz_plan_create(in);
  }
  return 0;
}
