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
// One block of 128 threads per (slot, head). Thread t owns the channel pair
// 2 (t % 64), +1 for the 8 tokens 8 (t / 64) .. +7: every global access of a
// warp is one contiguous 128-byte row segment, and the running sum along the
// tokens stays in registers (the second half of the tokens continues from the
// first half's total, so the sum keeps its token order). The 16x16 products
// run on the tensor cores (bf16 in, f32 out); the inverse is one warp's work.
#pragma once

#include "kda_device.cuh"

namespace fkda_dev {

constexpr int kBf16TilePitch = 136;  // elements: 128 + 8, rows 272 bytes apart
constexpr int kSmallPitch = 20;      // floats: 16 + 4, keeps 16-byte rows off each other's banks

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

// Rows 2R, 2R + 1 and columns 4C .. 4C + 3 (R = lane / 4, C = lane % 4) of
// X * Y for 16x16 f32 matrices with rows kSmallPitch floats apart.
__device__ __forceinline__ void block_product(const float* X, const float* Y, int lane, float (&out)[2][4]) {
  const int r0 = (lane >> 2) * 2, c0 = (lane & 3) * 4;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) out[a][b] = 0.f;
#pragma unroll
  for (int k4 = 0; k4 < 4; ++k4) {
    const float4 x0 = *reinterpret_cast<const float4*>(X + r0 * kSmallPitch + 4 * k4);
    const float4 x1 = *reinterpret_cast<const float4*>(X + (r0 + 1) * kSmallPitch + 4 * k4);
    const float xs[2][4] = {{x0.x, x0.y, x0.z, x0.w}, {x1.x, x1.y, x1.z, x1.w}};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const float4 y = *reinterpret_cast<const float4*>(Y + (4 * k4 + kk) * kSmallPitch + c0);
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        out[a][0] = fmaf(xs[a][kk], y.x, out[a][0]);
        out[a][1] = fmaf(xs[a][kk], y.y, out[a][1]);
        out[a][2] = fmaf(xs[a][kk], y.z, out[a][2]);
        out[a][3] = fmaf(xs[a][kk], y.w, out[a][3]);
      }
    }
  }
}

__device__ __forceinline__ void store_block(float* M, int lane, const float (&v)[2][4]) {
  const int r0 = (lane >> 2) * 2, c0 = (lane & 3) * 4;
#pragma unroll
  for (int a = 0; a < 2; ++a)
    *reinterpret_cast<float4*>(M + (r0 + a) * kSmallPitch + c0) = make_float4(v[a][0], v[a][1], v[a][2], v[a][3]);
}

__device__ __forceinline__ float4 load_row4(const float* M, int row, int col) {
  return *reinterpret_cast<const float4*>(M + row * kSmallPitch + col);
}

}  // namespace fkda_dev

extern "C" __global__ void __launch_bounds__(FKDA_PREPARE_THREADS)
    fkda_prefill_prepare_chunks(const FkdaPrefillParams p) {
  using namespace fkda_dev;
  // Kd_b, Ki_b, Qd_b for the products; afterwards the inverse's work matrices.
  __shared__ __align__(16) uint16_t tiles[3][FKDA_CHUNK][kBf16TilePitch];
  __shared__ __align__(16) float products[2][FKDA_CHUNK][FKDA_CHUNK];  // A, B
  __shared__ float2 carry[64];                                          // c after token 7
  __shared__ float2 last_sum[64];                                       // c_last
  __shared__ float norm_parts[2][2][2][8];  // [q, k][token half][warp of the half][token]
  __shared__ float b_of[FKDA_CHUNK];

  const int64_t slot = blockIdx.x;
  const int head = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // The owner of this slot: the last sequence whose slots start at or before it.
  int64_t lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (slot_base_of(p, mid) <= slot) lo = mid; else hi = mid - 1;
  }
  const Sequence seq = sequence_of(p, lo);
  const int64_t chunk = slot - seq.slot_base;
  if (chunk < 0 || chunk >= num_chunks(seq)) return;  // a slot between sequences
  const int64_t t0 = seq.begin + chunk * FKDA_CHUNK;
  const int len = int(seq.end - t0 < FKDA_CHUNK ? seq.end - t0 : FKDA_CHUNK);
  unsigned char* record = record_of(p, slot, head);

  const int pair = tid & 63;  // channels 2 pair, 2 pair + 1
  const int half = tid >> 6;  // tokens 8 half .. 8 half + 7
  const int first = 8 * half;
  auto row_of = [&](const FkdaActivation& a) {
    return static_cast<const uint16_t*>(a.data) + seq.row * a.stride_b + int64_t(head) * a.stride_h;
  };

  // ---- step 1, 2: loads, gate, norm partial sums, beta ----------------------
  uint32_t qv[8], kv[8], gv[8];
  {
    const uint16_t* q = row_of(p.q) + 2 * pair;
    const uint16_t* k = row_of(p.k) + 2 * pair;
    const uint16_t* g = row_of(p.g) + 2 * pair;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      qv[r] = kv[r] = gv[r] = 0u;
      if (first + r < len) {
        const int64_t tok = t0 + first + r;
        qv[r] = __ldg(reinterpret_cast<const unsigned int*>(q + tok * p.q.stride_t));
        kv[r] = __ldg(reinterpret_cast<const unsigned int*>(k + tok * p.k.stride_t));
        gv[r] = __ldg(reinterpret_cast<const unsigned int*>(g + tok * p.g.stride_t));
      }
    }
  }
  if (tid < FKDA_CHUNK) {
    float b = 0.f;
    if (tid < len) b = sigmoid(bf16_bits(*(row_of(p.beta) + (t0 + tid) * p.beta.stride_t)));
    b_of[tid] = b;
  }
  {
    float q_sq[8], k_sq[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      q_sq[r] = fmaf(bf16_hi(qv[r]), bf16_hi(qv[r]), bf16_lo(qv[r]) * bf16_lo(qv[r]));
      k_sq[r] = fmaf(bf16_hi(kv[r]), bf16_hi(kv[r]), bf16_lo(kv[r]) * bf16_lo(kv[r]));
    }
    const float q_part = warp_sum_rows8(q_sq, lane);
    const float k_part = warp_sum_rows8(k_sq, lane);
    if ((lane & 3) == 0) {
      norm_parts[0][half][warp & 1][(lane >> 2) & 7] = q_part;
      norm_parts[1][half][warp & 1][(lane >> 2) & 7] = k_part;
    }
  }
  float c[8][2];  // a2, then its running sum
  {
    const float decay_rate = exp2_fast(__ldg(p.A_log + head) * kLog2e);  // exp(A_log[h])
    const float2 dt = __ldg(reinterpret_cast<const float2*>(p.dt_bias + int64_t(head) * FKDA_HEAD_DIM) + pair);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const bool valid = first + r < len;
      c[r][0] = valid ? p.gate_scale * sigmoid(decay_rate * (bf16_lo(gv[r]) + dt.x)) : 0.f;
      c[r][1] = valid ? p.gate_scale * sigmoid(decay_rate * (bf16_hi(gv[r]) + dt.y)) : 0.f;
    }
  }
  if (half == 0) {
#pragma unroll
    for (int r = 1; r < 8; ++r) {
      c[r][0] += c[r - 1][0];
      c[r][1] += c[r - 1][1];
    }
    carry[pair] = make_float2(c[7][0], c[7][1]);
  }
  __syncthreads();

  float2 c_last = make_float2(0.f, 0.f);
  if (half == 1) {
    const float2 before = carry[pair];
    c[0][0] += before.x;
    c[0][1] += before.y;
#pragma unroll
    for (int r = 1; r < 8; ++r) {
      c[r][0] += c[r - 1][0];
      c[r][1] += c[r - 1][1];
    }
    c_last = make_float2(c[7][0], c[7][1]);
    last_sum[pair] = c_last;
    reinterpret_cast<float2*>(record + FKDA_WS_DECAY_OFFSET)[pair] =
        make_float2(exp2_fast(c_last.x), exp2_fast(c_last.y));
  }

  // ---- step 3: operands ----------------------------------------------------
  // Lane l finishes one inverse norm (token l % 8 of this half; q for lanes
  // 0-7, k for 8-15) and the others fetch theirs by shuffle.
  float inverse_norm;
  {
    const int which = (lane >> 3) & 1, r = lane & 7;
    inverse_norm = 1.0f / sqrtf(norm_parts[which][half][0][r] + norm_parts[which][half][1][r] + 1e-6f);
  }
  float kn[8][2];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int i = first + r;
    const float rq = __shfl_sync(0xffffffffu, inverse_norm, r);
    const float rk = __shfl_sync(0xffffffffu, inverse_norm, 8 + r);
    float kd[2], qd[2], ki[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      kn[r][e] = (e ? bf16_hi(kv[r]) : bf16_lo(kv[r])) * rk;
      const float qn = (e ? bf16_hi(qv[r]) : bf16_lo(qv[r])) * rq * p.scale;
      const float up = exp2_fast(c[r][e]);
      kd[e] = kn[r][e] * up;
      qd[e] = qn * up;
      ki[e] = kn[r][e] * exp2_fast(-c[r][e]);
    }
    const int at = wide_tile_offset(i, 2 * pair);
    *reinterpret_cast<uint32_t*>(record + FKDA_WS_KD_OFFSET + at) = pack_f16x2(kd[0], kd[1]);
    *reinterpret_cast<uint32_t*>(record + FKDA_WS_QD_OFFSET + at) = pack_f16x2(qd[0], qd[1]);
    *reinterpret_cast<uint32_t*>(&tiles[0][i][2 * pair]) = pack_bf16x2(kd[0], kd[1]);
    *reinterpret_cast<uint32_t*>(&tiles[1][i][2 * pair]) = pack_bf16x2(ki[0], ki[1]);
    *reinterpret_cast<uint32_t*>(&tiles[2][i][2 * pair]) = pack_bf16x2(qd[0], qd[1]);
  }
  __syncthreads();
  if (half == 0) c_last = last_sum[pair];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const uint32_t kr = pack_f16x2(kn[r][0] * exp2_fast(c_last.x - c[r][0]), kn[r][1] * exp2_fast(c_last.y - c[r][1]));
    *reinterpret_cast<uint32_t*>(record + FKDA_WS_KR_OFFSET + wide_tile_offset(first + r, 2 * pair)) = kr;
  }

  // ---- step 4: A = Kd_b Ki_b^T (warps 0, 1) and B = Qd_b Ki_b^T (warps 2, 3),
  // one 8-column half of the 16x16 result a warp.
  {
    const int which = warp >> 1, part = warp & 1;
    const uint32_t a_base =
        smem_address(&tiles[which ? 2 : 0][((lane >> 3) & 1) * 8 + (lane & 7)][(lane >> 4) * 8]);
    const uint32_t b_base = smem_address(&tiles[1][part * 8 + (lane & 7)][(lane >> 3) * 8]);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int step2 = 0; step2 < 4; ++step2) {
      uint32_t b[4];
      ldmatrix_x4(b, b_base + step2 * 64);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, a_base + (step2 * 2 + kk) * 32);
        mma_bf16(acc, a, b[2 * kk], b[2 * kk + 1]);
      }
    }
    const int g = lane >> 2, t = lane & 3;
    const int j = part * 8 + 2 * t;
    products[which][g][j] = acc[0];
    products[which][g][j + 1] = acc[1];
    products[which][g + 8][j] = acc[2];
    products[which][g + 8][j + 1] = acc[3];
  }
  __syncthreads();

  // ---- Mqk (every thread two entries) ----------------------------------------
  {
    const int r = tid >> 3, j0 = (tid & 7) * 2;
    const uint32_t mqk = pack_f16x2(j0 <= r ? products[1][r][j0] : 0.f, j0 + 1 <= r ? products[1][r][j0 + 1] : 0.f);
    *reinterpret_cast<uint32_t*>(record + FKDA_WS_MQK_OFFSET + small_tile_offset(r, j0)) = mqk;
  }
  if (warp != 0) return;

  // ---- step 5: INV by the product form, in warp 0 (the tiles are free now) --
  float* L = reinterpret_cast<float*>(&tiles[0][0][0]);
  float* L2 = L + FKDA_CHUNK * kSmallPitch;
  float* L4 = L2 + FKDA_CHUNK * kSmallPitch;
  float* L8 = L4 + FKDA_CHUNK * kSmallPitch;
  float* P1 = L8 + FKDA_CHUNK * kSmallPitch;
  float* P2 = P1 + FKDA_CHUNK * kSmallPitch;
  const int r0 = (lane >> 2) * 2, c0 = (lane & 3) * 4;
  {
    float l[2][4];
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const int i = r0 + a;
#pragma unroll
      for (int b = 0; b < 4; ++b) l[a][b] = c0 + b < i ? b_of[i] * products[0][i][c0 + b] : 0.f;
    }
    store_block(L, lane, l);
  }
  __syncwarp();
  float x[2][4], y[2][4];
  block_product(L, L, lane, x);
  store_block(L2, lane, x);
  __syncwarp();
  // L4 = L2 L2 and P1 = (I - L)(I + L2) = I - L + L2 - L L2.
  block_product(L2, L2, lane, x);
  block_product(L, L2, lane, y);
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const float4 l = load_row4(L, r0 + a, c0), l2 = load_row4(L2, r0 + a, c0);
    const float ls[4] = {l.x, l.y, l.z, l.w}, l2s[4] = {l2.x, l2.y, l2.z, l2.w};
#pragma unroll
    for (int b = 0; b < 4; ++b) y[a][b] = float(r0 + a == c0 + b) - ls[b] + l2s[b] - y[a][b];
  }
  store_block(L4, lane, x);
  store_block(P1, lane, y);
  __syncwarp();
  // L8 = L4 L4 and P2 = P1 (I + L4).
  block_product(L4, L4, lane, x);
  block_product(P1, L4, lane, y);
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const float4 p1 = load_row4(P1, r0 + a, c0);
    y[a][0] += p1.x;
    y[a][1] += p1.y;
    y[a][2] += p1.z;
    y[a][3] += p1.w;
  }
  store_block(L8, lane, x);
  store_block(P2, lane, y);
  __syncwarp();
  // INV = P2 (I + L8); W = f16(INV diag(b)).
  block_product(P2, L8, lane, x);
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const int i = r0 + a;
    const float4 p2 = load_row4(P2, i, c0);
    const float inv[4] = {p2.x + x[a][0], p2.y + x[a][1], p2.z + x[a][2], p2.w + x[a][3]};
    const uint2 w = make_uint2(pack_f16x2(inv[0] * b_of[c0], inv[1] * b_of[c0 + 1]),
                               pack_f16x2(inv[2] * b_of[c0 + 2], inv[3] * b_of[c0 + 3]));
    *reinterpret_cast<uint2*>(record + FKDA_WS_W_OFFSET + small_tile_offset(i, c0)) = w;
  }
}
