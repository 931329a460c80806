// SPDX-License-Identifier: MIT
// Kernel 1 of the prefill: the token-parallel preparation of every chunk.
//
// What it computes, per (chunk slot, head), as the CPU backend would
// (docs/NUMERICS.md steps; i, j tokens of the chunk, k a channel):
//
//   find the sequence n owning the slot and the chunk's tokens [t0, t0 + len)
//   for each token i < len:                                 step 1, 2
//     a2[i][k] = gate_scale * sigmoid(exp(A_log[h]) * (g[i][k] + dt_bias[h][k]))
//     rq[i] = 1 / sqrt(sum_k q[i][k]^2 + 1e-6), rk[i] likewise, b[i] = sigmoid(beta[i])
//   tokens i >= len: a2 = 0, q = k = 0, b = 0 (so their operands are zero)
//   c[i][k] = a2[0][k] + ... + a2[i][k] in token order;  c_last = c[15] (= c[len - 1])
//   Kd = f16(k rk 2^c)  Qd = f16(q rq scale 2^c)  Kr = f16(k rk 2^(c_last - c))   step 3
//   decay[k] = 2^c_last[k]
//   A = bf16(k rk 2^c) bf16(k rk 2^-c)^T, B = bf16(q rq scale 2^c) bf16(k rk 2^-c)^T  step 4
//   L = strict_lower(A) scaled by row b[i];  Mqk = f16(lower_incl_diag(B))
//   INV = (I - L)(I + L^2)(I + L^4)(I + L^8);  W = f16(INV diag(b))                    step 5
//   write Kd, Qd, Kr, decay, W, Mqk to the slot's workspace record
//
// One block of 128 threads per (slot, head) of the current window. Thread t
// owns the channel pair 2 (t % 64), +1 for the 8 tokens 8 (t / 64) .. +7:
// every global access of a warp is one contiguous 128-byte row segment, and
// the running sum along the tokens stays in registers (the second half of
// the tokens continues from the first half's total, so the sum keeps its
// token order). The first half's
// warps (0, 1) learn c_last only at the second barrier, so they write Kr
// after it and are done; warps 2 and 3 write theirs before it and then run
// the 16x16 products on the tensor cores: warp 3 B and Mqk, warp 2 A and the
// inverse, whose products run on the tensor cores too (3xTF32, below).
//
// With an unbounded gate (SOFTPLUS, LOG_DECAY; docs/NUMERICS.md, "Any
// decay") the key factor 2^-c has no bound: A and B come instead from four
// levels of pair factors built from the per-token decays d = 2^a2 (each
// <= 1), one level per warp. The running sums c stay finite through the
// per-token floor; 2^c and 2^(c_last - c) are running products of the d
// from one exp2 per half of the chunk (docs/NUMERICS.md): 20 exp2s a thread
// instead of 48, besides the gate's own.
//
// With the layer step's convolution (the _conv kernels) q and k are the raw
// projections: each thread convolves its pairs as it loads them, so that
// they never pass through the workspace.
#pragma once

#include <type_traits>

#include "device_common.cuh"
#include "layer_conv.cuh"
#include "layer_params.h"

namespace fkda_dev {

constexpr int kBf16TilePitch = 136;  // elements: 128 + 8, rows 272 bytes apart
constexpr int kTransposePitch = 20;  // floats: keeps the column reads of A free of bank conflicts

// Sum over the warp of v[r] for the token r = (lane / 4) % 8 this lane ends
// with: each exchange halves the values a lane carries, so 8 per-token sums
// cost 9 shuffles instead of 40.
__device__ __forceinline__ float warp_sum_rows8(const float (&v)[8], int lane) {
  const bool up16 = lane & 16, up8 = lane & 8, up4 = lane & 4;
  float four[4], two[2];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float keep = up16 ? v[j + 4] : v[j], send = up16 ? v[j] : v[j + 4];
    four[j] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float keep = up8 ? four[j + 2] : four[j], send = up8 ? four[j] : four[j + 2];
    two[j] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  float one = (up4 ? two[1] : two[0]) + __shfl_xor_sync(0xffffffffu, up4 ? two[0] : two[1], 4);
  one += __shfl_xor_sync(0xffffffffu, one, 2);
  one += __shfl_xor_sync(0xffffffffu, one, 1);
  return one;
}

// ------------------------------------------------- the 16x16 inverse ---
// A 16x16 f32 matrix held by one warp in the accumulator layout of
// mma.m16n8 (g = lane / 4, t = lane % 4): m[j][0], m[j][1] are row g,
// columns 8j + 2t and 8j + 2t + 1; m[j][2], m[j][3] the same columns of row
// g + 8.
struct WarpTile {
  float m[2][4];
};

__device__ __forceinline__ WarpTile zero_tile() {
  WarpTile z;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) z.m[j][e] = 0.f;
  return z;
}

// Each entry x as hi + lo: hi is x rounded to tf32 (10 mantissa bits, ties
// away from zero), lo = x - hi exactly; the tensor cores read lo to tf32
// precision too. hi*hi + hi*lo + lo*hi then misses x*y by about 2^-21
// relatively, a few f32 ulps, where one tf32 product would miss by 2^-11.
// Entries of a triangle known to be zero stay exact zeros, so that the
// compiler drops them.
struct SplitTile {
  uint32_t hi[2][4];
  uint32_t lo[2][4];
};

enum class Shape { kLower, kUpper };

template <Shape kShape>
__device__ __forceinline__ SplitTile split_tf32(const WarpTile& x) {
  SplitTile s;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // Rows 0-7 of columns 8-15 are zero below the diagonal; rows 8-15 of
      // columns 0-7 above it.
      const bool zero = kShape == Shape::kLower ? (j == 1 && e < 2) : (j == 0 && e >= 2);
      const uint32_t hi = zero ? 0u : (__float_as_uint(x.m[j][e]) + 0x1000u) & 0xffffe000u;
      s.hi[j][e] = hi;
      s.lo[j][e] = zero ? 0u : __float_as_uint(x.m[j][e] - __uint_as_float(hi));
    }
  }
  return s;
}

// The (k step s, n tile j) pairs of a 16x16x16 product, bit 2 s + j. A
// triangular right factor Y makes one pair vanish: rows 0-7 of its columns
// 8-15 when lower, rows 8-15 of its columns 0-7 when upper.
constexpr int kAllPairs = 0xF;
constexpr int kLowerRight = kAllPairs & ~(1 << 1);  // without (s 0, j 1)
constexpr int kUpperRight = kAllPairs & ~(1 << 2);  // without (s 1, j 0)

// d += X Y on the tensor cores (m16n8k8, tf32), from the splits of X and of
// Y^T, both in the accumulator layout. Taking each k step's columns in the
// order 0, 2, 4, 6, 1, 3, 5, 7 (any order of k gives the same product) makes
// X's accumulator layout an A fragment and Y^T's a B fragment, so a product
// needs no data movement at all. The small terms go first.
template <int kPairs>
__device__ __forceinline__ void add_product(WarpTile& d, const SplitTile& x, const SplitTile& yt) {
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (!(kPairs & (1 << (2 * s + j)))) continue;
        const uint32_t a_hi[4] = {x.hi[s][0], x.hi[s][2], x.hi[s][1], x.hi[s][3]};
        const uint32_t b_hi0 = yt.hi[s][2 * j], b_hi1 = yt.hi[s][2 * j + 1];
        if (pass == 0) {
          const uint32_t a_lo[4] = {x.lo[s][0], x.lo[s][2], x.lo[s][1], x.lo[s][3]};
          mma_tf32(d.m[j], a_lo, b_hi0, b_hi1);
          mma_tf32(d.m[j], a_hi, yt.lo[s][2 * j], yt.lo[s][2 * j + 1]);
        } else {
          mma_tf32(d.m[j], a_hi, b_hi0, b_hi1);
        }
      }
    }
  }
}

// -INV = -(I + L)^-1 = -(I - L)(I + L^2)(I + L^4)(I + L^8) for a strictly
// lower triangular L, given L and L^T; the result is lower triangular. Every
// power is formed together with its transpose (L^T L^T = (L L)^T), which
// supplies the next products' right factors: 21 (s, j) pairs of 3 mma each.
// The running product is kept negated, N = -(I - L)(I + L^2) = L - I - L^2
// + L L^2, so that each further factor is one accumulation into it.
__device__ __forceinline__ WarpTile negated_unit_lower_inverse(const WarpTile& L, const WarpTile& LT, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const SplitTile sL = split_tf32<Shape::kLower>(L), sLT = split_tf32<Shape::kUpper>(LT);
  WarpTile L2 = zero_tile(), L2T = zero_tile();
  add_product<kLowerRight>(L2, sL, sLT);
  add_product<kUpperRight>(L2T, sLT, sL);

  const SplitTile sL2 = split_tf32<Shape::kLower>(L2), sL2T = split_tf32<Shape::kUpper>(L2T);
  WarpTile N;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
      // L's entries are hi + lo exactly, so L itself need not stay live.
      const float l = __uint_as_float(sL.hi[j][e]) + __uint_as_float(sL.lo[j][e]);
      N.m[j][e] = (l - L2.m[j][e]) - (row == col ? 1.f : 0.f);
    }
  }
  add_product<kLowerRight>(N, sL, sL2T);  // + L L^2
  WarpTile L4 = zero_tile(), L4T = zero_tile();
  add_product<kLowerRight>(L4, sL2, sL2T);
  add_product<kUpperRight>(L4T, sL2T, sL2);

  // L^8 is zero but for its rows 8-15 of columns 0-7, so only that block of
  // its transpose (n tile 1) is formed, and N L^8 is one (s, j) pair.
  const SplitTile sL4 = split_tf32<Shape::kLower>(L4), sL4T = split_tf32<Shape::kUpper>(L4T);
  const SplitTile sN = split_tf32<Shape::kLower>(N);
  add_product<kLowerRight>(N, sN, sL4T);  // N (I + L^4)
  WarpTile L8T = zero_tile();
  add_product<(1 << 1) | (1 << 3)>(L8T, sL4T, sL4);

  const SplitTile sN2 = split_tf32<Shape::kLower>(N), sL8T = split_tf32<Shape::kUpper>(L8T);
  add_product<1 << 2>(N, sN2, sL8T);  // N (I + L^8)
  return N;
}

}  // namespace fkda_dev

// The resident blocks per multiprocessor the kernels are compiled for. The
// bounded gate's: 8 (64 registers a thread) from sm_90 on; sm_80's code
// generation spills at 64 registers, so 7 (72) there. The unbounded gates'
// (31 KB of shared memory a block): 6 (80 registers, a few bytes spilled,
// faster on the H200 than 5 without spills) from sm_90 on; sm_80's 164 KB
// of shared memory hold only 5, so 96 registers there. GPUs with about
// 100 KB (sm_86, sm_89, sm_120) hold 3 of these blocks whatever the bound.
// With the layer step's convolution the unbounded gates' kernels keep
// their bounds; the bounded gate's, whose loads of q, k and g are all in
// flight at once, is compiled for 8 blocks from sm_90 on (64 registers, 32
// bytes spilled: on the H200 its W3 preparation took 188 us against 196 at
// 6 blocks without spills, for it is bound by issuing its instructions and
// more warps hide their latencies) and for 6 on sm_80 (80 registers, no
// spill; not measured there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FKDA_PREPARE_BLOCKS_COMPILED 7
#define FKDA_PREPARE_ANY_DECAY_BLOCKS 5
#define FKDA_PREPARE_CONV_BLOCKS_COMPILED 6
#else
#define FKDA_PREPARE_BLOCKS_COMPILED FKDA_PREPARE_MIN_BLOCKS
#define FKDA_PREPARE_ANY_DECAY_BLOCKS 6
#define FKDA_PREPARE_CONV_BLOCKS_COMPILED 8
#endif

namespace fkda_dev {

// ------------------------------------------ the any-decay chunk products ---
// With an unbounded gate the bounded path's key factor 2^(-c) overflows, so
// A and B are formed from factors that never exceed 1 (docs/NUMERICS.md,
// "Any decay"): the pair (i, j), j < i, splits at level
// l = floor(log2(i ^ j)), where j is in the left and i in the right half
// of one block of 2^(l + 1) tokens whose left half ends at token m; then
// 2^(c_i - c_j) = rho_l[i] * lambda_l[j] with rho_l[i] = d[m+1] ... d[i] and
// lambda_l[j] = d[j+1] ... d[m], products of per-token decays d <= 1.
constexpr int kLevels = 4;


// Per thread: the level factors of its 8 tokens (first = 8 half) for one
// channel, from the per-token decays d. Levels 0-2 are blocks inside a
// half; at level 3 half 0 is the left side (lambda, m = 7) and half 1 the
// right (rho, m + 1 = 8).
template <int kLevel>
__device__ __forceinline__ void level_factors(const float (&d)[8], int half, float (&f)[8]) {
  if constexpr (kLevel == 3) {
    if (half == 1) {
      f[0] = d[0];
#pragma unroll
      for (int r = 1; r < 8; ++r) f[r] = f[r - 1] * d[r];
    } else {
      f[7] = 1.f;
#pragma unroll
      for (int r = 6; r >= 0; --r) f[r] = f[r + 1] * d[r + 1];
    }
  } else {
    constexpr int s = 2 << kLevel, mid = s / 2;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      if (r % s >= mid) f[r] = r % s == mid ? d[r] : f[r - 1] * d[r];  // right: upward from m + 1
    }
#pragma unroll
    for (int r = 7; r >= 0; --r) {
      if (r % s < mid) f[r] = r % s == mid - 1 ? 1.f : f[r + 1] * d[r + 1];  // left: downward from m
    }
  }
}

template <int kLevel>
__device__ __forceinline__ bool is_right(int r, int half) {
  if constexpr (kLevel == 3) return half == 1;
  return r % (2 << kLevel) >= (1 << kLevel);
}

// -------------------------------------------- the steps of a chunk's record ---
// The functions below are the steps of prepare_chunks, in its order; each is
// called by every thread of the block unless its comment names the threads.

// The chunk of one workspace slot: its sequence (the n-th) and its tokens
// [t0, t0 + len).
struct ChunkTokens {
  Sequence seq;
  int64_t n;
  int64_t t0;
  int len;
};

// Finds the sequence owning `slot`: the last one whose slots start at or
// before it. False for a slot between sequences, which holds no chunk.
__device__ __forceinline__ bool locate_chunk(const FkdaPrefillParams& p, int64_t slot, ChunkTokens& chunk) {
  int64_t lo = 0, hi = p.call.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (slot_base_of(p, mid) <= slot) lo = mid; else hi = mid - 1;
  }
  chunk.seq = sequence_of(p, lo);
  chunk.n = lo;
  const int64_t index = slot - chunk.seq.slot_base;
  if (index < 0 || index >= num_chunks(chunk.seq)) return false;
  chunk.t0 = chunk.seq.begin + index * FKDA_CHUNK;
  chunk.len = int(chunk.seq.end - chunk.t0 < FKDA_CHUNK ? chunk.seq.end - chunk.t0 : FKDA_CHUNK);
  return true;
}

// A thread's place in the block: the channels 2 pair, 2 pair + 1 of the
// tokens first .. first + 7 (first = 8 half), of which those below rows are
// in the chunk; g = lane / 4 and t = lane % 4 place it in the mma
// fragments of steps 4 and 5 (prepare_chunks sets them before those steps).
struct PrepareThread {
  int tid, lane, warp;
  int pair, half, first, rows;
  int g, t;
};

__device__ __forceinline__ PrepareThread prepare_thread(int tid, int len) {
  PrepareThread th;
  th.tid = tid;
  th.lane = tid & 31;
  th.warp = tid >> 5;
  th.pair = tid & 63;
  th.half = tid >> 6;
  th.first = 8 * th.half;
  th.rows = len - th.first;
  return th;
}

// Element offset of the thread's first token and channel pair in an activation.
__device__ __forceinline__ int64_t token_offset(const FkdaActivation& a, const ChunkTokens& chunk, int head,
                                                const PrepareThread& th) {
  return chunk.seq.row * a.stride_b + int64_t(head) * a.stride_h + (chunk.t0 + th.first) * a.stride_t + 2 * th.pair;
}

// The thread's q, k and g of its 8 tokens as stored: bf16 pairs, or for g
// f32 pairs (g32) with kGF32. g stays in its stored form until the gate
// (bf16 pairs take half the registers). Tokens past the chunk read as 0.
struct TokenPairs {
  uint32_t q[8], k[8], g[8];
  float2 g32[8];
};

// Step 1, 2's loads. The addresses step along the tokens whether or not a
// token is loaded, so the loads are predicated, not branched around, and all
// issue at once. kConv: q and k are convolved from the raw projections
// (convolve_and_load_pairs), so only g is loaded.
template <bool kGF32, bool kConv>
__device__ __forceinline__ void load_token_pairs(const FkdaPrefillParams& p, const ChunkTokens& chunk, int head,
                                                 const PrepareThread& th, TokenPairs& in) {
  const uint16_t* q = static_cast<const uint16_t*>(p.call.q.data) + token_offset(p.call.q, chunk, head, th);
  const uint16_t* k = static_cast<const uint16_t*>(p.call.k.data) + token_offset(p.call.k, chunk, head, th);
  const uint16_t* g = static_cast<const uint16_t*>(p.call.g.data) + token_offset(p.call.g, chunk, head, th);
  const float* g32 = static_cast<const float*>(p.call.g.data) + token_offset(p.call.g, chunk, head, th);
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    if constexpr (!kConv) in.q[r] = in.k[r] = 0u;
    in.g[r] = 0u;
    in.g32[r] = make_float2(0.f, 0.f);
    if (r < th.rows) {
      if constexpr (!kConv) {
        in.q[r] = __ldg(reinterpret_cast<const unsigned int*>(q));
        in.k[r] = __ldg(reinterpret_cast<const unsigned int*>(k));
      }
      if constexpr (kGF32) in.g32[r] = __ldg(reinterpret_cast<const float2*>(g32));
      else in.g[r] = __ldg(reinterpret_cast<const unsigned int*>(g));
    }
    q += p.call.q.stride_t;
    k += p.call.k.stride_t;
    g += p.call.g.stride_t;
    g32 += p.call.g.stride_t;
  }
}

// One projection's inputs to the layer step's convolution, as loaded: the
// raw pairs of the thread's tokens (0 past the chunk) and, per channel, the
// inputs 1 .. W - 1 tokens before its first token (history[e][b - 1]).
struct ConvInputs {
  uint32_t x[8];
  float history[2][FKDA_CONV_MAX_WIDTH - 1];
};

// Loads one projection's ConvInputs. position: the first token's in its
// sequence; row: the sequence's conv state row, where inputs before its
// first token are needed (0 where it reads none). A thread without tokens
// (the second half of a chunk of at most 8) reads no input before them:
// those may lie past the tensor.
__device__ __forceinline__ void load_conv_inputs(const FkdaPrefillParams& p, int proj, const ChunkTokens& chunk,
                                                 int head, const PrepareThread& th, int64_t position, ConvRow row,
                                                 ConvInputs& in) {
  const FkdaActivation& raw = proj == 0 ? p.call.q : p.call.k;
  const FkdaConv& conv = p.layer.conv[proj];
  const int width = p.layer.conv_width;
  const int64_t c0 = int64_t(head) * FKDA_HEAD_DIM + 2 * th.pair;
  const uint16_t* first = static_cast<const uint16_t*>(raw.data) + token_offset(raw, chunk, head, th);
  const uint16_t* token = first;
#pragma unroll
  for (int r = 0; r < 8; ++r) {  // predicated, as in load_token_pairs
    in.x[r] = 0u;
    if (r < th.rows) in.x[r] = __ldg(reinterpret_cast<const unsigned int*>(token));
    token += raw.stride_t;
  }
#pragma unroll
  for (int b = 1; b < FKDA_CONV_MAX_WIDTH; ++b) {
    const int64_t at = position - b;
    in.history[0][b - 1] = in.history[1][b - 1] = 0.f;
    if (b < width && at >= 0 && th.rows > 0) {
      const uint32_t before = __ldg(reinterpret_cast<const unsigned int*>(first - b * raw.stride_t));
      in.history[0][b - 1] = bf16_lo(before);
      in.history[1][b - 1] = bf16_hi(before);
    } else if (b < width && row.reads) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        in.history[e][b - 1] = conv_state_at(p.layer, conv, row.row, c0 + e, p.layer.conv_state_width + int(at));
      }
    }
  }
}

// The convolution of loaded inputs into x, rounded to bf16 as
// fkda_layer_convolve rounds v (0 past the chunk); one channel at a time,
// channel 0's outputs waiting in y_first. The pair's weights and biases
// come from the weight table here rather than with the inputs: loaded
// early they would cost registers (the H200 measured it 2% slower).
__device__ __forceinline__ void convolve_loaded(const FkdaPrefillParams& p, int proj, int head, const PrepareThread& th,
                                                ConvInputs& in, uint32_t (&x)[8]) {
  const int width = p.layer.conv_width;
  const int64_t channels = int64_t(p.call.num_heads) * FKDA_HEAD_DIM;
  const int64_t c0 = int64_t(head) * FKDA_HEAD_DIM + 2 * th.pair;
  const float4* weights = reinterpret_cast<const float4*>(p.layer.conv_table) + proj * channels + c0;
  const float4 weight_pair[2] = {__ldg(weights), __ldg(weights + 1)};
  const float2 biases = __ldg(reinterpret_cast<const float2*>(p.layer.conv_table + FKDA_CONV_TABLE_BIAS(channels) +
                                                              proj * channels + c0));
  float y_first[8];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float bias = e ? biases.y : biases.x;
    const float4& w = weight_pair[e];
    const float weight_back[FKDA_CONV_MAX_WIDTH] = {w.x, w.y, w.z, w.w};
    float* history = in.history[e];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const float input = e ? bf16_hi(in.x[r]) : bf16_lo(in.x[r]);
      const float x_back[FKDA_CONV_MAX_WIDTH] = {input, history[0], history[1], history[2]};
      const float y = convolve_rounded(width, bias, weight_back, x_back);
#pragma unroll
      for (int b = FKDA_CONV_MAX_WIDTH - 2; b > 0; --b) history[b] = history[b - 1];
      history[0] = input;
      if (e == 0) y_first[r] = y;
      else x[r] = r < th.rows ? pack_bf16x2(y_first[r], y) : 0u;
    }
  }
}

// The layer step's convolution of q and k (the _conv kernels) around
// load_token_pairs' loads of g: every load of q, k and g is issued before
// the first is used, so that the thread waits for one memory latency, not
// three. The rest of the kernel then runs as on inputs convolved beforehand.
template <bool kGF32>
__device__ __forceinline__ void convolve_and_load_pairs(const FkdaPrefillParams& p, const ChunkTokens& chunk,
                                                        int head, const PrepareThread& th, TokenPairs& pairs) {
  const int64_t position = chunk.t0 + th.first - chunk.seq.begin;
  // Only a sequence's first tokens reach back into its conv state; it reads
  // the state where it reads a recurrent one (initial state or pool).
  ConvRow row{-1, false};
  if (position < p.layer.conv_width - 1) {
    row = conv_row_of(p, p.initial_state != nullptr || p.state_indices.data != nullptr, chunk.n);
  }
  ConvInputs q, k;
  load_conv_inputs(p, 0, chunk, head, th, position, row, q);
  load_conv_inputs(p, 1, chunk, head, th, position, row, k);
  load_token_pairs<kGF32, true>(p, chunk, head, th, pairs);
  convolve_loaded(p, 0, head, th, q, pairs.q);
  convolve_loaded(p, 1, head, th, k, pairs.k);
}

// g of token r, channel 2 pair + e, widened to f32.
template <bool kGF32>
__device__ __forceinline__ float gate_input(const TokenPairs& in, int r, int e) {
  if constexpr (kGF32) return e ? in.g32[r].y : in.g32[r].x;
  else return e ? bf16_hi(in.g[r]) : bf16_lo(in.g[r]);
}

// Step 2's b of the block's threads tid < 16, one token each (0 past the
// chunk's end), into b_of.
__device__ __forceinline__ void store_step_size(const FkdaPrefillParams& p, const ChunkTokens& chunk, int head,
                                                int tid, float* b_of) {
  float b = 0.f;
  if (tid < chunk.len) {
    const int64_t at = chunk.seq.row * p.call.beta.stride_b + int64_t(head) * p.call.beta.stride_h +
                       (chunk.t0 + tid) * p.call.beta.stride_t;
    b = step_size(p.call.gate, load_beta(p.call.gate, p.call.beta.data, at), false);
  }
  b_of[tid] = b;
}

// Step 2's sums of squares of q and k per token, each warp's part of them
// into norm_parts[0 (q), 1 (k)][half][warp of the half][token]; with an
// unbounded gate also q.k (the diagonal of B, which no level holds) into
// norm_parts[2].
template <bool kAnyDecay>
__device__ __forceinline__ void store_norm_parts(const TokenPairs& in, const PrepareThread& th,
                                                 float (*norm_parts)[2][2][8]) {
  const int lane = th.lane;
  float q_sq[8], k_sq[8];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    q_sq[r] = fmaf(bf16_hi(in.q[r]), bf16_hi(in.q[r]), bf16_lo(in.q[r]) * bf16_lo(in.q[r]));
    k_sq[r] = fmaf(bf16_hi(in.k[r]), bf16_hi(in.k[r]), bf16_lo(in.k[r]) * bf16_lo(in.k[r]));
  }
  const float q_part = warp_sum_rows8(q_sq, lane);
  const float k_part = warp_sum_rows8(k_sq, lane);
  if ((lane & 3) == 0) {
    norm_parts[0][th.half][th.warp & 1][(lane >> 2) & 7] = q_part;
    norm_parts[1][th.half][th.warp & 1][(lane >> 2) & 7] = k_part;
  }
  if constexpr (kAnyDecay) {
    float qk[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) qk[r] = fmaf(bf16_hi(in.q[r]), bf16_hi(in.k[r]), bf16_lo(in.q[r]) * bf16_lo(in.k[r]));
    const float qk_part = warp_sum_rows8(qk, lane);
    if ((lane & 3) == 0) norm_parts[2][th.half][th.warp & 1][(lane >> 2) & 7] = qk_part;
  }
}

// Step 1: the gate's base-2 log-decays a2 of the thread's tokens into c;
// with an unbounded gate also the per-token decays d = 2^a2.
template <int32_t kGate, bool kGF32>
__device__ __forceinline__ void gate_log2_decays(const FkdaPrefillParams& p, int head, const PrepareThread& th,
                                                 const TokenPairs& in, float (&c)[8][2], float (&d)[8][2]) {
  constexpr bool kAnyDecay = kGate != FKDA_KERNEL_GATE_BOUNDED;
  const float rate = gate_rate(p.call.A_log, head, false);
  float2 dt = make_float2(0.f, 0.f);
  if (p.call.dt_bias != nullptr) {
    dt = __ldg(reinterpret_cast<const float2*>(p.call.dt_bias + int64_t(head) * FKDA_HEAD_DIM) + th.pair);
  }
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    if constexpr (kAnyDecay) {
      // dt is 0 with LOG_DECAY (validation rejects dt_bias there), so x = g.
      c[r][0] = unbounded_log2_decay_fast<kGate>(gate_input<kGF32>(in, r, 0) + dt.x, rate);
      c[r][1] = unbounded_log2_decay_fast<kGate>(gate_input<kGF32>(in, r, 1) + dt.y, rate);
    } else {
      c[r][0] = p.call.gate_scale * sigmoid_fast(rate * (gate_input<kGF32>(in, r, 0) + dt.x));
      c[r][1] = p.call.gate_scale * sigmoid_fast(rate * (gate_input<kGF32>(in, r, 1) + dt.y));
    }
  }
  // Tokens past the chunk's end (g read as 0) decay nothing. Zeroed apart,
  // in a sequence's last chunk only, rather than tested per element.
  if (th.rows < 8) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      if (r >= th.rows) c[r][0] = c[r][1] = 0.f;
    }
  }
  if constexpr (kAnyDecay) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      d[r][0] = exp2_fast(c[r][0]);
      d[r][1] = exp2_fast(c[r][1]);
    }
  }
}

// Step 1's running sums: c becomes the cumulative log-decay, in token order
// (the second half continues from the first half's total, passed through
// `carry` across a block barrier). The second half returns c_last and
// leaves it in last_sum for the first; the first half returns zeros.
__device__ __forceinline__ float2 cumulative_log2_decays(float (&c)[8][2], const PrepareThread& th, float2* carry,
                                                         float2* last_sum) {
  if (th.half == 0) {
#pragma unroll
    for (int r = 1; r < 8; ++r) {
      c[r][0] += c[r - 1][0];
      c[r][1] += c[r - 1][1];
    }
    carry[th.pair] = make_float2(c[7][0], c[7][1]);
  }
  __syncthreads();

  float2 c_last = make_float2(0.f, 0.f);
  if (th.half == 1) {
    const float2 before = carry[th.pair];
    c[0][0] += before.x;
    c[0][1] += before.y;
#pragma unroll
    for (int r = 1; r < 8; ++r) {
      c[r][0] += c[r - 1][0];
      c[r][1] += c[r - 1][1];
    }
    c_last = make_float2(c[7][0], c[7][1]);
    last_sum[th.pair] = c_last;
  }
  return c_last;
}

// Step 3's decay row, 2^c_last, of the thread's channel pair (by the second
// half, which holds c_last).
__device__ __forceinline__ void write_decay_row(unsigned char* record, int pair, float2 c_last) {
  reinterpret_cast<float2*>(record + FKDA_WS_DECAY_OFFSET)[pair] =
      make_float2(exp2_fast(c_last.x), exp2_fast(c_last.y));
}

// Step 2's inverse norms: lane l finishes one (token l % 8 of this half; q
// for lanes 0-7, k for 8-15) and the others fetch theirs from it by shuffle
// (rq of token first + r from lane r, rk from lane 8 + r). With an unbounded
// gate the first warp of each half also keeps them in inverse_norms, for
// B's diagonal.
template <bool kAnyDecay>
__device__ __forceinline__ float inverse_norm_of(const float (*norm_parts)[2][2][8], float (*inverse_norms)[FKDA_CHUNK],
                                                 const PrepareThread& th) {
  const int which = (th.lane >> 3) & 1, r = th.lane & 7;
  const float inverse_norm =
      1.0f / sqrtf(norm_parts[which][th.half][0][r] + norm_parts[which][th.half][1][r] + 1e-6f);
  if (kAnyDecay && (th.warp & 1) == 0 && th.lane < 16) inverse_norms[which][th.first + r] = inverse_norm;
  return inverse_norm;
}

// Row first + r of a wide tile: the thread's 4 bytes sit in 16-byte piece
// (pair / 4) ^ r (prefill_params.h), at the same offset in Kd, Qd and Kr.
__device__ __forceinline__ int wide_at(const PrepareThread& th, int r) {
  return wide_tile_offset(th.first + r, 2 * th.pair);
}

// Step 3's decayed keys and queries: Kd = f16(k rk 2^c) and Qd = f16(q rq
// scale 2^c) into the record; bounded, also their bf16 forms and Ki_b =
// bf16(k rk 2^-c) into the tiles of step 4. Leaves the normalised keys
// kn = k rk for Kr and the level tiles.
template <bool kAnyDecay>
__device__ __forceinline__ void write_decayed_operands(const FkdaPrefillParams& p, unsigned char* record,
                                                       uint16_t (*tiles)[kBf16TilePitch], const TokenPairs& in,
                                                       const float (&c)[8][2], const float (&d)[8][2],
                                                       float inverse_norm, const PrepareThread& th,
                                                       float (&kn)[8][2]) {
  // Unbounded gates: 2^c as a running product of the per-token decays (each
  // <= 1), one exp2 per half instead of one per element.
  float up_run[2];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int i = th.first + r;
    const float rq = __shfl_sync(0xffffffffu, inverse_norm, r);
    const float rk = __shfl_sync(0xffffffffu, inverse_norm, 8 + r);
    float kd[2], qd[2], ki[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      kn[r][e] = (e ? bf16_hi(in.k[r]) : bf16_lo(in.k[r])) * rk;
      const float qn = (e ? bf16_hi(in.q[r]) : bf16_lo(in.q[r])) * rq;
      float up;
      if constexpr (kAnyDecay) {
        up_run[e] = r == 0 ? exp2_fast(c[0][e]) : up_run[e] * d[r][e];
        up = up_run[e];
      } else {
        up = exp2_fast(c[r][e]);
      }
      kd[e] = kn[r][e] * up;
      qd[e] = qn * p.call.scale * up;
      if constexpr (!kAnyDecay) ki[e] = kn[r][e] * exp2_fast(-c[r][e]);
    }
    unsigned char* at = record + wide_at(th, r);
    *reinterpret_cast<uint32_t*>(at + FKDA_WS_KD_OFFSET) = pack_f16x2(kd[0], kd[1]);
    *reinterpret_cast<uint32_t*>(at + FKDA_WS_QD_OFFSET) = pack_f16x2(qd[0], qd[1]);
    if constexpr (!kAnyDecay) {
      *reinterpret_cast<uint32_t*>(&tiles[i][2 * th.pair]) = pack_bf16x2(kd[0], kd[1]);
      *reinterpret_cast<uint32_t*>(&tiles[16 + i][2 * th.pair]) = pack_bf16x2(ki[0], ki[1]);
      *reinterpret_cast<uint32_t*>(&tiles[32 + i][2 * th.pair]) = pack_bf16x2(qd[0], qd[1]);
    }
  }
}

// Step 3's keys decayed to the chunk's end, Kr = f16(k rk 2^(c_last - c)),
// into the record.
template <bool kAnyDecay>
__device__ __forceinline__ void write_keys_to_chunk_end(unsigned char* record, const float (&kn)[8][2],
                                                        const float (&c)[8][2], const float (&d)[8][2], float2 last,
                                                        const PrepareThread& th) {
  if constexpr (kAnyDecay) {
    // 2^(c_last - c) downward from the half's last token, as a running
    // product of the decays after each token.
    float2 after = make_float2(exp2_fast(last.x - c[7][0]), exp2_fast(last.y - c[7][1]));
#pragma unroll
    for (int r = 7; r >= 0; --r) {
      const uint32_t kr = pack_f16x2(kn[r][0] * after.x, kn[r][1] * after.y);
      *reinterpret_cast<uint32_t*>(record + FKDA_WS_KR_OFFSET + wide_at(th, r)) = kr;
      after.x *= d[r][0];
      after.y *= d[r][1];
    }
  } else {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const uint32_t kr =
          pack_f16x2(kn[r][0] * exp2_fast(last.x - c[r][0]), kn[r][1] * exp2_fast(last.y - c[r][1]));
      *reinterpret_cast<uint32_t*>(record + FKDA_WS_KR_OFFSET + wide_at(th, r)) = kr;
    }
  }
}

// "Any decay" step 3: level l's tile (rows [24 l, 24 l + 24)): rows 0-7
// hold f16(kn rho) and rows 8-15 f16(qn rho) of the level's right tokens,
// rows 16-23 f16(kn lambda) of its left tokens, each in token order. One
// m16n8 product of the two parts gives the level's pairs of A (rows 0-7)
// and of B (rows 8-15) at once.
template <int l>
__device__ __forceinline__ void write_level_tile(uint16_t (*tiles)[kBf16TilePitch], const TokenPairs& in,
                                                 const float (&kn)[8][2], const float (&d)[8][2],
                                                 float inverse_norm, const PrepareThread& th) {
  constexpr int side = 1 << l;  // tokens per side of a block
  float f0[8], f1[8], d0[8], d1[8];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    d0[r] = d[r][0];
    d1[r] = d[r][1];
  }
  level_factors<l>(d0, th.half, f0);
  level_factors<l>(d1, th.half, f1);
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    // Block and position of token first + r at this level (first is a multiple of 8).
    const int block = l == 3 ? 0 : th.half * (4 >> l) + (r >> (l + 1));
    const int position = l == 3 ? th.first + r : (r & (2 * side - 1));
    if (is_right<l>(r, th.half)) {
      const int at = 24 * l + block * side + position - side;
      // q * rq again (as in Kd, Qd above) rather than kept: registers are short.
      const float rq = __shfl_sync(0xffffffffu, inverse_norm, r);
      *reinterpret_cast<uint32_t*>(&tiles[at][2 * th.pair]) = pack_f16x2(kn[r][0] * f0[r], kn[r][1] * f1[r]);
      *reinterpret_cast<uint32_t*>(&tiles[at + 8][2 * th.pair]) =
          pack_f16x2(bf16_lo(in.q[r]) * rq * f0[r], bf16_hi(in.q[r]) * rq * f1[r]);
    } else {
      const int at = 24 * l + 16 + block * side + position;
      *reinterpret_cast<uint32_t*>(&tiles[at][2 * th.pair]) = pack_f16x2(kn[r][0] * f0[r], kn[r][1] * f1[r]);
    }
  }
}

// "Any decay" step 4: warp w forms level w's pairs of A and B (B scaled)
// into `pairs`; warp 0 also B's diagonal, scale rq rk q.k, which no level
// holds.
__device__ __forceinline__ void level_pair_products(const uint16_t (*tiles)[kBf16TilePitch],
                                                    float (*pairs)[FKDA_CHUNK][FKDA_CHUNK + 1],
                                                    const float (*norm_parts)[2][2][8],
                                                    const float (*inverse_norms)[FKDA_CHUNK],
                                                    const FkdaPrefillParams& p, const PrepareThread& th) {
  const int lane = th.lane, g = th.g, t = th.t;
  const int l = th.warp, side = 1 << l;
  float level_acc[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t a_base = smem_address(&tiles[24 * l + ((lane >> 3) & 1) * 8 + (lane & 7)][(lane >> 4) * 8]);
  const uint32_t b_base = smem_address(&tiles[24 * l + 16 + (lane & 7)][(lane >> 3) * 8]);
#pragma unroll
  for (int step2 = 0; step2 < 4; ++step2) {
    uint32_t b[4];
    ldmatrix_x4(b, b_base + step2 * 64);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, a_base + (step2 * 2 + kk) * 32);
      mma_f16(level_acc, a, b[2 * kk], b[2 * kk + 1]);
    }
  }
  // Right token g, left tokens 2t and 2t + 1 (indices among the level's
  // sides): a pair where both lie in one block of the level.
  const int right = (g / side) * 2 * side + side + g % side;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int c = 2 * t + e;
    if (c / side != g / side) continue;
    const int left = (c / side) * 2 * side + c % side;
    pairs[0][right][left] = level_acc[e];
    pairs[1][right][left] = p.call.scale * level_acc[2 + e];
  }
  if (th.warp == 0 && lane < FKDA_CHUNK) {
    const float qk = norm_parts[2][lane >> 3][0][lane & 7] + norm_parts[2][lane >> 3][1][lane & 7];
    pairs[1][lane][lane] = p.call.scale * inverse_norms[0][lane] * inverse_norms[1][lane] * qk;
  }
}

// "Any decay" step 4's Mqk = f16(B) on and below the diagonal, by the
// threads tid < 64.
__device__ __forceinline__ void write_mqk_from_pairs(unsigned char* record,
                                                     const float (*pairs)[FKDA_CHUNK][FKDA_CHUNK + 1], int tid) {
  for (int q = tid; q < FKDA_CHUNK * FKDA_CHUNK / 2; q += 64) {
    const int row = q >> 3, col = 2 * (q & 7);
    const uint32_t mqk = pack_f16x2(col <= row ? pairs[1][row][col] : 0.f, col + 1 <= row ? pairs[1][row][col + 1] : 0.f);
    *reinterpret_cast<uint32_t*>(record + FKDA_WS_MQK_OFFSET + small_tile_offset(row, col)) = mqk;
  }
}

// "Any decay": A from `pairs` in the accumulator layout (WarpTile's), for
// the inverse.
__device__ __forceinline__ void a_from_pairs(const float (*pairs)[FKDA_CHUNK][FKDA_CHUNK + 1], const PrepareThread& th,
                                             float (&acc)[2][4]) {
  const int g = th.g, t = th.t;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = pairs[0][g + 8 * (e >> 1)][8 * j + 2 * t + (e & 1)];
}

// Bounded step 4, in the warps of the second half: A = Kd_b Ki_b^T in the
// inverse's warp (2), B = Qd_b Ki_b^T in the other (3), one code for both.
__device__ __forceinline__ void bounded_chunk_products(const uint16_t (*tiles)[kBf16TilePitch], bool inverse_warp,
                                                       int lane, float (&acc)[2][4]) {
  const uint32_t a_base =
      smem_address(&tiles[(inverse_warp ? 0 : 32) + ((lane >> 3) & 1) * 8 + (lane & 7)][(lane >> 4) * 8]);
  const uint32_t b_base = smem_address(&tiles[16 + (lane & 7)][(lane >> 3) * 8]);
  constexpr uint32_t kSecondEight = 8 * kBf16TilePitch * 2;  // bytes to Ki_b's rows 8-15
#pragma unroll
  for (int step2 = 0; step2 < 4; ++step2) {
    uint32_t b0[4], b1[4];
    ldmatrix_x4(b0, b_base + step2 * 64);
    ldmatrix_x4(b1, b_base + kSecondEight + step2 * 64);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, a_base + (step2 * 2 + kk) * 32);
      mma_bf16(acc[0], a, b0[2 * kk], b0[2 * kk + 1]);
      mma_bf16(acc[1], a, b1[2 * kk], b1[2 * kk + 1]);
    }
  }
}

// Bounded step 4's Mqk = f16(B) on and below the diagonal, from the
// accumulators of one warp.
__device__ __forceinline__ void write_mqk(unsigned char* record, const float (&acc)[2][4], const PrepareThread& th) {
  const int g = th.g, t = th.t;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = 8 * j + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = g + 8 * h;
      const uint32_t mqk = pack_f16x2(col <= row ? acc[j][2 * h] : 0.f, col + 1 <= row ? acc[j][2 * h + 1] : 0.f);
      *reinterpret_cast<uint32_t*>(record + FKDA_WS_MQK_OFFSET + small_tile_offset(row, col)) = mqk;
    }
  }
}

// Step 5's L (row i scaled by b[i], strictly lower) from A's accumulators,
// and L^T from A's columns, read back through shared memory (a_tile), in
// one warp.
__device__ __forceinline__ void strict_lower_and_transpose(const float (&acc)[2][4],
                                                           float (*a_tile)[kTransposePitch], const float* b_of,
                                                           const PrepareThread& th, WarpTile& L, WarpTile& LT) {
  const int g = th.g, t = th.t;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    *reinterpret_cast<float2*>(&a_tile[g][8 * j + 2 * t]) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(&a_tile[g + 8][8 * j + 2 * t]) = make_float2(acc[j][2], acc[j][3]);
  }
  __syncwarp();
  const float b_g = b_of[g], b_g8 = b_of[g + 8];
  const float2 b_c0 = *reinterpret_cast<const float2*>(&b_of[2 * t]);      // b of columns 2t, 2t + 1
  const float2 b_c1 = *reinterpret_cast<const float2*>(&b_of[8 + 2 * t]);  // and 8 + 2t, 9 + 2t
  L.m[0][0] = 2 * t < g ? b_g * acc[0][0] : 0.f;
  L.m[0][1] = 2 * t + 1 < g ? b_g * acc[0][1] : 0.f;
  L.m[0][2] = b_g8 * acc[0][2];
  L.m[0][3] = b_g8 * acc[0][3];
  L.m[1][0] = 0.f;
  L.m[1][1] = 0.f;
  L.m[1][2] = 2 * t < g ? b_g8 * acc[1][2] : 0.f;
  L.m[1][3] = 2 * t + 1 < g ? b_g8 * acc[1][3] : 0.f;
  // L^T[r][col] = L[col][r] = b[col] A[col][r] for r < col: the same
  // products as L's, so L^T is exactly L's transpose.
  LT.m[0][0] = g < 2 * t ? b_c0.x * a_tile[2 * t][g] : 0.f;
  LT.m[0][1] = g < 2 * t + 1 ? b_c0.y * a_tile[2 * t + 1][g] : 0.f;
  LT.m[0][2] = 0.f;
  LT.m[0][3] = 0.f;
  LT.m[1][0] = b_c1.x * a_tile[8 + 2 * t][g];
  LT.m[1][1] = b_c1.y * a_tile[9 + 2 * t][g];
  LT.m[1][2] = g < 2 * t ? b_c1.x * a_tile[8 + 2 * t][g + 8] : 0.f;
  LT.m[1][3] = g < 2 * t + 1 ? b_c1.y * a_tile[9 + 2 * t][g + 8] : 0.f;
}

// Step 5's W = f16(INV diag(b)) into the record, from -INV, in one warp. b
// and the record's address are fetched again rather than kept: the inverse
// needs every register it can get.
__device__ __forceinline__ void write_w(const FkdaPrefillParams& p, const WarpTile& minus_inv, const float* b_of,
                                        const PrepareThread& th) {
  const int g = th.g, t = th.t;
  __syncwarp();
  unsigned char* w_tile = record_of(p, blockIdx.x, blockIdx.y) + FKDA_WS_W_OFFSET;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = 8 * j + 2 * t;
    const float2 b = *reinterpret_cast<const float2*>(&b_of[col]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t w = pack_f16x2(minus_inv.m[j][2 * h] * -b.x, minus_inv.m[j][2 * h + 1] * -b.y);
      *reinterpret_cast<uint32_t*>(w_tile + small_tile_offset(g + 8 * h, col)) = w;
    }
  }
}

}  // namespace fkda_dev

// The preparation kernel's body for the gate form kGate (FKDA_KERNEL_GATE_*):
// an unbounded gate (SOFTPLUS or LOG_DECAY) takes the chunk products of the
// levels above, the bounded gate the 2^(+-c) factors. kGF32: g is f32
// (LOG_DECAY only), else bf16. kConv: q and k are the raw projections of the
// layer step's convolution. Steps 1-3 run in every thread; steps 4 and 5 by
// warp role, at the end.
template <int32_t kGate, bool kGF32, bool kConv>
__device__ __forceinline__ void prepare_chunks(const FkdaPrefillParams& p) {
  using namespace fkda_dev;
  constexpr bool kAnyDecay = kGate != FKDA_KERNEL_GATE_BOUNDED;
  static_assert(!kGF32 || kGate == FKDA_KERNEL_GATE_LOG_DECAY, "g is f32 only under LOG_DECAY");
  // Rows of 128 16-bit values. Bounded: Kd_b, Ki_b, Qd_b (bf16), 16 rows
  // each. Any decay: the level tiles (f16), 24 rows a level.
  constexpr int kTileRows = kAnyDecay ? 24 * kLevels : 3 * FKDA_CHUNK;
  __shared__ __align__(16) uint16_t tiles[kTileRows][kBf16TilePitch];
  __shared__ __align__(16) float a_tile[FKDA_CHUNK][kTransposePitch];     // A, read back transposed
  __shared__ float2 carry[64];                                            // c after token 7
  __shared__ float2 last_sum[64];                                         // c_last
  // [q, k, q.k][token half][warp of the half][token]
  __shared__ float norm_parts[kAnyDecay ? 3 : 2][2][2][8];
  __shared__ float inverse_norms[2][FKDA_CHUNK];  // [rq, rk][token], any decay only
  // Any decay: A and B as the levels form them (padded rows).
  __shared__ float pairs[kAnyDecay ? 2 : 1][FKDA_CHUNK][FKDA_CHUNK + 1];
  __shared__ __align__(8) float b_of[FKDA_CHUNK];

  // One block per slot of the window.
  const int head = blockIdx.y;
  ChunkTokens chunk;
  if (!locate_chunk(p, p.window_first + blockIdx.x, chunk)) return;  // a slot between sequences
  PrepareThread th = prepare_thread(threadIdx.x, chunk.len);
  unsigned char* record = record_of(p, blockIdx.x, head);

  // ---- steps 1, 2: loads, beta, norm partial sums, gate --------------------
  TokenPairs in;
  if constexpr (kConv) {
    convolve_and_load_pairs<kGF32>(p, chunk, head, th, in);
  } else {
    load_token_pairs<kGF32, false>(p, chunk, head, th, in);
  }
  if (th.tid < FKDA_CHUNK) store_step_size(p, chunk, head, th.tid, b_of);
  store_norm_parts<kAnyDecay>(in, th, norm_parts);
  float c[8][2];  // a2, then its running sum
  float d[8][2];  // any decay: the per-token decays 2^a2
  gate_log2_decays<kGate, kGF32>(p, head, th, in, c, d);
  const float2 c_last = cumulative_log2_decays(c, th, carry, last_sum);  // a block barrier
  if (th.half == 1) write_decay_row(record, th.pair, c_last);

  // ---- step 3: operands ----------------------------------------------------
  const float inverse_norm = inverse_norm_of<kAnyDecay>(norm_parts, inverse_norms, th);
  float kn[8][2];
  write_decayed_operands<kAnyDecay>(p, record, tiles, in, c, d, inverse_norm, th, kn);
  // The mma fragment places of steps 4 and 5, set here rather than in
  // prepare_thread: set there, the bounded kernel's sm_90a code is scheduled
  // differently (as measured with CUDA 13.0).
  th.g = th.lane >> 2;
  th.t = th.lane & 3;
  // The first half learns c_last only at the barrier.
  if (th.half == 1) write_keys_to_chunk_end<kAnyDecay>(record, kn, c, d, c_last, th);
  __syncthreads();
  if (th.half == 0) write_keys_to_chunk_end<kAnyDecay>(record, kn, c, d, last_sum[th.pair], th);
  if constexpr (kAnyDecay) {
    write_level_tile<0>(tiles, in, kn, d, inverse_norm, th);
    write_level_tile<1>(tiles, in, kn, d, inverse_norm, th);
    write_level_tile<2>(tiles, in, kn, d, inverse_norm, th);
    write_level_tile<3>(tiles, in, kn, d, inverse_norm, th);
    // After Kr, so that the running sums are no longer live beside the factors.
    __syncthreads();
  }

  // ---- steps 4, 5 by warp role ---------------------------------------------
  // Any decay: every warp forms its level's pairs of A and B, then warps 0
  // and 1 write Mqk and warp 2 the inverse. Bounded: the first half's warps
  // are done; warp 3 forms B and Mqk, warp 2 A and the inverse.
  // The inverse's three calls stay at this level in both branches: wrapped
  // in one more function they compile to another register allocation, which
  // spills in the bounded kernel on sm_90a.
  const bool inverse_warp = th.warp == 2;
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // A or B, as accumulators
  if constexpr (kAnyDecay) {
    level_pair_products(tiles, pairs, norm_parts, inverse_norms, p, th);
    __syncthreads();
    if (th.warp < 2) write_mqk_from_pairs(record, pairs, th.tid);
    if (inverse_warp) {
      a_from_pairs(pairs, th, acc);
      WarpTile L, LT;
      strict_lower_and_transpose(acc, a_tile, b_of, th, L, LT);
      write_w(p, negated_unit_lower_inverse(L, LT, th.lane), b_of, th);
    }
  } else if (th.half != 0) {
    bounded_chunk_products(tiles, inverse_warp, th.lane, acc);
    if (!inverse_warp) {
      write_mqk(record, acc, th);
    } else {
      WarpTile L, LT;
      strict_lower_and_transpose(acc, a_tile, b_of, th, L, LT);
      write_w(p, negated_unit_lower_inverse(L, LT, th.lane), b_of, th);
    }
  }
}

// One kernel per gate form and g dtype (LOG_DECAY takes g in bf16 or f32,
// the others bf16), each in two forms, plain and with the layer step's
// convolution (_conv), each compiled for its resident blocks (above).
#define FKDA_DEFINE_PREPARE(name, blocks, conv_blocks, gate, g_f32)                  \
  extern "C" __global__ void __launch_bounds__(FKDA_PREPARE_THREADS, blocks)        \
      name(const FkdaPrefillParams p) {                                             \
    prepare_chunks<gate, g_f32, false>(p);                                          \
  }                                                                                 \
  extern "C" __global__ void __launch_bounds__(FKDA_PREPARE_THREADS, conv_blocks)   \
      name##_conv(const FkdaPrefillParams p) {                                      \
    prepare_chunks<gate, g_f32, true>(p);                                           \
  }
FKDA_DEFINE_PREPARE(fkda_prefill_prepare_chunks, FKDA_PREPARE_BLOCKS_COMPILED, FKDA_PREPARE_CONV_BLOCKS_COMPILED,
                    FKDA_KERNEL_GATE_BOUNDED, false)
FKDA_DEFINE_PREPARE(fkda_prefill_prepare_chunks_softplus, FKDA_PREPARE_ANY_DECAY_BLOCKS,
                    FKDA_PREPARE_ANY_DECAY_BLOCKS, FKDA_KERNEL_GATE_SOFTPLUS, false)
FKDA_DEFINE_PREPARE(fkda_prefill_prepare_chunks_log_decay, FKDA_PREPARE_ANY_DECAY_BLOCKS,
                    FKDA_PREPARE_ANY_DECAY_BLOCKS, FKDA_KERNEL_GATE_LOG_DECAY, false)
FKDA_DEFINE_PREPARE(fkda_prefill_prepare_chunks_log_decay_f32_gate, FKDA_PREPARE_ANY_DECAY_BLOCKS,
                    FKDA_PREPARE_ANY_DECAY_BLOCKS, FKDA_KERNEL_GATE_LOG_DECAY, true)
#undef FKDA_DEFINE_PREPARE
