// SPDX-License-Identifier: MIT
// libFuzzer target over the argument checks of the C ABI, on CPU plans.
//
// Each fkda_fwd or fkda_decode input builds a valid call (with states,
// pools, slot tables, checkpoints, padding sequences, the layer step's
// convolution, conv states and output gate as its flags say), then
// applies faults to it: an extent, a stride, a dtype, a data pointer moved,
// replaced or pointed into another argument's buffer, an element of an index
// tensor, a workspace, a scale, a struct_size (every size from 0 to the
// current one plus 64, with or without a non-zero byte where a newer
// header's fields would be). Whatever the faults:
//  - the library touches no memory outside the buffers the call describes
//    (ASan) and computes no size that overflows (UBSan);
//  - a call the header forbids (a span that cannot exist, a misaligned or
//    NULL pointer, a negative stride, a wrong rank or dtype, a struct_size
//    no release had, memory written by the call shared with another
//    argument, a layer step part without what it needs, a convolution on
//    a fkda_fwd plan without layer_step or on a slot table) is rejected;
//  - a call without faults succeeds, and so does one whose only faults are
//    to index elements the header says the call never reads;
//  - a rejected call's message starts with the name of an argument, and no
//    output, in-place state or workspace byte has changed.
// An earlier release's struct_size is modelled: the fields past it are
// absent to the oracle.
// Calls whose descriptors are possible but reach past the buffers the
// harness allocated are not made: no library can tell those from valid ones.
// The other inputs drive fkda_plan_workspace_size (and the GPU sizing
// behind it), fkda_plan_decode_workspace_size and fkda_plan_create with
// arbitrary values.
//
// Input layout (tests/fuzz/make_seeds.py writes inputs in it): read front to
// back, every read past the end is 0; "pick n" is one byte modulo n.
//   pick 4: 0 fkda_fwd, 1 workspace sizes, 2 fkda_plan_create, 3 fkda_decode
//   fkda_fwd: flags byte (kFlag*), serving byte (kServing*), leniency byte
//     (kLenient*), layer, sizes, then faults to the end
//   fkda_decode: flags byte (kFlag*, with kDecode* in the bits of the
//     initial and final state flags), leniency byte, layer, sizes (tokens
//     up to kMaxDecodeTokens), then faults to the end
//   layer: a byte (kLayer*), and when it is not 0 a byte (kShape*: W - 2
//     in its low two bits modulo 3, then Wc, the norm weight's dtype, a
//     fkda_fwd plan without layer_step)
//   sizes: pick kMaxHeads (heads - 1), then batched: pick kMaxBatch + 1 (B),
//     pick kMaxTokens + 1 (T); varlen: pick kMaxSeqs (N - 1) and N lengths
//     (pick kMaxTokens + 1 each)
//   a fault: pick (the call's tensor arguments + 1): a tensor argument, in
//     the order the call adds them, then pick kTensorFields and a value (17:
//     into another buffer, pick the buffer, a byte: odd at its start, else
//     2 bytes of offset; the layer step's tensors come last, in the
//     struct's order); or the scalars, then pick kScalarFields: 0 workspace
//     moved, 1 workspace_bytes, 2 scale, 3 struct_size a value,
//     4 a cu_seqlens entry (pick its index, a value), 5 an index element
//     (pick the tensor, 2 bytes of element, a byte: odd one of
//     kContentValues, else a value), 6 struct_size (2 bytes modulo sizeof +
//     65, a byte: odd a non-zero byte past the fields, pick 72 its offset, a
//     byte its value), 7 layer.out_norm_eps (a value's low 4 bytes), 8
//     layer.reserved (a value)
//   workspace sizes: pick kMaxSizingHeads (heads - 1), value (total_tokens),
//     value (num_seqs), 4 bytes (raw num_heads of the GPU sizing)
//   fkda_plan_create: value for each field of fkda_plan_desc in order
//     (lower_bound's bits from -5's), then 4 bytes (the float passed to
//     fkda_set_lower_bound)
//   value: pick 4: 0 pick kEdges, 1 eight bytes little-endian, 2 current
//     plus a signed byte, 3 current shifted left by pick 64
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
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
  int32_t other_rank = -1;  // a second rank the header allows, or -1
};

// How a tensor's descriptor relates to its buffer.
enum class Reach {
  kInside,     // everything it can address lies in the buffer (or nothing: empty or absent)
  kForbidden,  // the header rejects it: the call must fail
  kOutside,    // possible, but past the buffer: the call is not made
};

// [first, last) bytes a present, non-empty descriptor covers.
struct Span {
  uintptr_t first = 0, last = 0;
};

// `buffers`: where a tensor may lie, its own buffer or another argument's
// (an alias); never the workspace, whose used part the oracle cannot size.
Reach reach(const Slot& s, const std::vector<const Buffer*>& buffers, Span* span) {
  *span = Span{};
  const fkda_tensor& t = *s.tensor;
  if (!present(t)) return s.required ? Reach::kForbidden : Reach::kInside;
  if (t.rank != s.rank && t.rank != s.other_rank) return Reach::kForbidden;
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
  const __int128 bytes = (last + 1) * size;
  const uintptr_t data = reinterpret_cast<uintptr_t>(t.data);
  if (bytes > kMax || __int128(data) + bytes > (__int128(1) << 64)) return Reach::kForbidden;
  if (data % uintptr_t(size) != 0) return Reach::kForbidden;
  for (const Buffer* b : buffers) {
    if (data >= b->begin() && __int128(data) + bytes <= __int128(b->begin()) + __int128(b->size)) {
      *span = Span{data, uintptr_t(__int128(data) + bytes)};
      return Reach::kInside;
    }
  }
  return Reach::kOutside;
}

// What the header says each call writes: such memory is shared with no
// other argument, but initial_state and final_state may be the same.
bool conv_state(const std::string& name) { return name.compare(0, 16, "layer.conv_state") == 0; }

bool written_argument(const std::string& name) {
  return name == "out" || name == "final_state" || name == "checkpoints" || name == "state_pool" ||
         conv_state(name);
}

// "q: ...", or an element of one: "state_indices[2]: ...".
bool names_an_argument(const std::string& message, const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    if (message.compare(0, n.size(), n) == 0 && message.size() > n.size() &&
        (message[n.size()] == ':' || message[n.size()] == '[')) {
      return true;
    }
  }
  return false;
}

bool untouched(const Buffer& b, unsigned char canary) {
  return std::all_of(b.bytes.get(), b.bytes.get() + b.size, [&](unsigned char c) { return c == canary; });
}

// The valid call's options.
constexpr uint8_t kFlagVarlen = 1, kFlagBf16State = 2, kFlagKvLayout = 4, kFlagInitialState = 8,
                  kFlagFinalState = 16, kFlagInPlace = 32, kFlagI32Offsets = 64, kFlagPadded = 128;
// fkda_fwd's states in a pool, has_initial_state, checkpoints (to a tensor,
// or to pool slots).
// kServingPadding: sequence 0 padding, and unread entries holding garbage;
// kServingSharedStates: initial_state and final_state side by side in one buffer.
constexpr uint8_t kServingPool = 1, kServingHasInitial = 2, kServingCheckpoints = 4, kServingCheckpointSlots = 8,
                  kServingPadding = 16, kServingSharedStates = 32;
// fkda_decode: indices as an [N, W] slot table, with num_accepted_tokens;
// padding (the last sequence) and unread entries holding garbage.
constexpr uint8_t kDecodeTable = 8, kDecodeAccepted = 16, kDecodePadding = 32;
// The layer step of the valid call (a layer byte): the convolution, with
// biases, with conv states, f32 weights and biases, f32 conv states, weights
// and states channel-last, the three states as the channel blocks of one
// pool tensor; the output gate.
constexpr uint8_t kLayerConv = 1, kLayerBias = 2, kLayerConvStates = 4, kLayerF32Weights = 8, kLayerF32States = 16,
                  kLayerChannelLast = 32, kLayerOnePool = 64, kLayerGate = 128;
// The byte after a non-zero layer byte: W - 2 (its two low bits, modulo 3),
// Wc = W rather than W - 1, an f32 norm weight, and for fkda_fwd a plan
// created without layer_step (so that the convolution must be refused).
constexpr uint8_t kShapeWidths = 3, kShapeFullStateWidth = 4, kShapeF32NormWeight = 8, kShapeNoPlanFlag = 16;
// Descriptors the header allows although they look odd: junk strides on
// empty tensors, and on axes of extent 1.
constexpr uint8_t kLenientEmptyStrides = 1, kLenientUnitAxisStrides = 2;

// Valid calls stay small: what passes validation runs the CPU backend under
// the sanitizers, a few milliseconds a chunk. Two of each make every axis
// one that strides matter on; 17 tokens make two chunks, and a checkpoint.
constexpr size_t kMaxHeads = 2, kMaxBatch = 2, kMaxSeqs = 3, kMaxTokens = 17, kMaxDecodeTokens = 16;
// Sizing runs nothing: more heads, so that sequences times heads can overflow.
constexpr size_t kMaxSizingHeads = 4;

constexpr int kTensorFields = 18;
constexpr int kScalarFields = 9;
constexpr unsigned char kCanary = 0xA5;
constexpr int64_t kD = 128;

size_t span_bytes(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, int64_t size) {
  int64_t last = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    last += (shape[i] - 1) * strides[i];
  }
  return size_t((last + 1) * size);
}

std::vector<int64_t> packed_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

// The buffers and tensor arguments of one call, and what the header
// demands of each argument.
// A packed i32 or i64 index tensor of the valid call, [rows, cols] (cols 1
// for [rows]), whose elements content faults change.
struct Indices {
  const char* name;
  Buffer* buffer;
  bool i32;
  int64_t rows, cols;

  int64_t at(int64_t e) const {
    if (i32) {
      int32_t v = 0;
      std::memcpy(&v, buffer->bytes.get() + size_t(e) * 4, 4);
      return v;
    }
    int64_t v = 0;
    std::memcpy(&v, buffer->bytes.get() + size_t(e) * 8, 8);
    return v;
  }
  void store(int64_t e, int64_t v) const {
    if (i32) {
      const int32_t narrow = int32_t(v);
      std::memcpy(buffer->bytes.get() + size_t(e) * 4, &narrow, 4);
    } else {
      std::memcpy(buffer->bytes.get() + size_t(e) * 8, &v, 8);
    }
  }
};

struct Call {
  std::deque<Buffer> buffers;
  std::vector<Indices> indices;
  std::vector<Slot> slots;
  std::vector<const Buffer*> written;  // must be unchanged after a rejection
  const Buffer* offsets = nullptr;     // cu_seqlens' buffer, when varlen
  int64_t offset_count = 0, offset_stride = 1;
  bool i32_offsets = false;

  // An argument over a new buffer of exactly its span; `written` ones start
  // as the canary. Returns the buffer so that the caller can fill it.
  Buffer& add(Slot slot, int32_t dtype, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
              bool written_by_call, unsigned char fill = 0) {
    Buffer& b = buffers.emplace_back(span_bytes(shape, strides, element_bytes(dtype)),
                                     written_by_call ? kCanary : fill);
    over(slot, b, dtype, shape, strides);
    if (written_by_call) written.push_back(&b);
    return b;
  }
  // An argument over an existing buffer (a state updated in place).
  void over(Slot slot, const Buffer& b, int32_t dtype, const std::vector<int64_t>& shape,
            const std::vector<int64_t>& strides) {
    fkda_tensor& t = *slot.tensor;
    t = FKDA_TENSOR_NONE;
    t.data = b.bytes.get();
    t.dtype = dtype;
    t.rank = int32_t(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
      t.shape[i] = shape[i];
      t.strides[i] = strides[i];
    }
    slot.buffer = &b;
    slots.push_back(slot);
  }
  // An argument the valid call leaves absent; faults may still make it up.
  void absent(Slot slot) { slots.push_back(slot); }
};

template <typename Integer>
void store_integers(Buffer& b, const std::vector<int64_t>& values, int64_t stride) {
  for (size_t i = 0; i < values.size(); ++i) {
    const Integer v = Integer(values[i]);
    std::memcpy(b.bytes.get() + i * size_t(stride) * sizeof(Integer), &v, sizeof(Integer));
  }
}

void store_offset(const Call& call, size_t index, int64_t value) {
  unsigned char* at = call.offsets->bytes.get() + index * size_t(call.offset_stride) * (call.i32_offsets ? 4 : 8);
  if (call.i32_offsets) {
    const int32_t narrow = int32_t(value);
    std::memcpy(at, &narrow, 4);
  } else {
    std::memcpy(at, &value, 8);
  }
}

// Batch, tokens and sequences of a valid call.
struct Sizes {
  int64_t H = 1, B = 1, T = 0, N = 1;
  std::vector<int64_t> offsets = {0};  // varlen only
  std::vector<int64_t> lengths;        // of each sequence
  bool varlen = false;
};

Sizes read_sizes(Input& in, bool varlen, size_t max_tokens) {
  Sizes s;
  s.H = 1 + int64_t(in.pick(kMaxHeads));
  s.varlen = varlen;
  if (varlen) {
    const size_t N = 1 + in.pick(kMaxSeqs);
    for (size_t n = 0; n < N; ++n) {
      s.lengths.push_back(int64_t(in.pick(max_tokens + 1)));
      s.offsets.push_back(s.offsets.back() + s.lengths.back());
    }
    s.T = s.offsets.back();
    s.N = int64_t(N);
  } else {
    s.B = int64_t(in.pick(kMaxBatch + 1));
    s.T = int64_t(in.pick(max_tokens + 1));
    s.N = s.B;
    s.lengths.assign(size_t(s.B), s.T);
  }
  return s;
}

int32_t state_dtype_of(uint8_t flags) { return flags & kFlagBf16State ? FKDA_DTYPE_BF16 : FKDA_DTYPE_F32; }

fkda_plan_t cpu_plan(int64_t heads, uint8_t flags, bool layer_step = false) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(heads);
  desc.layer_step = layer_step ? 1 : 0;
  desc.backend = FKDA_BACKEND_CPU;
  desc.state_dtype = state_dtype_of(flags);
  desc.state_layout = flags & kFlagKvLayout ? FKDA_STATE_LAYOUT_KV : FKDA_STATE_LAYOUT_VK;
  fkda_plan_t plan = nullptr;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) finding("a valid CPU plan was refused");
  return plan;
}

const std::vector<int32_t> kBf16 = {FKDA_DTYPE_BF16}, kF32 = {FKDA_DTYPE_F32},
                           kBf16OrF32 = {FKDA_DTYPE_BF16, FKDA_DTYPE_F32},
                           kIntegers = {FKDA_DTYPE_I32, FKDA_DTYPE_I64},
                           kFlags = {FKDA_DTYPE_BOOL, FKDA_DTYPE_I32, FKDA_DTYPE_I64},
                           kStates = {FKDA_DTYPE_BF16, FKDA_DTYPE_F32};

// The arguments fkda_fwd and fkda_decode share, with a gap after each
// head's row when padded. The plan's gate is the bounded one: A_log and
// dt_bias may be absent, g is bf16; beta (logits) may be bf16 or f32.
struct Layout {
  std::vector<int64_t> shape, strides;
};

// [B, T, H, 128], with a gap after each head's row when padded.
Layout activation_layout(const Sizes& s, uint8_t flags) {
  const int64_t pad = flags & kFlagPadded ? 8 : 0, T = s.T, H = s.H;
  return {{s.B, T, H, kD}, {T * H * (kD + pad), H * (kD + pad), kD + pad, 1}};
}

template <typename Args>
void add_shared(Call& call, const Sizes& s, uint8_t flags, Args& a) {
  const int64_t pad = flags & kFlagPadded ? 8 : 0, B = s.B, T = s.T, H = s.H;
  const auto [act, act_strides] = activation_layout(s, flags);
  const std::vector<int64_t> beta = {B, T, H}, beta_strides = {T * (H + pad), H + pad, 1};
  call.add({"q", &a.q, nullptr, true, 4, kBf16}, FKDA_DTYPE_BF16, act, act_strides, false, 0x3e);
  call.add({"k", &a.k, nullptr, true, 4, kBf16}, FKDA_DTYPE_BF16, act, act_strides, false, 0xbe);
  call.add({"v", &a.v, nullptr, true, 4, kBf16}, FKDA_DTYPE_BF16, act, act_strides, false, 0x3f);
  call.add({"g", &a.g, nullptr, true, 4, kBf16}, FKDA_DTYPE_BF16, act, act_strides, false, 0x3d);
  call.add({"beta", &a.beta, nullptr, true, 3, kBf16OrF32}, FKDA_DTYPE_BF16, beta, beta_strides, false, 0x3e);
  call.add({"A_log", &a.A_log, nullptr, false, 1, kF32}, FKDA_DTYPE_F32, {H}, {1}, false);
  call.add({"dt_bias", &a.dt_bias, nullptr, false, 2, kF32}, FKDA_DTYPE_F32, {H, kD}, {kD, 1}, false);
  call.add({"out", &a.out, nullptr, true, 4, kBf16}, FKDA_DTYPE_BF16, act, act_strides, true);
  const Slot cu = {"cu_seqlens", &a.cu_seqlens, nullptr, false, 1, kIntegers};
  if (!s.varlen) {
    call.absent(cu);
    return;
  }
  call.i32_offsets = flags & kFlagI32Offsets;
  call.offset_stride = pad ? 2 : 1;
  call.offset_count = int64_t(s.offsets.size());
  Buffer& offsets = call.add(cu, call.i32_offsets ? FKDA_DTYPE_I32 : FKDA_DTYPE_I64, {call.offset_count},
                             {call.offset_stride}, false);
  call.offsets = &offsets;
  for (size_t i = 0; i < s.offsets.size(); ++i) store_offset(call, i, s.offsets[i]);
}

// Integers [rows] or [rows, cols], packed, i32 or i64.
void add_integers(Call& call, Slot slot, bool i32, const std::vector<int64_t>& shape,
                  const std::vector<int64_t>& values) {
  Buffer& b = call.add(slot, i32 ? FKDA_DTYPE_I32 : FKDA_DTYPE_I64, shape, packed_strides(shape), false);
  if (i32) store_integers<int32_t>(b, values, 1);
  else store_integers<int64_t>(b, values, 1);
  call.indices.push_back({slot.name, &b, i32, shape[0], shape.size() == 2 ? shape[1] : 1});
}

// The layer step's tensors, in the struct's order.
struct LayerTensor {
  fkda_tensor fkda_layer_step::*member;
  const char* name;
  int32_t rank;
};
constexpr LayerTensor kLayerTensors[] = {
    {&fkda_layer_step::conv_weight_q, "layer.conv_weight_q", 2},
    {&fkda_layer_step::conv_weight_k, "layer.conv_weight_k", 2},
    {&fkda_layer_step::conv_weight_v, "layer.conv_weight_v", 2},
    {&fkda_layer_step::conv_bias_q, "layer.conv_bias_q", 1},
    {&fkda_layer_step::conv_bias_k, "layer.conv_bias_k", 1},
    {&fkda_layer_step::conv_bias_v, "layer.conv_bias_v", 1},
    {&fkda_layer_step::conv_state_q, "layer.conv_state_q", 3},
    {&fkda_layer_step::conv_state_k, "layer.conv_state_k", 3},
    {&fkda_layer_step::conv_state_v, "layer.conv_state_v", 3},
    {&fkda_layer_step::out_gate, "layer.out_gate", 4},
    {&fkda_layer_step::out_norm_weight, "layer.out_norm_weight", 1},
};
// Where each kind starts in kLayerTensors.
constexpr int kWeightsAt = 0, kBiasesAt = 3, kStatesAt = 6, kGateAt = 9, kNormWeightAt = 10;

Slot layer_slot(fkda_layer_step& l, int i) {
  const LayerTensor& t = kLayerTensors[i];
  return {t.name, &(l.*t.member), nullptr, false, t.rank, i == kGateAt ? kBf16 : kBf16OrF32};
}

// The layer step the layer and shape bytes ask for; conv states have `rows`
// rows (the pool's slots or the sequences) and start as the canary, as
// they are written.
void add_layer(Call& call, fkda_layer_step& l, const Sizes& s, uint8_t flags, uint8_t layer, uint8_t shape,
               int64_t rows) {
  const int64_t HK = s.H * kD, W = 2 + (shape & kShapeWidths) % 3, Wc = shape & kShapeFullStateWidth ? W : W - 1;
  const bool conv = layer & kLayerConv, channel_last = layer & kLayerChannelLast;
  const int32_t weight_dtype = layer & kLayerF32Weights ? FKDA_DTYPE_F32 : FKDA_DTYPE_BF16;
  for (int i = kWeightsAt; i < kWeightsAt + 3; ++i) {
    if (conv) {
      call.add(layer_slot(l, i), weight_dtype, {HK, W}, channel_last ? std::vector<int64_t>{1, HK}
                                                                     : std::vector<int64_t>{W, 1}, false, 0x3e);
    } else {
      call.absent(layer_slot(l, i));
    }
  }
  for (int i = kBiasesAt; i < kBiasesAt + 3; ++i) {
    if (conv && (layer & kLayerBias)) call.add(layer_slot(l, i), weight_dtype, {HK}, {1}, false, 0x3d);
    else call.absent(layer_slot(l, i));
  }
  const int32_t state_dtype = layer & kLayerF32States ? FKDA_DTYPE_F32 : FKDA_DTYPE_BF16;
  if (conv && (layer & kLayerConvStates)) {
    // [rows, C, Wc] views of [rows, C, Wc] or (channel-last) [rows, Wc, C]
    // memory, C being 3*H*K for one pool tensor, a gap after each row when
    // padded.
    const bool one_pool = layer & kLayerOnePool;
    const int64_t C = one_pool ? 3 * HK : HK, pad = flags & kFlagPadded ? 64 : 0;
    const std::vector<int64_t> strides = channel_last ? std::vector<int64_t>{Wc * C + pad, 1, C}
                                                      : std::vector<int64_t>{Wc * C + pad, Wc, 1};
    const std::vector<int64_t> view = {rows, HK, Wc};
    if (one_pool) {
      Buffer& b = call.add(layer_slot(l, kStatesAt), state_dtype, {rows, C, Wc}, strides, true);
      l.conv_state_q.shape[1] = HK;
      for (int i = 1; i < 3; ++i) {
        call.over(layer_slot(l, kStatesAt + i), b, state_dtype, view, strides);
        (l.*kLayerTensors[kStatesAt + i].member).data =
            reinterpret_cast<void*>(b.begin() + uintptr_t(i * HK * strides[1] * element_bytes(state_dtype)));
      }
    } else {
      for (int i = kStatesAt; i < kStatesAt + 3; ++i) call.add(layer_slot(l, i), state_dtype, view, strides, true);
    }
  } else {
    for (int i = kStatesAt; i < kStatesAt + 3; ++i) call.absent(layer_slot(l, i));
  }
  if (layer & kLayerGate) {
    const auto [act, act_strides] = activation_layout(s, flags);
    call.add(layer_slot(l, kGateAt), FKDA_DTYPE_BF16, act, act_strides, false, 0x3e);
    call.add(layer_slot(l, kNormWeightAt), shape & kShapeF32NormWeight ? FKDA_DTYPE_F32 : FKDA_DTYPE_BF16, {kD},
             {1}, false, 0x3f);
  } else {
    call.absent(layer_slot(l, kGateAt));
    call.absent(layer_slot(l, kNormWeightAt));
  }
  l.out_norm_eps = 1e-5f;
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

void apply_tensor_fault(Input& in, fkda_tensor& t, const std::vector<const Buffer*>& buffers) {
  const size_t field = in.pick(kTensorFields);
  switch (field) {
    case 17: {
      // Into another argument's buffer (or its own): at its start, so that
      // spans can coincide, or at an element-aligned offset.
      const Buffer& b = *buffers[in.pick(buffers.size())];
      const uint64_t size = uint64_t(element_bytes(t.dtype));
      const uint64_t offset = in.byte() % 2 || b.size == 0 ? 0 : in.bytes(2) % b.size / size * size;
      t.data = reinterpret_cast<void*>(b.begin() + offset);
      break;
    }
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

// The scalars of a call that faults may change, and what the oracle knows
// of the call's struct.
struct Scalars {
  size_t* struct_size;
  const void* args;  // the struct the slots point into
  size_t args_size;  // its sizeof
  // The releases' sizes of the struct and where their fields end, from
  // flashkda.h (apart from the library's table); the last is this header's.
  std::vector<std::pair<size_t, size_t>> releases;
  float* scale;
  void** workspace;  // nullptr: the entry point takes no workspace
  size_t* workspace_bytes;
  const Buffer* workspace_buffer;
  fkda_layer_step* layer;
  int64_t channels;       // H*K
  bool decode;
  bool plan_layer_step;   // fkda_fwd's plan was created with layer_step
};

const fkda_tensor* tensor_named(const Call& call, const char* name) {
  for (const Slot& s : call.slots)
    if (std::strcmp(s.name, name) == 0) return s.tensor;
  return nullptr;
}

// How many of the q, k and v tensors of one kind of the layer step are given.
int given(const fkda_layer_step& l, int first) {
  int count = 0;
  for (int i = first; i < first + 3; ++i) count += present(l.*kLayerTensors[i].member);
  return count;
}

// Whether flashkda.h forbids the layer step as the faults left it: parts
// without what they need, dtypes that differ from q's, a convolution the
// plan or the call cannot take, a bad eps or reserved field. Shapes are
// left to the library (a call may then be rejected, never must be).
bool layer_forbidden(const Call& call, const Scalars& s) {
  const fkda_layer_step& l = *s.layer;
  if (l.reserved != 0) return true;
  const int weights = given(l, kWeightsAt), biases = given(l, kBiasesAt), states = given(l, kStatesAt);
  if (weights % 3 != 0 || biases % 3 != 0 || states % 3 != 0) return true;
  if (weights == 0 && (biases > 0 || states > 0)) return true;
  if (weights > 0) {
    if (!s.decode && !s.plan_layer_step) return true;
    const fkda_tensor* indices = tensor_named(call, "state_indices");
    if (s.decode && present(*indices) && indices->rank == 2) return true;  // speculative verify
    const fkda_tensor* checkpoint_slots = tensor_named(call, "checkpoint_slots");
    if (!s.decode && states > 0 && present(*checkpoint_slots) && !present(*indices)) return true;
    for (int i = 1; i < 3; ++i) {
      if ((l.*kLayerTensors[kWeightsAt + i].member).dtype != l.conv_weight_q.dtype) return true;
      if (states > 0 && (l.*kLayerTensors[kStatesAt + i].member).dtype != l.conv_state_q.dtype) return true;
    }
    for (int i = 0; i < biases; ++i) {
      if ((l.*kLayerTensors[kBiasesAt + i].member).dtype != l.conv_weight_q.dtype) return true;
    }
  }
  if (present(l.out_gate) != present(l.out_norm_weight)) return true;
  return present(l.out_gate) && !(std::isfinite(l.out_norm_eps) && l.out_norm_eps > 0.f);
}

// Whether the three conv states are the q, k and v channel blocks of one
// [rows, 3*H*K, Wc] tensor (flashkda.h): the same dtype, shape and strides,
// k's data H*K channels after q's and v's 2*H*K after. They may then
// interleave.
bool conv_state_blocks(const fkda_layer_step& l, int64_t channels) {
  const fkda_tensor& q = l.conv_state_q;
  const uint64_t block = uint64_t(channels) * uint64_t(q.strides[1]) * uint64_t(element_bytes(q.dtype));
  for (int i = 1; i < 3; ++i) {
    const fkda_tensor& t = l.*kLayerTensors[kStatesAt + i].member;
    if (t.dtype != q.dtype || t.rank != q.rank) return false;
    for (int a = 0; a < 3; ++a)
      if (t.shape[a] != q.shape[a] || t.strides[a] != q.strides[a]) return false;
    if (reinterpret_cast<uintptr_t>(t.data) - reinterpret_cast<uintptr_t>(q.data) != uint64_t(i) * block) return false;
  }
  return true;
}

// How far past sizeof a newer caller's struct may reach (flashkda.h).
constexpr size_t kMaxStructGrowth = 4096;

// A content fault: the element of an index tensor it changed.
struct ContentFault {
  std::string name;
  int64_t row, col;
};

constexpr int64_t kContentValues[] = {-1, 0, 1, 2, 7, 16, 17, 32, 999, -999};

// Applies the input's faults to a valid call, makes the call when it is
// safe to, and checks the outcome against the header's rules. `unread`
// says whether flashkda.h lists an index element as one the call never
// reads (given the contents after the faults); `invoke` takes the struct
// as the library sees it.
template <typename Unread, typename Invoke>
void check_call(Input& in, Call& call, const Scalars& scalars, uint8_t lenient, Unread unread, Invoke invoke) {
  for (const Slot& s : call.slots)
    if (present(*s.tensor)) junk_strides(*s.tensor, lenient);
  std::vector<const Buffer*> tensor_buffers;
  for (const Buffer& b : call.buffers)
    if (&b != scalars.workspace_buffer) tensor_buffers.push_back(&b);

  bool faulted = false, other_faults = false;
  std::vector<ContentFault> contents;
  std::vector<std::pair<size_t, unsigned char>> tail;  // bytes past the struct
  for (int count = 0; count < 12 && !in.done(); ++count) {
    faulted = true;
    const size_t target = in.pick(call.slots.size() + 1);
    if (target < call.slots.size()) {
      other_faults = true;
      apply_tensor_fault(in, *call.slots[target].tensor, tensor_buffers);
      continue;
    }
    const size_t scalar = in.pick(kScalarFields);
    other_faults = other_faults || scalar != 5;
    switch (scalar) {
      case 0:
        if (scalars.workspace != nullptr) {
          *scalars.workspace =
              reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(*scalars.workspace) + uint64_t(value(in, 0)));
        }
        break;
      case 1:
        if (scalars.workspace != nullptr) *scalars.workspace_bytes = size_t(value(in, int64_t(*scalars.workspace_bytes)));
        break;
      case 2: {
        const uint32_t bits = uint32_t(value(in, 0));
        std::memcpy(scalars.scale, &bits, 4);
        break;
      }
      case 3:
        *scalars.struct_size = size_t(value(in, int64_t(*scalars.struct_size)));
        break;
      case 7: {
        const uint32_t bits = uint32_t(value(in, 0));
        std::memcpy(&scalars.layer->out_norm_eps, &bits, 4);
        break;
      }
      case 8: scalars.layer->reserved = int32_t(value(in, 0)); break;
      case 4:
        if (call.offsets != nullptr) {
          const size_t i = in.pick(size_t(call.offset_count));
          store_offset(call, i, value(in, 0));
        }
        break;
      case 5: {
        // An element of an index tensor, by the valid call's layout.
        if (call.indices.empty()) break;
        const Indices& ix = call.indices[in.pick(call.indices.size())];
        const int64_t count = ix.rows * ix.cols;
        if (count == 0) break;
        const int64_t e = int64_t(in.bytes(2) % uint64_t(count));
        const int64_t v = in.byte() % 2 ? kContentValues[in.pick(sizeof kContentValues / sizeof kContentValues[0])]
                                        : value(in, 0);
        ix.store(e, v);
        contents.push_back({ix.name, e / ix.cols, e % ix.cols});
        break;
      }
      case 6: {
        // Every size from 0 to this header's plus 64, with a non-zero byte
        // where a newer header's fields would be, or not.
        *scalars.struct_size = size_t(in.bytes(2) % (scalars.args_size + 65));
        if (in.byte() % 2) tail.push_back({scalars.releases.back().second + in.pick(72), uint8_t(in.byte() | 1)});
      }
    }
  }

  // The struct as the library reads it: a newer caller's is longer, zero
  // but for the tail faults.
  const size_t size = *scalars.struct_size;
  const bool newer = size > scalars.args_size && size - scalars.args_size <= kMaxStructGrowth;
  std::vector<uint64_t> image(((newer ? size : scalars.args_size) + 7) / 8, 0);
  auto* image_bytes = reinterpret_cast<unsigned char*>(image.data());
  std::memcpy(image_bytes, scalars.args, scalars.args_size);
  for (const auto& [at, byte] : tail)
    if (at >= scalars.args_size && at < image.size() * 8) image_bytes[at] = byte;
  // The fields the library reads: a release's, or this header's for a
  // newer struct whose bytes past them are all zero.
  bool size_ok = false;
  size_t known_end = 0;
  for (const auto& [release_size, fields_end] : scalars.releases) {
    if (size == release_size) size_ok = true, known_end = fields_end;
  }
  if (newer) {
    known_end = scalars.releases.back().second;
    size_ok = std::all_of(image_bytes + known_end, image_bytes + size, [](unsigned char c) { return c == 0; });
  }

  bool forbidden = !size_ok || !std::isfinite(*scalars.scale);
  const size_t layer_offset =
      size_t(reinterpret_cast<const char*>(scalars.layer) - static_cast<const char*>(scalars.args));
  const bool layer_read = size_ok && layer_offset < known_end;
  forbidden = forbidden || (layer_read && layer_forbidden(call, scalars));
  bool outside = false;
  if (scalars.workspace != nullptr) {
    const uintptr_t w = reinterpret_cast<uintptr_t>(*scalars.workspace);
    forbidden = forbidden || w == 0 || w % 16 != 0;
    outside = w < scalars.workspace_buffer->begin() ||
              __int128(w) + *scalars.workspace_bytes >
                  __int128(scalars.workspace_buffer->begin()) + scalars.workspace_buffer->size;
  }
  struct Seen {
    const Slot* slot;
    Span span;
  };
  std::vector<Seen> seen;
  for (const Slot& s : call.slots) {
    // A field past an earlier release's struct is not read: absent.
    const size_t offset = size_t(reinterpret_cast<const char*>(s.tensor) - static_cast<const char*>(scalars.args));
    Span span;
    const Reach r = reach(s, tensor_buffers, &span);
    outside = outside || r == Reach::kOutside;
    if (size_ok && offset >= known_end) continue;
    forbidden = forbidden || r == Reach::kForbidden;
    if (r == Reach::kInside && span.first != span.last) seen.push_back({&s, span});
  }
  // Any two arguments one of which the call writes share no byte, unless
  // they are initial_state and final_state over the very same bytes.
  for (size_t j = 0; j < seen.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      const Seen &a = seen[i], &b = seen[j];
      if (!written_argument(a.slot->name) && !written_argument(b.slot->name)) continue;
      if (!(a.span.first < b.span.last && b.span.first < a.span.last)) continue;
      const std::set<std::string> pair = {a.slot->name, b.slot->name};
      const bool in_place = pair == std::set<std::string>{"initial_state", "final_state"} &&
                            a.span.first == b.span.first && a.span.last == b.span.last;
      const bool blocks = conv_state(a.slot->name) && conv_state(b.slot->name) &&
                          conv_state_blocks(*scalars.layer, scalars.channels);
      forbidden = forbidden || !(in_place || blocks);
    }
  }
  // The library may read a possible descriptor's contents (cu_seqlens,
  // indices) before it reaches a forbidden one, so a call with anything
  // past its buffer is never made.
  if (outside) return;
  const bool only_unread = faulted && !other_faults && std::all_of(contents.begin(), contents.end(), [&](const ContentFault& c) {
    return unread(c.name, c.row, c.col);
  });

  const fkda_status status = invoke(static_cast<const void*>(image.data()));
  const std::string message = fkda_last_error();
  if (status == FKDA_SUCCESS) {
    if (forbidden) finding("a call the header forbids was accepted");
    if (!message.empty()) finding("a successful call left a message: " + message);
    return;
  }
  // Valid calls without faults may still be forbidden: a convolution on a
  // plan without layer_step, or with a slot table.
  if (!faulted && !forbidden) finding("a valid call was rejected: " + message);
  if (only_unread && !forbidden) finding("an index flashkda.h says is never read was checked: " + message);
  std::vector<std::string> names = {"args", "plan", "scale", "workspace", "workspace_bytes", "layer.out_norm_eps",
                                    "layer.reserved"};
  for (const Slot& s : call.slots) names.push_back(s.name);
  if (!names_an_argument(message, names)) finding("a rejection names no argument: '" + message + "'");
  for (const Buffer* written : call.written) {
    if (!untouched(*written, kCanary)) finding("a rejected call wrote to an output (" + message + ")");
  }
}

// Where a struct's fields end, and its sizeof as a release ended it there.
#define FIELD_END(S, f) (offsetof(S, f) + sizeof(static_cast<S*>(nullptr)->f))
template <typename S>
std::pair<size_t, size_t> release_ending(size_t fields_end) {
  return {(fields_end + alignof(S) - 1) / alignof(S) * alignof(S), fields_end};
}

// The layer byte, and the shape byte after a non-zero one.
std::pair<uint8_t, uint8_t> read_layer(Input& in) {
  const uint8_t layer = in.byte();
  return {layer, layer != 0 ? in.byte() : 0};
}

void fuzz_fwd(Input& in) {
  const uint8_t flags = in.byte(), serving = in.byte(), lenient = in.byte();
  const auto [layer, layer_shape] = read_layer(in);
  const Sizes s = read_sizes(in, flags & kFlagVarlen, kMaxTokens);
  fkda_fwd_args a = FKDA_FWD_ARGS_INIT;
  Call call;
  add_shared(call, s, flags, a);
  const int64_t H = s.H, N = s.N;
  const int32_t state_dtype = state_dtype_of(flags);
  const bool i32 = flags & kFlagI32Offsets;
  const std::vector<int64_t> states = {N, H, kD, kD};
  const Slot initial = {"initial_state", &a.initial_state, nullptr, false, 4, {state_dtype}};
  const Slot final = {"final_state", &a.final_state, nullptr, false, 4, {state_dtype}};
  const Slot pool = {"state_pool", &a.state_pool, nullptr, false, 4, {state_dtype}};
  const Slot indices = {"state_indices", &a.state_indices, nullptr, false, 1, kIntegers};
  const bool pooled = serving & kServingPool;
  const bool slot_checkpoints = pooled && (serving & kServingCheckpointSlots);
  const bool checkpoints = serving & kServingCheckpoints;
  // Sequence 0 padding, and the entries flashkda.h says are never read
  // holding values that would fail if they were.
  const bool padding = pooled && (serving & kServingPadding) && N > 0;
  if (pooled) {
    // Slots [0, N) for the states, [N, 2N) for checkpoints.
    const int64_t pad = flags & kFlagPadded ? 64 : 0;
    const std::vector<int64_t> shape = {slot_checkpoints ? 2 * N : N, H, kD, kD};
    call.add(pool, state_dtype, shape, {H * kD * kD + pad, kD * kD, kD, 1}, true);
    std::vector<int64_t> slots(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) slots[size_t(n)] = n;
    if (padding) slots[0] = -1;
    add_integers(call, indices, i32, {N}, slots);
    call.absent(initial);
    call.absent(final);
  } else {
    call.absent(pool);
    call.absent(indices);
    const bool in_place = flags & kFlagInPlace;
    const bool both = (flags & kFlagInitialState) && (flags & kFlagFinalState);
    if (both && !in_place && (serving & kServingSharedStates)) {
      // initial_state then final_state in one buffer: a pointer fault can
      // make them overlap partly (forbidden) or coincide (in place).
      const int64_t state_elements = N * H * kD * kD;
      Buffer& b = call.add(initial, state_dtype, {2 * N, H, kD, kD}, packed_strides({2 * N, H, kD, kD}), true);
      a.initial_state.shape[0] = N;
      call.over(final, b, state_dtype, states, packed_strides(states));
      a.final_state.data = b.bytes.get() + size_t(state_elements * element_bytes(state_dtype));
    } else if (flags & kFlagInitialState) {
      call.add(initial, state_dtype, states, packed_strides(states), in_place);
      if (flags & kFlagFinalState && in_place) call.over(final, *call.written.back(), state_dtype, states, packed_strides(states));
    } else {
      call.absent(initial);
    }
    if (both && !in_place && (serving & kServingSharedStates)) {
      // both added above
    } else if (flags & kFlagFinalState && !(in_place && flags & kFlagInitialState)) {
      call.add(final, state_dtype, states, packed_strides(states), true);
    } else if (!(flags & kFlagFinalState)) {
      call.absent(final);
    }
  }
  const Slot has_initial = {"has_initial_state", &a.has_initial_state, nullptr, false, 1, kFlags};
  if ((serving & kServingHasInitial) && (pooled || present(a.initial_state))) {
    Buffer& b = call.add(has_initial, FKDA_DTYPE_BOOL, {N}, {1}, false);
    for (int64_t n = 0; n < N; ++n) b.bytes[size_t(n)] = uint8_t(n % 2);
  } else {
    call.absent(has_initial);
  }
  // Two checkpoint columns: after 16 tokens where there are as many, and none.
  const Slot offsets = {"checkpoint_offsets", &a.checkpoint_offsets, nullptr, false, 2, kIntegers};
  const Slot to_tensor = {"checkpoints", &a.checkpoints, nullptr, false, 5, kStates};
  const Slot to_slots = {"checkpoint_slots", &a.checkpoint_slots, nullptr, false, 2, kIntegers};
  if (checkpoints) {
    std::vector<int64_t> at, slots;
    for (int64_t n = 0; n < N; ++n) {
      at.insert(at.end(), {s.lengths[size_t(n)] >= 16 ? 16 : -1, -1});
      // The slot behind offset -1 is not read.
      slots.insert(slots.end(), {N + n, padding ? 999 : -1});
    }
    if (padding) {
      at[0] = 7;
      slots[0] = 999;
    }
    add_integers(call, offsets, i32, {N, 2}, at);
    if (slot_checkpoints) {
      call.absent(to_tensor);
      add_integers(call, to_slots, i32, {N, 2}, slots);
    } else {
      const std::vector<int64_t> shape = {N, 2, H, kD, kD};
      call.add(to_tensor, state_dtype, shape, packed_strides(shape), true);
      call.absent(to_slots);
    }
  } else {
    call.absent(offsets);
    call.absent(to_tensor);
    call.absent(to_slots);
  }
  a.scale = 0.088f;
  // Conv state rows are the pool's slots with state_indices, else sequences.
  add_layer(call, a.layer, s, flags, layer, layer_shape, pooled ? a.state_pool.shape[0] : N);

  const bool plan_layer_step = (layer & kLayerConv) && !(layer_shape & kShapeNoPlanFlag);
  const fkda_plan_t plan = cpu_plan(H, flags, plan_layer_step);
  size_t workspace_bytes = 0;
  if (fkda_plan_workspace_size(plan, s.B * s.T, N, &workspace_bytes) != FKDA_SUCCESS) {
    finding("workspace size of a valid call refused: " + std::string(fkda_last_error()));
  }
  Buffer& workspace = call.buffers.emplace_back(workspace_bytes, kCanary);
  call.written.push_back(&workspace);
  void* workspace_data = workspace.bytes.get();
  const Scalars scalars = {&a.struct_size,
                           &a,
                           sizeof a,
                           {release_ending<fkda_fwd_args>(FIELD_END(fkda_fwd_args, scale)),
                            release_ending<fkda_fwd_args>(FIELD_END(fkda_fwd_args, checkpoint_slots)),
                            release_ending<fkda_fwd_args>(FIELD_END(fkda_fwd_args, layer))},
                           &a.scale,
                           &workspace_data,
                           &workspace_bytes,
                           &workspace,
                           &a.layer,
                           H * kD,
                           false,
                           plan_layer_step};
  // What the call never reads (flashkda.h): a padding sequence's
  // checkpoints, and the slot of a negative checkpoint offset.
  auto element = [&](const char* name, int64_t row, int64_t col, int64_t* v) {
    for (const Indices& ix : call.indices) {
      if (std::strcmp(ix.name, name) == 0 && row < ix.rows && col < ix.cols) {
        *v = ix.at(row * ix.cols + col);
        return true;
      }
    }
    return false;
  };
  auto unread = [&](const std::string& name, int64_t row, int64_t col) {
    int64_t slot = 0, offset = 0;
    const bool padded = element("state_indices", row, 0, &slot) && slot < 0;
    if (name == "checkpoint_offsets") return padded;
    if (name == "checkpoint_slots") return padded || (element("checkpoint_offsets", row, col, &offset) && offset < 0);
    return false;
  };
  check_call(in, call, scalars, lenient, unread, [&](const void* args) {
    return fkda_fwd(plan, static_cast<const fkda_fwd_args*>(args), workspace_data, workspace_bytes, nullptr);
  });
  fkda_plan_destroy(plan);
}

void fuzz_decode(Input& in) {
  const uint8_t flags = in.byte(), lenient = in.byte();
  const auto [layer, layer_shape] = read_layer(in);
  const Sizes s = read_sizes(in, flags & kFlagVarlen, kMaxDecodeTokens);
  fkda_decode_args a = FKDA_DECODE_ARGS_INIT;
  Call call;
  add_shared(call, s, flags, a);
  // One slot per sequence, or per sequence and token of a slot table.
  const int64_t H = s.H, N = s.N;
  const bool table = flags & kDecodeTable, i32 = flags & kFlagI32Offsets;
  const int32_t state_dtype = state_dtype_of(flags);
  // Batched, every row has T tokens, with or without rows.
  int64_t W = s.varlen ? 1 : std::max<int64_t>(1, s.T);
  for (int64_t length : s.lengths) W = std::max(W, length);
  if (!table) W = 1;
  const Slot pool = {"state_pool", &a.state_pool, nullptr, true, 4, {state_dtype}};
  const std::vector<int64_t> pool_shape = {N * W, H, kD, kD};
  call.add(pool, state_dtype, pool_shape, packed_strides(pool_shape), true);
  std::vector<int64_t> slots(size_t(N * W));
  for (int64_t i = 0; i < N * W; ++i) slots[size_t(i)] = i;
  std::vector<int64_t> accepted_counts(size_t(N), 1);
  if (flags & kDecodePadding) {
    // What the call never reads holds what would fail if it were: the
    // indices and count of a zero-length sequence, table columns past a
    // sequence's length, a padding sequence's other columns (the last
    // sequence is padding).
    for (int64_t n = 0; n < N; ++n) {
      const int64_t length = s.lengths[size_t(n)];
      for (int64_t t = std::max<int64_t>(length, 1); t < W; ++t) slots[size_t(n * W + t)] = 999;
      if (length == 0) {
        slots[size_t(n * W)] = 999;
        accepted_counts[size_t(n)] = 99;
      }
    }
    if (N > 0 && s.lengths[size_t(N - 1)] > 0) {
      for (int64_t t = 1; t < W; ++t) slots[size_t((N - 1) * W + t)] = 999;
      slots[size_t((N - 1) * W)] = -1;
    }
  }
  // [N] and [N, W] are both valid whatever the valid call used.
  const Slot indices = {"state_indices", &a.state_indices, nullptr, true, table ? 2 : 1, kIntegers, table ? 1 : 2};
  if (table) add_integers(call, indices, i32, {N, W}, slots);
  else add_integers(call, indices, i32, {N}, slots);
  const Slot accepted = {"num_accepted_tokens", &a.num_accepted_tokens, nullptr, false, 1, kIntegers};
  const bool with_accepted = table && (flags & kDecodeAccepted);
  if (with_accepted) add_integers(call, accepted, i32, {N}, accepted_counts);
  else call.absent(accepted);
  a.scale = 0.088f;
  // With a slot table the convolution is refused: the valid call is not.
  add_layer(call, a.layer, s, flags, layer, layer_shape, N * W);

  const fkda_plan_t plan = cpu_plan(H, flags);
  // fkda_decode needs no workspace and takes any.
  const Scalars scalars = {&a.struct_size, &a, sizeof a,
                           {release_ending<fkda_decode_args>(FIELD_END(fkda_decode_args, scale)),
                            release_ending<fkda_decode_args>(FIELD_END(fkda_decode_args, layer))},
                           &a.scale, nullptr, nullptr, nullptr, &a.layer, H * kD, true, false};
  // What the call never reads (flashkda.h): a zero-length sequence's row and
  // count, columns at and past a sequence's length but its start, and a
  // padding sequence's columns but its start.
  auto unread = [&](const std::string& name, int64_t row, int64_t col) {
    const int64_t length = s.lengths[size_t(row)];
    if (length == 0) return true;
    if (name != "state_indices" || !table) return false;
    int64_t start_col = 0;
    if (with_accepted) {
      for (const Indices& ix : call.indices)
        if (std::strcmp(ix.name, "num_accepted_tokens") == 0) start_col = ix.at(row) - 1;
    }
    if (start_col < 0 || start_col >= W || col == start_col) return false;
    const Indices& ix = call.indices.front();
    const bool padded = ix.at(row * W + start_col) < 0;
    return col >= length || padded;
  };
  check_call(in, call, scalars, lenient, unread, [&](const void* args) {
    return fkda_decode(plan, static_cast<const fkda_decode_args*>(args), nullptr, 0, nullptr);
  });
  fkda_plan_destroy(plan);
}

void fuzz_workspace_sizes(Input& in) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(1 + in.pick(kMaxSizingHeads));
  desc.backend = FKDA_BACKEND_CPU;
  fkda_plan_t plan = nullptr;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) finding("a valid CPU plan was refused");
  const int64_t total_tokens = value(in, 0), num_seqs = value(in, 0);
  const bool valid = total_tokens >= 0 && num_seqs >= 0;
  for (bool decode : {false, true}) {
    size_t bytes = 0;
    const fkda_status status = decode ? fkda_plan_decode_workspace_size(plan, total_tokens, num_seqs, &bytes)
                                      : fkda_plan_workspace_size(plan, total_tokens, num_seqs, &bytes);
    const std::string message = fkda_last_error();
    if (valid && status != FKDA_SUCCESS) finding("CPU workspace size refused: " + message);
    if (valid && !decode && bytes == 0) finding("no CPU workspace for fkda_fwd");
    if (!valid && (status != FKDA_ERROR_INVALID_ARGUMENT ||
                   !names_an_argument(message, {"total_tokens", "num_seqs"}))) {
      finding("negative sizes not rejected by name: " + message);
    }
  }
  fkda_plan_destroy(plan);
  // The GPU sizing cannot be reached through a plan on a machine without a
  // GPU; it is called directly. It may refuse (UNSUPPORTED), never overflow.
  const int32_t gpu_heads = int32_t(uint32_t(in.bytes(4)));
  try {
    fkda::gpu::workspace_size(total_tokens, num_seqs, gpu_heads, fkda::Tuning{});
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
  // From -5's bits, which the gates without a floor need.
  uint32_t floor_bits = 0;
  std::memcpy(&floor_bits, &desc.lower_bound, 4);
  floor_bits = uint32_t(value(in, floor_bits));
  std::memcpy(&desc.lower_bound, &floor_bits, 4);
  desc.null_slot_rule = int32_t(value(in, desc.null_slot_rule));
  desc.debug_checks = int32_t(value(in, desc.debug_checks));
  desc.gate_mode = int32_t(value(in, desc.gate_mode));
  desc.beta_mode = int32_t(value(in, desc.beta_mode));
  // A size a newer header could have: the library reads that many bytes,
  // zeros past this header's struct.
  const bool newer = desc.struct_size > sizeof desc && desc.struct_size - sizeof desc <= kMaxStructGrowth;
  std::vector<uint64_t> image(((newer ? desc.struct_size : sizeof desc) + 7) / 8, 0);
  std::memcpy(image.data(), &desc, sizeof desc);
  fkda_plan_t plan = nullptr;
  const fkda_status status = fkda_plan_create(reinterpret_cast<const fkda_plan_desc*>(image.data()), &plan);
  if (status != FKDA_SUCCESS) {
    if (plan != nullptr) finding("a refused plan was returned");
    if (!names_an_argument(fkda_last_error(), {"desc", "desc.num_heads", "desc.head_dim_k", "desc.head_dim_v",
                                               "desc.state_dtype", "desc.state_layout", "desc.backend",
                                               "desc.lower_bound", "desc.null_slot_rule", "desc.debug_checks",
                                               "desc.gate_mode", "desc.beta_mode", "desc.vsplit",
                                               "desc.chunk_parallel", "desc.window_slots",
                                               "desc.segment_chunks"})) {
      finding(std::string("a refused plan names no field: ") + fkda_last_error());
    }
    return;
  }
  // Only a bounded plan has a floor to get and set. Sizes short of the full
  // struct may not reach gate_mode (it then takes its _INIT value, BOUNDED).
  float current = 0;
  const bool bounded = fkda_get_lower_bound(plan, &current) == FKDA_SUCCESS;
  if (!bounded && !names_an_argument(fkda_last_error(), {"plan"})) {
    finding(std::string("fkda_get_lower_bound refused a plan without naming it: ") + fkda_last_error());
  }
  if (desc.struct_size == sizeof(fkda_plan_desc) && bounded != (desc.gate_mode == FKDA_GATE_BOUNDED)) {
    finding("fkda_get_lower_bound disagrees with gate_mode " + std::to_string(desc.gate_mode));
  }
  const uint32_t bits = uint32_t(in.bytes(4));
  float lower_bound = 0;
  std::memcpy(&lower_bound, &bits, 4);
  const bool in_range = lower_bound >= -5.f && lower_bound <= 0.f;
  if ((fkda_set_lower_bound(plan, lower_bound) == FKDA_SUCCESS) != (in_range && bounded)) {
    finding("fkda_set_lower_bound disagrees with [-5, 0] on a " + std::string(bounded ? "bounded" : "floorless") +
            " plan for " + std::to_string(lower_bound));
  }
  fkda_plan_destroy(plan);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  switch (in.pick(4)) {
    case 0: fuzz_fwd(in); break;
    case 1: fuzz_workspace_sizes(in); break;
    case 2: fuzz_plan_create(in); break;
    default: fuzz_decode(in);
  }
  return 0;
}
