// SPDX-License-Identifier: MIT
// The streamed decode: the decode kernel's recurrence (decode_recurrence.cuh)
// for batches large enough that the pool's bytes bound it, on sm_90 and
// later, where the state travels by bulk copies (the Tensor Memory
// Accelerator) instead of by the threads' own loads and stores.
//
// Why: a block of the plain decode kernel loads its rows, prepares its
// tokens, steps and stores, and only then leaves room for the next block.
// Its loads are in flight only during the first of those phases, so DRAM
// idles while the resident blocks compute and store. Here a persistent
// block keeps `stages` items in flight: its producer warp issues the bulk
// copies of the items ahead (their rows of the state, their first tokens'
// q, k, g, v and the head's dt_bias) while the consumer warps step item j
// from shared memory, and the producer writes each item's rows back
// to the pool with one bulk store once the consumers are done with them.
//
// The plain form's items are FKDA_DECODE_STREAM_ROWS (64) rows of one
// (sequence, head) state, item i = (n H + h) 2 + half; the layer form's are
// whole heads, item i = n H + h. Block b takes items b, b + grid, ... Within
// an item the consumer threads own their rows as the plain kernel's 4-warp
// block does (decode_recurrence.cuh), and the arithmetic is the same
// (step_token_rows), so the results are bit-identical to the plain kernel's.
//
// The layer form adds the layer step (flashkda.h, "The layer step"): the
// producer also copies the head's conv states in, and writes them back; as
// the consumers prepare a token, thread c convolves channel c of q (threads
// 0-127) or of k and v (threads 128-255), its last inputs in shared memory;
// each warp normalises q and k as it steps; a gate warp takes each token's
// 128 outputs from shared memory and applies the output gate while the
// consumers go on (consume, "the output gate's warp").
//
// Served: [N] indices (no table), V x K pools (an item's rows are then one
// contiguous run of the pool); the layer form, conv states whose channels
// are contiguous. The host chooses these kernels (src/gpu/gpu_decode.cpp).
// Untrusted device values are handled as in the plain kernel: offsets
// clamped, a null, out-of-range or overlong sequence is padding (outputs
// zero, no state touched).
#pragma once

#include <type_traits>

#include "decode_params.h"
#include "decode_recurrence.cuh"
#include "device_common.cuh"
#include "layer_conv.cuh"

namespace fkda_dev {

// Where an item's work lies, as the producer found it; in the stage's
// first FKDA_DECODE_STREAM_HEADER_BYTES.
struct StreamHeader {
  int64_t begin;          // first token along the row
  int64_t batch_row;      // the tokens' batch row
  unsigned char* matrix;  // the item's first row in the pool; null: padding
  int32_t length;         // tokens; 0 leaves everything untouched
  float rate;             // exp(A_log[h])
  float beta[FKDA_DECODE_STREAM_TOKENS];  // the first tokens' beta, as stored
};
// The layer form's header: also where the head's conv states go back.
struct LayerStreamHeader : StreamHeader {
  int64_t slot;
  int32_t head;
};
template <bool kLayer>
using StreamHeaderOf = typename std::conditional<kLayer, LayerStreamHeader, StreamHeader>::type;
static_assert(sizeof(LayerStreamHeader) <= FKDA_DECODE_STREAM_HEADER_BYTES, "the header fits its place");

// ---- the barriers and bulk copies of sm_90 ----
__device__ __forceinline__ void barrier_init(uint32_t barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}
// Arrives and tells the barrier to wait for `bytes` more of bulk copies.
__device__ __forceinline__ void barrier_arrive_expecting(uint32_t barrier, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}
// Until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint32_t barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred complete;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        " selp.u32 %0, 1, 0, complete;\n}"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (!done);
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) from global memory
// to shared memory, completing on `barrier`.
__device__ __forceinline__ void bulk_load(uint32_t to, const void* from, int bytes, uint32_t barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(to),
               "l"(from), "r"(bytes), "r"(barrier)
               : "memory");
}
// Sends `bytes` (a multiple of 16) from global memory towards L2; nothing
// holds shared memory for them or waits for them.
__device__ __forceinline__ void bulk_prefetch_l2(const void* from, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(from), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_store(void* to, uint32_t from, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to), "r"(from), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// The issuing thread's bulk stores have read their shared memory (it may be
// written again); _all: they have completed.
__device__ __forceinline__ void bulk_stores_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_stores_done() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Orders this thread's writes to shared memory before later bulk copies
// that read it (they go through another proxy).
__device__ __forceinline__ void fence_for_bulk_copies() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// The consumer warps' own barrier (the producer warp does not take part).
template <int kThreads>
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
}

// ---- the two forms ----
template <bool kLayer>
struct StreamForm {
  static constexpr int kWarps = kLayer ? FKDA_DECODE_STREAM_LAYER_WARPS : FKDA_DECODE_MAX_WARPS;  // consumers
  static constexpr int kRows = kWarps * FKDA_DECODE_ROWS_PER_WARP;                               // an item's
  static constexpr int kItemsPerHead = FKDA_HEAD_DIM / kRows;
  // The (sequence, head) of item i, and which of the head's items it is.
  __device__ static int64_t head_item(int64_t item) { return kItemsPerHead == 2 ? item >> 1 : item; }
  __device__ static int part(int64_t item) { return kItemsPerHead == 2 ? int(item & 1) : 0; }
};
static_assert(StreamForm<true>::kRows == FKDA_HEAD_DIM, "the layer form's item is a whole head");

// ---- a stage ----
// The sizes of a stage's parts for this call (decode_params.h).
struct StreamLayout {
  int state_bytes, token_bytes, stage_bytes;
  int conv_channel_bytes;  // Wc values of one channel; 0: no conv states
};
template <bool kLayer>
__device__ __forceinline__ StreamLayout stream_layout(const FkdaDecodeParams& p, bool bf16) {
  constexpr int rows = StreamForm<kLayer>::kRows;
  StreamLayout layout;
  const int conv_width = kLayer ? p.layer.conv_state_width : 0;
  layout.state_bytes = fkda_decode_stream_state_bytes(rows, bf16);
  layout.token_bytes = fkda_decode_stream_token_bytes(rows);
  layout.conv_channel_bytes = conv_width * (p.layer.conv_state_is_f32 ? 4 : 2);
  layout.stage_bytes =
      fkda_decode_stream_stage_bytes(rows, bf16, fkda_decode_stream_conv_bytes(conv_width, p.layer.conv_state_is_f32));
  return layout;
}

struct StreamStage {
  unsigned char* base;
  StreamLayout layout;
  __device__ StreamHeader& header() const { return *reinterpret_cast<StreamHeader*>(base); }
  __device__ LayerStreamHeader& layer_header() const { return *reinterpret_cast<LayerStreamHeader*>(base); }
  __device__ unsigned char* state() const { return base + FKDA_DECODE_STREAM_HEADER_BYTES; }
  __device__ float* dt_bias() const { return reinterpret_cast<float*>(state() + layout.state_bytes); }
  __device__ unsigned char* token(int t) const {
    return reinterpret_cast<unsigned char*>(dt_bias() + FKDA_HEAD_DIM) + t * layout.token_bytes;
  }
  __device__ uint16_t* q(int t) const { return reinterpret_cast<uint16_t*>(token(t)); }
  __device__ uint16_t* k(int t) const { return reinterpret_cast<uint16_t*>(token(t) + 2 * FKDA_HEAD_DIM); }
  __device__ void* g(int t) const { return token(t) + 4 * FKDA_HEAD_DIM; }
  // The item's rows of v: last in the token's place.
  __device__ uint16_t* v(int t, int rows) const { return reinterpret_cast<uint16_t*>(token(t + 1) - 2 * rows); }
  // The layer form's conv states of projection proj, [128][Wc].
  __device__ unsigned char* conv(int proj) const {
    return token(FKDA_DECODE_STREAM_TOKENS) + proj * FKDA_HEAD_DIM * layout.conv_channel_bytes;
  }
};

// Element offset of (batch row, head, token) in an activation.
__device__ __forceinline__ int64_t token_element(const FkdaActivation& a, int64_t batch_row, int head, int64_t token) {
  return batch_row * a.stride_b + int64_t(head) * a.stride_h + token * a.stride_t;
}

// The item's (sequence, head, half) and its header, from the device's
// offsets and indices (each lane of the producer one item).
template <bool kLayer>
struct StreamItem {
  int head, half;
  StreamHeaderOf<kLayer> header;
};

template <bool kLayer>
__device__ __forceinline__ StreamItem<kLayer> stream_item(const FkdaDecodeParams& p, int64_t item, bool bf16) {
  using Form = StreamForm<kLayer>;
  StreamItem<kLayer> it;
  const int64_t n = Form::head_item(item) / p.call.num_heads;
  it.head = int(Form::head_item(item) % p.call.num_heads);
  it.half = Form::part(item);
  StreamHeaderOf<kLayer>& h = it.header;
  h.batch_row = n;
  h.begin = 0;
  int64_t end = p.call.seq_len;
  if (p.call.cu_seqlens != nullptr) {
    h.batch_row = 0;
    h.begin = load_offset_of(p.call, n);
    end = load_offset_of(p.call, n + 1);
    if (end < h.begin) end = h.begin;
  }
  h.length = int32_t(end - h.begin < 0x7fffffff ? end - h.begin : 0x7fffffff);
  h.matrix = nullptr;
  if constexpr (kLayer) {
    h.slot = -1;
    h.head = it.head;
  }
  h.rate = 1.f;
#pragma unroll
  for (int t = 0; t < FKDA_DECODE_STREAM_TOKENS; ++t) h.beta[t] = 0.f;
  if (h.length == 0 || h.length > p.max_tokens) return it;
  const int64_t slot = usable_slot(load_index(p.state_indices, n, 0), p.call.first_real_slot, p.pool_slots);
  if (slot < 0) return it;
  const int64_t element_bytes = bf16 ? 2 : 4;
  h.matrix = static_cast<unsigned char*>(p.pool) +
             (slot * p.pool_slot_stride + int64_t(it.head) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM) +
              int64_t(it.half) * Form::kRows * FKDA_HEAD_DIM) *
                 element_bytes;
  if constexpr (kLayer) h.slot = slot;
  h.rate = gate_rate(p.call.A_log, it.head, true);
#pragma unroll
  for (int t = 0; t < FKDA_DECODE_STREAM_TOKENS; ++t) {
    if (t < h.length) {
      h.beta[t] = load_beta(p.call.gate, p.call.beta.data, token_element(p.call.beta, h.batch_row, it.head, h.begin + t));
    }
  }
  return it;
}

// Lane `from`'s item, in every lane.
template <bool kLayer>
__device__ __forceinline__ StreamItem<kLayer> shuffle_item(const StreamItem<kLayer>& mine, int from) {
  constexpr unsigned kAll = 0xffffffffu;
  StreamItem<kLayer> it;
  it.head = __shfl_sync(kAll, mine.head, from);
  it.half = __shfl_sync(kAll, mine.half, from);
  it.header.begin = __shfl_sync(kAll, mine.header.begin, from);
  it.header.batch_row = __shfl_sync(kAll, mine.header.batch_row, from);
  it.header.matrix = reinterpret_cast<unsigned char*>(
      __shfl_sync(kAll, reinterpret_cast<unsigned long long>(mine.header.matrix), from));
  it.header.length = __shfl_sync(kAll, mine.header.length, from);
  it.header.rate = __shfl_sync(kAll, mine.header.rate, from);
#pragma unroll
  for (int t = 0; t < FKDA_DECODE_STREAM_TOKENS; ++t) it.header.beta[t] = __shfl_sync(kAll, mine.header.beta[t], from);
  if constexpr (kLayer) {
    it.header.slot = __shfl_sync(kAll, mine.header.slot, from);
    it.header.head = __shfl_sync(kAll, mine.header.head, from);
  }
  return it;
}

__device__ __forceinline__ const unsigned char* token_address(const FkdaActivation& a, int64_t batch_row,
                                                              int64_t token, int head, int element_bytes) {
  return static_cast<const unsigned char*>(a.data) + token_element(a, batch_row, head, token) * element_bytes;
}

// The conv states of a head's channels of projection `proj` in pool slot
// `slot`: contiguous where the layer form runs (decode_params.h).
__device__ __forceinline__ unsigned char* conv_state_channels(const FkdaDecodeParams& p, int proj, int64_t slot,
                                                              int head) {
  const FkdaConv& conv = p.layer.conv[proj];
  return static_cast<unsigned char*>(conv.state) +
         (slot * conv.state_stride_row + int64_t(head) * FKDA_HEAD_DIM * p.layer.conv_state_width) *
             (p.layer.conv_state_is_f32 ? 4 : 2);
}

// The item in stage s back to the pool: its rows, and in the layer form the
// head's conv states.
template <bool kLayer>
__device__ __forceinline__ void store_stage(const FkdaDecodeParams& p, const StreamStage& s) {
  const StreamHeader& h = s.header();
  if (h.matrix == nullptr) return;
  bulk_store(h.matrix, smem_address(s.state()), s.layout.state_bytes);
  if constexpr (kLayer) {
    const LayerStreamHeader& lh = s.layer_header();
    for (int proj = 0; proj < 3 && s.layout.conv_channel_bytes > 0; ++proj) {
      bulk_store(conv_state_channels(p, proj, lh.slot, lh.head), smem_address(s.conv(proj)),
                 FKDA_HEAD_DIM * s.layout.conv_channel_bytes);
    }
  }
}

// The block's j-th item's stage (j mod stages) and the parity of its round
// over the stages, counted rather than divided out of j (producer and
// consumers alike): on the consumers' chain the divisions were three an
// item with the head's index.
__device__ __forceinline__ void next_stage(int& stage, uint32_t& round_parity, int stages) {
  if (++stage == stages) {
    stage = 0;
    round_parity ^= 1u;
  }
}

// The producer: item j's copies into stage j % stages, once the consumers
// have released it and the item that held it has been stored.
template <bool kBf16, bool kLayer>
__device__ __forceinline__ void produce(const FkdaDecodeParams& p, int64_t items, unsigned char* stages_base,
                                        uint32_t full, uint32_t empty) {
  constexpr int rows = StreamForm<kLayer>::kRows;
  const int lane = threadIdx.x & 31;
  const StreamLayout layout = stream_layout<kLayer>(p, kBf16);
  const int g_bytes = p.call.gate.g_is_f32 ? 4 * FKDA_HEAD_DIM : 2 * FKDA_HEAD_DIM;
  const int conv_bytes = FKDA_HEAD_DIM * layout.conv_channel_bytes;  // a projection's
  StreamItem<kLayer> mine = {};  // lane i: item j + i of the current run of 32
  int64_t j = 0;
  int stage = 0;
  uint32_t round_parity = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x, ++j, next_stage(stage, round_parity, p.stages)) {
    // The lanes look 32 items ahead at once, so that the chain of dependent
    // loads (offsets, then the slot, then beta) is paid once per 32 items.
    if (j % 32 == 0) {
      const int64_t ahead = item + int64_t(lane) * gridDim.x;
      if (ahead < items) mine = stream_item<kLayer>(p, ahead, kBf16);
    }
    const StreamItem<kLayer> it = shuffle_item(mine, int(j % 32));
    if (lane == 0) {
      const uint32_t stage_full = full + 8 * stage, stage_empty = empty + 8 * stage;
      const StreamStage s{stages_base + stage * layout.stage_bytes, layout};
      // The plain form's item sets out from DRAM towards L2 before its stage
      // is free, so that its reads overlap the wait for the consumers and
      // the store of the stage's last item. Only this item's: prefetching
      // the next one too measured 19% slower at D4; and not the layer
      // form's, whose W1 it made 1% slower (bench/RESULTS.md).
      if (!kLayer && it.header.matrix != nullptr) bulk_prefetch_l2(it.header.matrix, layout.state_bytes);
      if (j >= p.stages) {
        barrier_wait(stage_empty, round_parity ^ 1u);  // the round before's item released it
        store_stage<kLayer>(p, s);
        bulk_stores_read();
      }
      *reinterpret_cast<StreamHeaderOf<kLayer>*>(s.base) = it.header;
      const StreamHeader& h = it.header;
      if (h.matrix == nullptr) {
        barrier_arrive(stage_full);
      } else {
        const int staged_tokens = h.length < FKDA_DECODE_STREAM_TOKENS ? h.length : FKDA_DECODE_STREAM_TOKENS;
        const bool dt = p.call.dt_bias != nullptr;
        barrier_arrive_expecting(stage_full, layout.state_bytes + (dt ? FKDA_HEAD_DIM * 4 : 0) +
                                                 staged_tokens * (4 * FKDA_HEAD_DIM + g_bytes + rows * 2) +
                                                 3 * conv_bytes);
        bulk_load(smem_address(s.state()), h.matrix, layout.state_bytes, stage_full);
        if (dt) {
          bulk_load(smem_address(s.dt_bias()), p.call.dt_bias + int64_t(it.head) * FKDA_HEAD_DIM, FKDA_HEAD_DIM * 4,
                    stage_full);
        }
        for (int t = 0; t < staged_tokens; ++t) {
          const int64_t token = h.begin + t;
          bulk_load(smem_address(s.q(t)), token_address(p.call.q, h.batch_row, token, it.head, 2), 2 * FKDA_HEAD_DIM,
                    stage_full);
          bulk_load(smem_address(s.k(t)), token_address(p.call.k, h.batch_row, token, it.head, 2), 2 * FKDA_HEAD_DIM,
                    stage_full);
          bulk_load(smem_address(s.g(t)),
                    token_address(p.call.g, h.batch_row, token, it.head, p.call.gate.g_is_f32 ? 4 : 2), g_bytes,
                    stage_full);
          bulk_load(smem_address(s.v(t, rows)),
                    token_address(p.call.v, h.batch_row, token, it.head, 2) + it.half * rows * 2, rows * 2, stage_full);
        }
        if constexpr (kLayer) {
          for (int proj = 0; proj < 3 && conv_bytes > 0; ++proj) {
            bulk_load(smem_address(s.conv(proj)), conv_state_channels(p, proj, it.header.slot, it.head), conv_bytes,
                      stage_full);
          }
        }
      }
    }
    __syncwarp();
  }
  // The last stages' items, once the consumers are done with them.
  // Item j - stages (item 0 if fewer) is in the stage item j would take, a
  // round before.
  if (lane == 0) {
    const bool wrapped = j >= p.stages;
    if (wrapped) {
      round_parity ^= 1u;
    } else {
      stage = 0;
      round_parity = 0;
    }
    for (int64_t last = wrapped ? j - p.stages : 0; last < j; ++last, next_stage(stage, round_parity, p.stages)) {
      barrier_wait(empty + 8 * stage, round_parity);
      store_stage<kLayer>(p, StreamStage{stages_base + stage * layout.stage_bytes, layout});
    }
    bulk_stores_done();
  }
}

// ---- the layer form's convolution ----
__device__ __forceinline__ void prefetch_l1(const void* at) { asm volatile("prefetch.global.L1 [%0];" ::"l"(at)); }
__device__ __forceinline__ void prefetch_channel_weights(const FkdaDecodeParams& p, int proj, int64_t c) {
  const FkdaConv& conv = p.layer.conv[proj];
  const int bytes = p.layer.conv_is_f32 ? 4 : 2;
  prefetch_l1(static_cast<const unsigned char*>(conv.weight) + c * conv.weight_stride_c * bytes);
  if (conv.bias != nullptr) prefetch_l1(static_cast<const unsigned char*>(conv.bias) + c * conv.bias_stride * bytes);
}

// A channel's last inputs, back(b) the one b + 1 tokens back: from its
// conv state before the sequence's first token (zeros without one), then
// each token's raw input as it is convolved. Wc <= 4 of them make the new
// conv state. They live in shared memory (decode_params.h), the thread's
// b-th at at[b x stride]: in registers through the steps, they spilled.
struct ChannelHistory {
  float* at;
  int stride;

  __device__ float& back(int b) const { return at[b * stride]; }
  // Column col of channel c's conv state in stage s ([128][Wc], its dtype).
  __device__ static float state_at(const FkdaDecodeParams& p, const StreamStage& s, int proj, int c, int col) {
    const int at = c * p.layer.conv_state_width + col;
    return p.layer.conv_state_is_f32 ? reinterpret_cast<const float*>(s.conv(proj))[at]
                                     : bf16_bits(reinterpret_cast<const uint16_t*>(s.conv(proj))[at]);
  }
  __device__ void start(const FkdaDecodeParams& p, const StreamStage& s, int proj, int c) const {
    const int width = p.layer.conv_state_width;  // 0 without conv states
#pragma unroll
    for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) back(b) = b < width ? state_at(p, s, proj, c, width - 1 - b) : 0.f;
  }
  // The convolution of input x with the history, which then takes x.
  __device__ float convolve(const FkdaDecodeParams& p, const ConvWeights& w, float x) const {
    const float x_back[FKDA_CONV_MAX_WIDTH] = {x, back(0), back(1), back(2)};
    const float y = convolve_back<false>(p.layer.conv_width, w.bias, w.back, x_back);
    back(3) = x_back[3];
    back(2) = x_back[2];
    back(1) = x_back[1];
    back(0) = x;
    return y;
  }
  // The new conv state, the last Wc inputs oldest first, over the old one in the stage.
  __device__ void keep(const FkdaDecodeParams& p, const StreamStage& s, int proj, int c) const {
    const int width = p.layer.conv_state_width;
#pragma unroll
    for (int col = 0; col < FKDA_CONV_MAX_WIDTH; ++col) {
      if (col >= width) continue;
      // A bf16 input or old state: exact in the state's dtype.
      store_real(s.conv(proj), p.layer.conv_state_is_f32 != 0, c * width + col, back(width - 1 - col));
    }
  }
};

// ---- the output gate's warp (the layer form) ----
// The consumers hand each gated token to the gate warp through one of
// FKDA_DECODE_STREAM_GATE_PLACES places: its 128 outputs and where the gated
// row goes. Token u of the block takes place u % places, written once the
// gate warp is done with token u - places (barrier `gated`) and announced on
// barrier `ready`. A record whose out is null ends the gate warp's work.
// Why: with the gate on the consumers, every token took a second barrier
// (all 128 outputs before any gate) and the gate's arithmetic on their chain.
struct GateRecord {
  uint16_t* out;          // the token's row of `out` (128 values)
  const uint16_t* g_out;  // its row of g_out
};
struct GateHandOver {
  float* outputs;  // [places][128]
  GateRecord* records;
  uint32_t ready, gated;  // barriers, 8 bytes a place
};
__device__ __forceinline__ GateHandOver gate_hand_over(unsigned char* smem, uint32_t barriers) {
  constexpr int warps = FKDA_DECODE_STREAM_LAYER_WARPS;
  float* outputs = reinterpret_cast<float*>(smem + fkda_decode_stream_layer_offset(warps));
  GateRecord* records = reinterpret_cast<GateRecord*>(outputs + FKDA_DECODE_STREAM_GATE_PLACES * FKDA_HEAD_DIM);
  const uint32_t ready = barriers + 8 * 2 * FKDA_DECODE_STREAM_MAX_STAGES;
  return {outputs, records, ready, ready + 8 * FKDA_DECODE_STREAM_GATE_PLACES};
}
__device__ __forceinline__ void init_gate_barriers(const GateHandOver& g) {
  for (int place = 0; place < FKDA_DECODE_STREAM_GATE_PLACES; ++place) {
    barrier_init(g.ready + 8 * place, 32 * FKDA_DECODE_STREAM_LAYER_WARPS);
    barrier_init(g.gated + 8 * place, 32);
  }
}
// A consumer thread: token `handed` (counted over the block's gated tokens)
// to the gate warp, the thread's outputs o at its group's rows (lane l of
// the group writes them) and, from thread 0, the record.
// The place of the block's handed-th token, once the gate warp is done
// with the token before in it.
__device__ __forceinline__ int gate_place(const GateHandOver& g, uint32_t handed) {
  constexpr uint32_t places = FKDA_DECODE_STREAM_GATE_PLACES;
  const int place = int(handed % places);
  if (handed >= places) barrier_wait(g.gated + 8 * place, uint32_t((handed / places - 1) & 1));
  return place;
}
__device__ __forceinline__ void announce_to_gate(const GateHandOver& g, int place, const GateRecord& record) {
  if (threadIdx.x == 0) g.records[place] = record;
  barrier_arrive(g.ready + 8 * place);
}
__device__ __forceinline__ void hand_to_gate(const GateHandOver& g, uint32_t handed, int local_row, int l,
                                             const float (&o)[kDecodeRowsPerGroup], const GateRecord& record) {
  const int place = gate_place(g, handed);
  if (l == 0) {
    *reinterpret_cast<float4*>(g.outputs + place * FKDA_HEAD_DIM + local_row) = make_float4(o[0], o[1], o[2], o[3]);
  }
  announce_to_gate(g, place, record);
}
// After the block's last token: the record that ends the gate warp's work.
__device__ __forceinline__ void end_gate(const GateHandOver& g, uint32_t handed) {
  announce_to_gate(g, gate_place(g, handed), GateRecord{nullptr, nullptr});
}
// The gate warp: RMSNorm(o) w sigmoid(g_out) over each handed token's 128
// outputs, four values a lane (rows of out and g_out are 16-byte aligned,
// validate.cpp), until the record that ends its work.
__device__ __forceinline__ void gate_tokens(const FkdaDecodeParams& p, const GateHandOver& g) {
  constexpr uint32_t places = FKDA_DECODE_STREAM_GATE_PLACES;
  const int lane = threadIdx.x & 31;
  float weight[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) weight[i] = norm_weight(p.layer, 4 * lane + i);
  for (uint32_t u = 0;; ++u) {
    const int place = int(u % places);
    barrier_wait(g.ready + 8 * place, uint32_t((u / places) & 1));
    const GateRecord record = g.records[place];
    if (record.out == nullptr) return;
    const float4 gate_in = load_bf16x4(record.g_out + 4 * lane);
    const float4 x = reinterpret_cast<const float4*>(g.outputs + place * FKDA_HEAD_DIM)[lane];
    __syncwarp();
    barrier_arrive(g.gated + 8 * place);  // the place's values are in registers
    const float inverse = inverse_rms(p.layer, warp_sum(x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w));
    *reinterpret_cast<uint2*>(record.out + 4 * lane) =
        make_uint2(pack_bf16x2(gate_one(inverse, weight[0], gate_in.x, x.x), gate_one(inverse, weight[1], gate_in.y, x.y)),
                   pack_bf16x2(gate_one(inverse, weight[2], gate_in.z, x.z), gate_one(inverse, weight[3], gate_in.w, x.w)));
  }
}

// ---- the consumers ----

// For each token of an item, its preparation (all consumer warps: thread c
// the decay of channel c, so that one token's preparation is short) into
// one of two places, then the step of every row; then the rows back into
// the stage for the producer's store. Preparing token u into place u % 2
// needs one barrier a token: the step that last read that place (token
// u - 2) is behind every consumer once they have all passed token u - 1's
// barrier. The layer form hands each token's outputs to the gate warp.
template <bool kBf16, bool kLayer>
__device__ __forceinline__ void consume(const FkdaDecodeParams& p, int64_t items, unsigned char* smem,
                                        unsigned char* stages_base, uint32_t full, uint32_t empty) {
  using Form = StreamForm<kLayer>;
  constexpr int rows = Form::kRows, threads = 32 * Form::kWarps;
  constexpr int places = FKDA_DECODE_STREAM_PREPARED_TOKENS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, l = lane & 7;
  const int local_row = warp * FKDA_DECODE_ROWS_PER_WARP + (lane >> 3) * kDecodeRowsPerGroup;
  float* key = reinterpret_cast<float*>(smem + fkda_decode_key_offset());
  float* query = reinterpret_cast<float*>(smem + fkda_decode_query_offset(places));
  float* decay = reinterpret_cast<float*>(smem + fkda_decode_decay_offset(places));
  float* value = reinterpret_cast<float*>(smem + fkda_decode_value_offset(places));
  float* beta = reinterpret_cast<float*>(smem + fkda_decode_beta_offset(places, Form::kWarps));
  const StreamLayout layout = stream_layout<kLayer>(p, kBf16);
  const bool convolved = kLayer && p.layer.conv_width > 0;
  const bool gated = kLayer && p.layer.out_gate.data != nullptr;
  // The layer form: thread c < 128 takes channel c of q (and its decay);
  // thread 128 + c channel c of k and of v.
  const int channel = kLayer ? tid & (FKDA_HEAD_DIM - 1) : 32 * warp + lane, qk = tid >> 7;
  // Where the layer form hands its outputs to the gate warp, then the histories.
  const GateHandOver gate = gate_hand_over(smem, full);
  float* histories = kLayer ? reinterpret_cast<float*>(gate.records + FKDA_DECODE_STREAM_GATE_PLACES) : nullptr;
  const ChannelHistory history_qk{histories + tid, threads}, history_v{histories + FKDA_CONV_MAX_WIDTH * threads + tid, threads};
  uint32_t prepared = 0;  // tokens this block has prepared
  uint32_t handed = 0;    // of them, to the gate warp
  int stage = 0;  // of the block's j-th item (next_stage)
  uint32_t round_parity = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x, next_stage(stage, round_parity, p.stages)) {
    const StreamStage s{stages_base + stage * layout.stage_bytes, layout};
    const int head = int(Form::head_item(item) % p.call.num_heads), block_row = Form::part(item) * rows;
    // The layer form's weights, brought to L1 before the wait so that their
    // latency passes with it (held in registers from here, they spilled: a
    // block's ten warps leave a thread at most 168).
    if (convolved) {
      const int64_t c = int64_t(head) * FKDA_HEAD_DIM + channel;
      prefetch_channel_weights(p, qk, c);
      if (qk == 1) prefetch_channel_weights(p, 2, c);
    }
    barrier_wait(full + 8 * stage, round_parity);
    const StreamHeader h = s.header();
    const int64_t head_channel = int64_t(head) * FKDA_HEAD_DIM + channel;
    const int64_t begin = h.begin, batch_row = h.batch_row;
    uint16_t* out = static_cast<uint16_t*>(p.call.out.data) + batch_row * p.call.out.stride_b +
                    int64_t(head) * p.call.out.stride_h + begin * p.call.out.stride_t + block_row;
    const int tokens = h.length;
    if (h.matrix == nullptr) {
      // A token's values, the item's rows, from the first threads (a loop
      // over tokens x rows spilled in the layer form: its unrolled address
      // arithmetic).
      for (int t = 0; t < tokens && tid < rows; ++t) out[t * p.call.out.stride_t + tid] = 0;
      barrier_arrive(empty + 8 * stage);
      continue;
    }
    if (convolved) {
      history_qk.start(p, s, qk, channel);
      if (qk == 1) history_v.start(p, s, 2, channel);
    }
    // Input t of the sequence (bf16 bits) of q, k or v (proj 0 to 2), channel
    // c of the item's: the stage holds the first tokens.
    auto raw_input = [&](int proj, int t, int c) -> float {
      if (t < FKDA_DECODE_STREAM_TOKENS) return bf16_bits((proj == 0 ? s.q(t) : proj == 1 ? s.k(t) : s.v(t, rows))[c]);
      const FkdaActivation& a = proj == 0 ? p.call.q : proj == 1 ? p.call.k : p.call.v;
      return bf16_bits(reinterpret_cast<const uint16_t*>(token_address(a, batch_row, begin + t, head, 2))[c]);
    };
    float st[kDecodeRowsPerGroup][kDecodeColumnsPerLane];
    // The rows lie in the stage as in the pool: the plain kernel's
    // accesses, each group's 8 lanes on 128 contiguous bytes of a row.
    load_state_rows<kBf16, false, true>(s.state(), local_row, l, st);
    const float dt = p.call.dt_bias != nullptr ? s.dt_bias()[channel] : 0.f;
#pragma unroll 1
    for (int t = 0; t < tokens; ++t, ++prepared) {
      const int place = int(prepared % places);
      const bool staged = t < FKDA_DECODE_STREAM_TOKENS;
      const int64_t token = begin + t;
      // The decay of channel `channel` (thread < 128), from its g.
      auto g_of = [&]() {
        const void* g_row = staged ? s.g(t) : token_address(p.call.g, batch_row, token, head, p.call.gate.g_is_f32 ? 4 : 2);
        return p.call.gate.g_is_f32 ? static_cast<const float*>(g_row)[channel]
                                    : bf16_bits(static_cast<const uint16_t*>(g_row)[channel]);
      };
      if constexpr (kLayer) {
        // As they are: each warp normalises q and k after the barrier.
        auto convolve = [&](const ChannelHistory& history, int proj, float x) {
          const ConvWeightBits bits = load_conv_weight_bits(p.layer, p.layer.conv[proj], head_channel);
          return history.convolve(p, conv_weights(p.layer, bits), x);
        };
        const float x = raw_input(qk, t, channel);
        (qk == 0 ? query : key)[place * FKDA_HEAD_DIM + channel] = convolved ? convolve(history_qk, qk, x) : x;
        if (qk == 1) {
          const float xv = raw_input(2, t, channel);
          value[place * rows + channel] = convolved ? convolve(history_v, 2, xv) : xv;
        } else {
          decay[place * FKDA_HEAD_DIM + channel] = decay_accurate(p.call.gate, p.call.gate_scale, g_of(), h.rate, dt);
        }
      } else {
        const uint16_t* q_row = staged ? s.q(t) : reinterpret_cast<const uint16_t*>(token_address(p.call.q, batch_row, token, head, 2));
        const uint16_t* k_row = staged ? s.k(t) : reinterpret_cast<const uint16_t*>(token_address(p.call.k, batch_row, token, head, 2));
        const uint2 qw = *reinterpret_cast<const uint2*>(q_row + 4 * lane);
        const uint2 kw = *reinterpret_cast<const uint2*>(k_row + 4 * lane);
        const float4 q = make_float4(bf16_lo(qw.x), bf16_hi(qw.x), bf16_lo(qw.y), bf16_hi(qw.y));
        const float4 k = make_float4(bf16_lo(kw.x), bf16_hi(kw.x), bf16_lo(kw.y), bf16_hi(kw.y));
        const float g = g_of();
        const float rq = 1.0f / sqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f);
        const float rk = 1.0f / sqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
        const float qs = rq * p.call.scale;
        // Lanes 8 w .. 8 w + 7 hold channels 32 w .., this warp's share.
        if ((lane >> 3) == warp) {
          reinterpret_cast<float4*>(key + place * FKDA_HEAD_DIM)[lane] = make_float4(k.x * rk, k.y * rk, k.z * rk, k.w * rk);
          reinterpret_cast<float4*>(query + place * FKDA_HEAD_DIM)[lane] =
              make_float4(q.x * qs, q.y * qs, q.z * qs, q.w * qs);
        }
        decay[place * FKDA_HEAD_DIM + channel] = decay_accurate(p.call.gate, p.call.gate_scale, g, h.rate, dt);
        if (tid < rows) {
          const uint16_t* v_row =
              staged ? s.v(t, rows)
                     : reinterpret_cast<const uint16_t*>(token_address(p.call.v, batch_row, token, head, 2)) + block_row;
          value[place * rows + tid] = bf16_bits(v_row[tid]);
        }
      }
      if (tid == 0) {
        const float raw = staged ? s.header().beta[t]
                                 : load_beta(p.call.gate, p.call.beta.data, token_element(p.call.beta, batch_row, head, token));
        beta[place] = step_size(p.call.gate, raw, true);
      }
      consumers_sync<threads>();
      float o[kDecodeRowsPerGroup];
      if constexpr (kLayer) {
        const float4 q = reinterpret_cast<const float4*>(query + place * FKDA_HEAD_DIM)[lane];
        const float4 k = reinterpret_cast<const float4*>(key + place * FKDA_HEAD_DIM)[lane];
        const float rq = 1.0f / sqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f);
        const float rk = 1.0f / sqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
        step_token_rows<kBf16, kDecodeRowsPerGroup, true>(st, key + place * FKDA_HEAD_DIM, decay + place * FKDA_HEAD_DIM,
                                                          query + place * FKDA_HEAD_DIM, beta[place],
                                                          value + place * rows + local_row, l, o, rk, rq * p.call.scale);
      } else {
        step_token_rows<kBf16, kDecodeRowsPerGroup>(st, key + place * FKDA_HEAD_DIM, decay + place * FKDA_HEAD_DIM,
                                                    query + place * FKDA_HEAD_DIM, beta[place],
                                                    value + place * rows + local_row, l, o);
      }
      if (gated) {
        const FkdaActivation& g_out = p.layer.out_gate;
        hand_to_gate(gate, handed++, local_row, l, o,
                     GateRecord{out + t * p.call.out.stride_t,
                                static_cast<const uint16_t*>(g_out.data) + token_element(g_out, batch_row, head, token)});
      } else if (l == 0) {
        // The group's four outputs in one 8-byte store (as the plain kernel).
        *reinterpret_cast<uint2*>(out + t * p.call.out.stride_t + local_row) =
            make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
      }
    }
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerGroup; ++r) store_state_row<kBf16, false, true>(s.state(), local_row + r, l, st[r]);
    if (kLayer && layout.conv_channel_bytes > 0) {
      // Each thread rewrites only the states it alone read.
      history_qk.keep(p, s, qk, channel);
      if (qk == 1) history_v.keep(p, s, 2, channel);
    }
    fence_for_bulk_copies();
    barrier_arrive(empty + 8 * stage);
  }
  if (gated) end_gate(gate, handed);
}

template <bool kBf16, bool kLayer>
__device__ __forceinline__ void decode_streamed(const FkdaDecodeParams& p) {
  using Form = StreamForm<kLayer>;
  extern __shared__ __align__(16) unsigned char decode_smem[];
  const int64_t items = p.call.num_seqs * p.call.num_heads * Form::kItemsPerHead;
  const uint32_t barriers = smem_address(decode_smem + fkda_decode_stream_barriers_offset(Form::kWarps));
  const uint32_t full = barriers, empty = barriers + 8 * FKDA_DECODE_STREAM_MAX_STAGES;
  unsigned char* stages_base = decode_smem + fkda_decode_stream_stages_offset(Form::kWarps);
  const GateHandOver gate = gate_hand_over(decode_smem, barriers);
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < p.stages; ++stage) {
      barrier_init(full + 8 * stage, 1);
      barrier_init(empty + 8 * stage, 32 * Form::kWarps);
    }
    if (kLayer) init_gate_barriers(gate);
    // The bulk copies complete on these barriers through the async proxy,
    // which sees their initialisation only after this fence.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (kLayer && threadIdx.x >= 32 * (Form::kWarps + 1)) {
    if (p.layer.out_gate.data != nullptr) gate_tokens(p, gate);
  } else if (threadIdx.x >= 32 * Form::kWarps) {
    produce<kBf16, kLayer>(p, items, stages_base, full, empty);
  } else {
    consume<kBf16, kLayer>(p, items, decode_smem, stages_base, full, empty);
  }
}

}  // namespace fkda_dev

// One kernel per pool dtype (V x K), each plain and with the layer step.
// Only code for sm_90 and later has the bulk copies; the host launches
// these only where the device runs such code (DeviceFacts.runs_sm90_code).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FKDA_DECODE_STREAMED_BODY(bf16, layer)
#else
#define FKDA_DECODE_STREAMED_BODY(bf16, layer) fkda_dev::decode_streamed<bf16, layer>(p);
#endif
#define FKDA_DEFINE_DECODE_STREAMED(name, bf16, layer, warps, blocks)                          \
  extern "C" __global__ void __launch_bounds__(FKDA_DECODE_STREAM_THREADS(warps), blocks)       \
      name(const FkdaDecodeParams p) {                                                         \
    FKDA_DECODE_STREAMED_BODY(bf16, layer)                                                     \
  }
FKDA_DEFINE_DECODE_STREAMED(fkda_decode_streamed_f32, false, false, FKDA_DECODE_MAX_WARPS, 2)
FKDA_DEFINE_DECODE_STREAMED(fkda_decode_streamed_bf16, true, false, FKDA_DECODE_MAX_WARPS, 2)
FKDA_DEFINE_DECODE_STREAMED(fkda_decode_streamed_f32_layer, false, true, FKDA_DECODE_STREAM_LAYER_WARPS, 1)
FKDA_DEFINE_DECODE_STREAMED(fkda_decode_streamed_bf16_layer, true, true, FKDA_DECODE_STREAM_LAYER_WARPS, 1)
#undef FKDA_DEFINE_DECODE_STREAMED
#undef FKDA_DECODE_STREAMED_BODY
