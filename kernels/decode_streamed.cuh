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
// q, k, g, v and the head's dt_bias) while the four consumer warps step
// item j from shared memory, and the producer writes each item's rows back
// to the pool with one bulk store once the consumers are done with them.
//
// Items are FKDA_DECODE_STREAM_ROWS (64) rows of one (sequence, head) state,
// item i = (n H + h) 2 + half; block b takes items b, b + grid, ... Within an
// item the consumer threads own their rows as the plain kernel's 4-warp
// block does (decode_recurrence.cuh), and the arithmetic is the same
// (step_token_rows), so the results are bit-identical to the plain kernel's.
//
// Served: [N] indices (no table), V x K pools (an item's rows are then one
// contiguous run of the pool), no layer step. The host chooses this kernel
// (src/gpu/gpu_decode.cpp). Untrusted device values are handled as in the
// plain kernel: offsets clamped, a null, out-of-range or overlong sequence
// is padding (outputs zero, no state touched).
#pragma once

#include "decode_params.h"
#include "decode_recurrence.cuh"
#include "device_common.cuh"

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
static_assert(sizeof(StreamHeader) <= FKDA_DECODE_STREAM_HEADER_BYTES, "the header fits its place");

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
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * FKDA_DECODE_MAX_WARPS) : "memory");
}

// ---- a stage ----
struct StreamStage {
  unsigned char* base;
  __device__ StreamHeader& header() const { return *reinterpret_cast<StreamHeader*>(base); }
  __device__ unsigned char* state() const { return base + FKDA_DECODE_STREAM_HEADER_BYTES; }
  __device__ float* dt_bias(bool bf16) const {
    return reinterpret_cast<float*>(state() + fkda_decode_stream_state_bytes(bf16));
  }
  __device__ unsigned char* token(bool bf16, int t) const {
    return reinterpret_cast<unsigned char*>(dt_bias(bf16) + FKDA_HEAD_DIM) + t * FKDA_DECODE_STREAM_TOKEN_BYTES;
  }
  __device__ uint16_t* q(bool bf16, int t) const { return reinterpret_cast<uint16_t*>(token(bf16, t)); }
  __device__ uint16_t* k(bool bf16, int t) const { return reinterpret_cast<uint16_t*>(token(bf16, t) + 256); }
  __device__ void* g(bool bf16, int t) const { return token(bf16, t) + 512; }
  __device__ uint16_t* v(bool bf16, int t) const { return reinterpret_cast<uint16_t*>(token(bf16, t) + 1024); }
};

// The item's (sequence, head, half) and its header, from the device's
// offsets and indices (each lane of the producer one item).
struct StreamItem {
  int head, half;
  StreamHeader header;
};

// Element offset of (batch row, head, token) in an activation.
__device__ __forceinline__ int64_t token_element(const FkdaActivation& a, int64_t batch_row, int head, int64_t token) {
  return batch_row * a.stride_b + int64_t(head) * a.stride_h + token * a.stride_t;
}

__device__ __forceinline__ StreamItem stream_item(const FkdaDecodeParams& p, int64_t item, bool bf16) {
  StreamItem it;
  const int64_t pair = item >> 1;
  const int64_t n = pair / p.call.num_heads;
  it.head = int(pair % p.call.num_heads);
  it.half = int(item & 1);
  StreamHeader& h = it.header;
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
  h.rate = 1.f;
#pragma unroll
  for (int t = 0; t < FKDA_DECODE_STREAM_TOKENS; ++t) h.beta[t] = 0.f;
  if (h.length == 0 || h.length > p.max_tokens) return it;
  const int64_t slot = usable_slot(load_index(p.state_indices, n, 0), p.call.first_real_slot, p.pool_slots);
  if (slot < 0) return it;
  const int64_t element_bytes = bf16 ? 2 : 4;
  h.matrix = static_cast<unsigned char*>(p.pool) +
             (slot * p.pool_slot_stride + int64_t(it.head) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM) +
              int64_t(it.half) * FKDA_DECODE_STREAM_ROWS * FKDA_HEAD_DIM) *
                 element_bytes;
  h.rate = gate_rate(p.call.A_log, it.head, true);
#pragma unroll
  for (int t = 0; t < FKDA_DECODE_STREAM_TOKENS; ++t) {
    if (t < h.length) {
      h.beta[t] = load_beta(p.call.gate, p.call.beta.data, token_element(p.call.beta, h.batch_row, it.head, h.begin + t));
    }
  }
  return it;
}

__device__ __forceinline__ const unsigned char* token_address(const FkdaActivation& a, int64_t batch_row,
                                                              int64_t token, int head, int element_bytes) {
  return static_cast<const unsigned char*>(a.data) + token_element(a, batch_row, head, token) * element_bytes;
}

// The producer: item j's copies into stage j % stages, once the consumers
// have released it and the item that held it has been stored.
template <bool kBf16>
__device__ __forceinline__ void produce(const FkdaDecodeParams& p, int64_t items, unsigned char* stages_base,
                                        uint32_t full, uint32_t empty) {
  const int lane = threadIdx.x & 31;
  const int stage_bytes = fkda_decode_stream_stage_bytes(kBf16);
  const int state_bytes = fkda_decode_stream_state_bytes(kBf16);
  const int g_bytes = p.call.gate.g_is_f32 ? 512 : 256;
  StreamItem mine = {};  // lane i: item j + i of the current run of 32
  int64_t j = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x, ++j) {
    // The lanes look 32 items ahead at once, so that the chain of dependent
    // loads (offsets, then the slot, then beta) is paid once per 32 items.
    if (j % 32 == 0) {
      const int64_t ahead = item + int64_t(lane) * gridDim.x;
      if (ahead < items) mine = stream_item(p, ahead, kBf16);
    }
    const int from = int(j % 32);
    StreamItem it;
    it.head = __shfl_sync(0xffffffffu, mine.head, from);
    it.half = __shfl_sync(0xffffffffu, mine.half, from);
    it.header.begin = __shfl_sync(0xffffffffu, mine.header.begin, from);
    it.header.batch_row = __shfl_sync(0xffffffffu, mine.header.batch_row, from);
    it.header.matrix = reinterpret_cast<unsigned char*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(mine.header.matrix), from));
    it.header.length = __shfl_sync(0xffffffffu, mine.header.length, from);
    it.header.rate = __shfl_sync(0xffffffffu, mine.header.rate, from);
#pragma unroll
    for (int t = 0; t < FKDA_DECODE_STREAM_TOKENS; ++t) it.header.beta[t] = __shfl_sync(0xffffffffu, mine.header.beta[t], from);
    if (lane == 0) {
      const int stage = int(j % p.stages);
      const uint32_t stage_full = full + 8 * stage, stage_empty = empty + 8 * stage;
      const StreamStage s{stages_base + stage * stage_bytes};
      if (j >= p.stages) {
        barrier_wait(stage_empty, uint32_t((j / p.stages - 1) & 1));
        if (s.header().matrix != nullptr) {
          bulk_store(s.header().matrix, smem_address(s.state()), state_bytes);
          bulk_stores_read();
        }
      }
      s.header() = it.header;
      const StreamHeader& h = it.header;
      if (h.matrix == nullptr) {
        barrier_arrive(stage_full);
      } else {
        const int staged_tokens = h.length < FKDA_DECODE_STREAM_TOKENS ? h.length : FKDA_DECODE_STREAM_TOKENS;
        const bool dt = p.call.dt_bias != nullptr;
        barrier_arrive_expecting(stage_full, state_bytes + (dt ? FKDA_HEAD_DIM * 4 : 0) +
                                                 staged_tokens * (512 + g_bytes + FKDA_DECODE_STREAM_ROWS * 2));
        bulk_load(smem_address(s.state()), h.matrix, state_bytes, stage_full);
        if (dt) {
          bulk_load(smem_address(s.dt_bias(kBf16)), p.call.dt_bias + int64_t(it.head) * FKDA_HEAD_DIM,
                    FKDA_HEAD_DIM * 4, stage_full);
        }
        for (int t = 0; t < staged_tokens; ++t) {
          const int64_t token = h.begin + t;
          bulk_load(smem_address(s.q(kBf16, t)), token_address(p.call.q, h.batch_row, token, it.head, 2), 256,
                    stage_full);
          bulk_load(smem_address(s.k(kBf16, t)), token_address(p.call.k, h.batch_row, token, it.head, 2), 256,
                    stage_full);
          bulk_load(smem_address(s.g(kBf16, t)),
                    token_address(p.call.g, h.batch_row, token, it.head, p.call.gate.g_is_f32 ? 4 : 2), g_bytes,
                    stage_full);
          bulk_load(smem_address(s.v(kBf16, t)),
                    token_address(p.call.v, h.batch_row, token, it.head, 2) + it.half * FKDA_DECODE_STREAM_ROWS * 2,
                    FKDA_DECODE_STREAM_ROWS * 2, stage_full);
        }
      }
    }
    __syncwarp();
  }
  // The last stages' items, once the consumers are done with them.
  if (lane == 0) {
    const int64_t count = j;
    for (int64_t last = count > p.stages ? count - p.stages : 0; last < count; ++last) {
      const int stage = int(last % p.stages);
      const StreamStage s{stages_base + stage * stage_bytes};
      barrier_wait(empty + 8 * stage, uint32_t((last / p.stages) & 1));
      if (s.header().matrix != nullptr) bulk_store(s.header().matrix, smem_address(s.state()), state_bytes);
    }
    bulk_stores_done();
  }
}

// The consumers: for each token of an item, its preparation (all four
// warps: warp w the decays of channels 32 w .. 32 w + 31, so that one
// token's preparation is short) into one of two places, then the step of
// every row; then the rows back into the stage for the producer's store.
// Preparing token u into place u % 2 needs one barrier a token: the step
// that last read that place (token u - 2) is behind every consumer once
// they have all passed token u - 1's barrier.
template <bool kBf16>
__device__ __forceinline__ void consume(const FkdaDecodeParams& p, int64_t items, unsigned char* smem,
                                        unsigned char* stages_base, uint32_t full, uint32_t empty) {
  constexpr int rows = FKDA_DECODE_STREAM_ROWS;
  constexpr int places = FKDA_DECODE_STREAM_PREPARED_TOKENS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, l = lane & 7;
  const int local_row = warp * FKDA_DECODE_ROWS_PER_WARP + (lane >> 3) * kDecodeRowsPerGroup;
  const int channel = 32 * warp + lane;
  float* key = reinterpret_cast<float*>(smem + fkda_decode_key_offset());
  float* query = reinterpret_cast<float*>(smem + fkda_decode_query_offset(places));
  float* decay = reinterpret_cast<float*>(smem + fkda_decode_decay_offset(places));
  float* value = reinterpret_cast<float*>(smem + fkda_decode_value_offset(places));
  float* beta = reinterpret_cast<float*>(smem + fkda_decode_beta_offset(places, FKDA_DECODE_MAX_WARPS));
  const int stage_bytes = fkda_decode_stream_stage_bytes(kBf16);
  uint32_t prepared = 0;  // tokens this block has prepared
  int64_t j = 0;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x, ++j) {
    const int stage = int(j % p.stages);
    const StreamStage s{stages_base + stage * stage_bytes};
    barrier_wait(full + 8 * stage, uint32_t((j / p.stages) & 1));
    const StreamHeader h = s.header();
    const int head = int((item >> 1) % p.call.num_heads), block_row = int(item & 1) * rows;
    uint16_t* out = static_cast<uint16_t*>(p.call.out.data) + h.batch_row * p.call.out.stride_b +
                    int64_t(head) * p.call.out.stride_h + h.begin * p.call.out.stride_t + block_row;
    const int tokens = h.length;
    if (h.matrix == nullptr) {
      for (int64_t i = tid; i < int64_t(tokens) * rows; i += 32 * FKDA_DECODE_MAX_WARPS) {
        out[(i / rows) * p.call.out.stride_t + i % rows] = 0;
      }
      barrier_arrive(empty + 8 * stage);
      continue;
    }
    float st[kDecodeRowsPerGroup][kDecodeColumnsPerLane];
    // The rows lie in the stage as in the pool: the plain kernel's
    // accesses, each group's 8 lanes on 128 contiguous bytes of a row.
    load_state_rows<kBf16, false, true>(s.state(), local_row, l, st);
    const float dt = p.call.dt_bias != nullptr ? s.dt_bias(kBf16)[channel] : 0.f;
#pragma unroll 1
    for (int t = 0; t < tokens; ++t, ++prepared) {
      const int place = int(prepared % places);
      const bool staged = t < FKDA_DECODE_STREAM_TOKENS;
      const int64_t token = h.begin + t;
      const uint16_t* q_row = staged ? s.q(kBf16, t)
                                     : reinterpret_cast<const uint16_t*>(token_address(p.call.q, h.batch_row, token, head, 2));
      const uint16_t* k_row = staged ? s.k(kBf16, t)
                                     : reinterpret_cast<const uint16_t*>(token_address(p.call.k, h.batch_row, token, head, 2));
      const uint2 qw = *reinterpret_cast<const uint2*>(q_row + 4 * lane);
      const uint2 kw = *reinterpret_cast<const uint2*>(k_row + 4 * lane);
      const float4 q = make_float4(bf16_lo(qw.x), bf16_hi(qw.x), bf16_lo(qw.y), bf16_hi(qw.y));
      const float4 k = make_float4(bf16_lo(kw.x), bf16_hi(kw.x), bf16_lo(kw.y), bf16_hi(kw.y));
      const void* g_row = staged ? s.g(kBf16, t)
                                 : token_address(p.call.g, h.batch_row, token, head, p.call.gate.g_is_f32 ? 4 : 2);
      const float g = p.call.gate.g_is_f32 ? static_cast<const float*>(g_row)[channel]
                                           : bf16_bits(static_cast<const uint16_t*>(g_row)[channel]);
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
        const uint16_t* v_row = staged ? s.v(kBf16, t)
                                       : reinterpret_cast<const uint16_t*>(token_address(p.call.v, h.batch_row, token, head, 2)) + block_row;
        value[place * rows + tid] = bf16_bits(v_row[tid]);
      }
      if (tid == 0) {
        const float raw = staged ? s.header().beta[t]
                                 : load_beta(p.call.gate, p.call.beta.data, token_element(p.call.beta, h.batch_row, head, token));
        beta[place] = step_size(p.call.gate, raw, true);
      }
      consumers_sync();
      float o[kDecodeRowsPerGroup];
      step_token_rows<kBf16, kDecodeRowsPerGroup>(st, key + place * FKDA_HEAD_DIM, decay + place * FKDA_HEAD_DIM,
                                                  query + place * FKDA_HEAD_DIM, beta[place],
                                                  value + place * rows + local_row, l, o);
      // The group's four outputs in one 8-byte store (as the plain kernel).
      if (l == 0) {
        *reinterpret_cast<uint2*>(out + t * p.call.out.stride_t + local_row) =
            make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
      }
    }
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerGroup; ++r) store_state_row<kBf16, false, true>(s.state(), local_row + r, l, st[r]);
    fence_for_bulk_copies();
    barrier_arrive(empty + 8 * stage);
  }
}

template <bool kBf16>
__device__ __forceinline__ void decode_streamed(const FkdaDecodeParams& p) {
  extern __shared__ __align__(16) unsigned char decode_smem[];
  const int64_t items = p.call.num_seqs * p.call.num_heads * (FKDA_HEAD_DIM / FKDA_DECODE_STREAM_ROWS);
  const uint32_t barriers = smem_address(decode_smem + fkda_decode_stream_barriers_offset());
  const uint32_t full = barriers, empty = barriers + 8 * FKDA_DECODE_STREAM_MAX_STAGES;
  unsigned char* stages_base = decode_smem + fkda_decode_stream_stages_offset();
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < p.stages; ++stage) {
      barrier_init(full + 8 * stage, 1);
      barrier_init(empty + 8 * stage, 32 * FKDA_DECODE_MAX_WARPS);
    }
    // The bulk copies complete on these barriers through the async proxy,
    // which sees their initialisation only after this fence.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= 32 * FKDA_DECODE_MAX_WARPS) {
    produce<kBf16>(p, items, stages_base, full, empty);
  } else {
    consume<kBf16>(p, items, decode_smem, stages_base, full, empty);
  }
}

}  // namespace fkda_dev

// One kernel per pool dtype (V x K). Only code for sm_90 and later has the
// bulk copies; the host launches these only where the device runs such
// code (DeviceFacts.runs_sm90_code).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FKDA_DECODE_STREAMED_BODY(bf16)
#else
#define FKDA_DECODE_STREAMED_BODY(bf16) fkda_dev::decode_streamed<bf16>(p);
#endif
#define FKDA_DEFINE_DECODE_STREAMED(name, bf16)                                                \
  extern "C" __global__ void __launch_bounds__(32 * (FKDA_DECODE_MAX_WARPS + 1), 2)            \
      name(const FkdaDecodeParams p) {                                                         \
    FKDA_DECODE_STREAMED_BODY(bf16)                                                            \
  }
FKDA_DEFINE_DECODE_STREAMED(fkda_decode_streamed_f32, false)
FKDA_DEFINE_DECODE_STREAMED(fkda_decode_streamed_bf16, true)
#undef FKDA_DEFINE_DECODE_STREAMED
#undef FKDA_DECODE_STREAMED_BODY
