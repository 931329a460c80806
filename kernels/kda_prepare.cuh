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
// One block of 128 threads per (slot, head). Thread t first owns token t / 8
// and the 16 channels 16 (t % 8) .. +15 (16-byte loads, the norm reduced over
// 8 lanes), then channel t for the cumulative sum along the tokens.
#pragma once

#include "kda_device.cuh"

namespace fkda_dev {

constexpr int kBf16TilePitch = 136;  // elements: 128 + 8, rows 272 bytes apart

// out[i][j0], out[i][j0 + 1] of X * Y for 16x16 f32 row-major matrices.
__device__ __forceinline__ void product_pair(const float* X, const float* Y, int i, int j0, float& r0,
                                             float& r1) {
  r0 = 0.f;
  r1 = 0.f;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const float x = X[i * 16 + k];
    r0 = fmaf(x, Y[k * 16 + j0], r0);
    r1 = fmaf(x, Y[k * 16 + j0 + 1], r1);
  }
}

__device__ __forceinline__ void load_row16(const uint16_t* src, bool valid, uint32_t (&w)[8]) {
  if (valid) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(src));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(src) + 1);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
  } else {
#pragma unroll
    for (int x = 0; x < 8; ++x) w[x] = 0u;
  }
}

}  // namespace fkda_dev

extern "C" __global__ void __launch_bounds__(FKDA_PREPARE_THREADS)
    fkda_prefill_prepare_chunks(const FkdaPrefillParams p) {
  using namespace fkda_dev;
  __shared__ float cumulative[16][128];  // a2, then its running sum c
  __shared__ __align__(16) uint16_t kd_b[16][kBf16TilePitch];
  __shared__ __align__(16) uint16_t ki_b[16][kBf16TilePitch];
  __shared__ __align__(16) uint16_t qd_b[16][kBf16TilePitch];
  __shared__ __align__(16) float products[2][16][16];  // A, B
  __shared__ __align__(16) float L[16][16], L2[16][16], L4[16][16], L8[16][16];
  __shared__ __align__(16) float P1[16][16], P2[16][16];
  __shared__ float b_of[16];

  const int64_t slot = blockIdx.x;
  const int head = blockIdx.y;
  const int tid = threadIdx.x;

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

  // ---- step 1, 2: gate, norms, beta -------------------------------------
  const int i = tid >> 3;        // token
  const int k0 = (tid & 7) * 16; // first of this thread's 16 channels
  const bool valid = i < len;
  const int64_t tok = t0 + (valid ? i : 0);
  auto element = [&](const FkdaActivation& a) {
    return static_cast<const uint16_t*>(a.data) + seq.row * a.stride_b + tok * a.stride_t +
           int64_t(head) * a.stride_h;
  };
  uint32_t qw[8], kw[8], gw[8];
  load_row16(element(p.q) + k0, valid, qw);
  load_row16(element(p.k) + k0, valid, kw);
  load_row16(element(p.g) + k0, valid, gw);

  float q_sq = 0.f, k_sq = 0.f;
#pragma unroll
  for (int x = 0; x < 8; ++x) {
    const float qa = bf16_lo(qw[x]), qb = bf16_hi(qw[x]);
    const float ka = bf16_lo(kw[x]), kb = bf16_hi(kw[x]);
    q_sq = fmaf(qa, qa, q_sq);
    q_sq = fmaf(qb, qb, q_sq);
    k_sq = fmaf(ka, ka, k_sq);
    k_sq = fmaf(kb, kb, k_sq);
  }
#pragma unroll
  for (int offset = 1; offset < 8; offset <<= 1) {
    q_sq += __shfl_xor_sync(0xffffffffu, q_sq, offset);
    k_sq += __shfl_xor_sync(0xffffffffu, k_sq, offset);
  }
  const float rq = 1.0f / sqrtf(q_sq + 1e-6f);
  const float rk = 1.0f / sqrtf(k_sq + 1e-6f);

  const float decay_rate = exp2_fast(__ldg(p.A_log + head) * kLog2e);  // exp(A_log[h])
  const float* dt_bias = p.dt_bias + int64_t(head) * FKDA_HEAD_DIM + k0;
#pragma unroll
  for (int x = 0; x < 8; ++x) {
    float a2_lo = 0.f, a2_hi = 0.f;
    if (valid) {
      a2_lo = p.gate_scale * sigmoid(decay_rate * (bf16_lo(gw[x]) + __ldg(dt_bias + 2 * x)));
      a2_hi = p.gate_scale * sigmoid(decay_rate * (bf16_hi(gw[x]) + __ldg(dt_bias + 2 * x + 1)));
    }
    cumulative[i][k0 + 2 * x] = a2_lo;
    cumulative[i][k0 + 2 * x + 1] = a2_hi;
  }
  if ((tid & 7) == 0) {
    float b = 0.f;
    if (valid) b = sigmoid(bf16_bits(*(element(p.beta))));
    b_of[i] = b;
  }
  __syncthreads();

  // ---- cumulative gate along the tokens, and the chunk's decay ------------
  unsigned char* record = record_of(p, slot, head);
  {
    float c = 0.f;
#pragma unroll
    for (int r = 0; r < FKDA_CHUNK; ++r) {
      c += cumulative[r][tid];
      cumulative[r][tid] = c;
    }
    reinterpret_cast<float*>(record + FKDA_WS_DECAY_OFFSET)[tid] = exp2_fast(c);
  }
  __syncthreads();

  // ---- step 3: operands -----------------------------------------------------
  {
    uint32_t kd[8], qd[8], kr[8], kdb[8], kib[8], qdb[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      float kd2[2], qd2[2], ki2[2], kr2[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int k = k0 + 2 * x + e;
        const float c = cumulative[i][k];
        const float c_last = cumulative[FKDA_CHUNK - 1][k];
        const float kn = (e ? bf16_hi(kw[x]) : bf16_lo(kw[x])) * rk;
        const float qn = (e ? bf16_hi(qw[x]) : bf16_lo(qw[x])) * rq * p.scale;
        const float up = exp2_fast(c);
        kd2[e] = kn * up;
        qd2[e] = qn * up;
        ki2[e] = kn * exp2_fast(-c);
        kr2[e] = kn * exp2_fast(c_last - c);
      }
      kd[x] = pack_f16x2(kd2[0], kd2[1]);
      qd[x] = pack_f16x2(qd2[0], qd2[1]);
      kr[x] = pack_f16x2(kr2[0], kr2[1]);
      kdb[x] = pack_bf16x2(kd2[0], kd2[1]);
      kib[x] = pack_bf16x2(ki2[0], ki2[1]);
      qdb[x] = pack_bf16x2(qd2[0], qd2[1]);
    }
    const int64_t row_offset = int64_t(i) * FKDA_HEAD_DIM * 2 + k0 * 2;
    uint4* kd_out = reinterpret_cast<uint4*>(record + FKDA_WS_KD_OFFSET + row_offset);
    uint4* qd_out = reinterpret_cast<uint4*>(record + FKDA_WS_QD_OFFSET + row_offset);
    uint4* kr_out = reinterpret_cast<uint4*>(record + FKDA_WS_KR_OFFSET + row_offset);
    kd_out[0] = make_uint4(kd[0], kd[1], kd[2], kd[3]);
    kd_out[1] = make_uint4(kd[4], kd[5], kd[6], kd[7]);
    qd_out[0] = make_uint4(qd[0], qd[1], qd[2], qd[3]);
    qd_out[1] = make_uint4(qd[4], qd[5], qd[6], qd[7]);
    kr_out[0] = make_uint4(kr[0], kr[1], kr[2], kr[3]);
    kr_out[1] = make_uint4(kr[4], kr[5], kr[6], kr[7]);
    uint4* kdb_s = reinterpret_cast<uint4*>(&kd_b[i][k0]);
    uint4* kib_s = reinterpret_cast<uint4*>(&ki_b[i][k0]);
    uint4* qdb_s = reinterpret_cast<uint4*>(&qd_b[i][k0]);
    kdb_s[0] = make_uint4(kdb[0], kdb[1], kdb[2], kdb[3]);
    kdb_s[1] = make_uint4(kdb[4], kdb[5], kdb[6], kdb[7]);
    kib_s[0] = make_uint4(kib[0], kib[1], kib[2], kib[3]);
    kib_s[1] = make_uint4(kib[4], kib[5], kib[6], kib[7]);
    qdb_s[0] = make_uint4(qdb[0], qdb[1], qdb[2], qdb[3]);
    qdb_s[1] = make_uint4(qdb[4], qdb[5], qdb[6], qdb[7]);
  }
  __syncthreads();

  // ---- step 4: A = Kd_b Ki_b^T (warps 0, 1) and B = Qd_b Ki_b^T (warps 2, 3),
  // one 8-column half of the 16x16 result a warp.
  {
    const int warp = tid >> 5, lane = tid & 31;
    const int which = warp >> 1, half = warp & 1;
    const uint16_t(*left)[kBf16TilePitch] = which ? qd_b : kd_b;
    const uint32_t a_base =
        smem_address(&left[((lane >> 3) & 1) * 8 + (lane & 7)][(lane >> 4) * 8]);
    const uint32_t b_base = smem_address(&ki_b[half * 8 + (lane & 7)][(lane >> 3) * 8]);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int pair = 0; pair < 4; ++pair) {
      uint32_t b[4];
      ldmatrix_x4(b, b_base + pair * 64);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, a_base + (pair * 2 + kk) * 32);
        mma_bf16(acc, a, b[2 * kk], b[2 * kk + 1]);
      }
    }
    const int g = lane >> 2, t = lane & 3;
    const int j = half * 8 + 2 * t;
    products[which][g][j] = acc[0];
    products[which][g][j + 1] = acc[1];
    products[which][g + 8][j] = acc[2];
    products[which][g + 8][j + 1] = acc[3];
  }
  __syncthreads();

  // ---- L, Mqk; step 5: INV by the product form, W -------------------------
  const int r = tid >> 3, j0 = (tid & 7) * 2;  // this thread's two entries (r, j0), (r, j0 + 1)
  {
    const float br = b_of[r];
    L[r][j0] = j0 < r ? br * products[0][r][j0] : 0.f;
    L[r][j0 + 1] = j0 + 1 < r ? br * products[0][r][j0 + 1] : 0.f;
    const uint32_t mqk = pack_f16x2(j0 <= r ? products[1][r][j0] : 0.f,
                                    j0 + 1 <= r ? products[1][r][j0 + 1] : 0.f);
    reinterpret_cast<uint32_t*>(record + FKDA_WS_MQK_OFFSET)[r * 8 + (tid & 7)] = mqk;
  }
  __syncthreads();
  float x0, x1, y0, y1;
  product_pair(&L[0][0], &L[0][0], r, j0, x0, x1);
  L2[r][j0] = x0;
  L2[r][j0 + 1] = x1;
  __syncthreads();
  // L4 = L2 L2 and P1 = (I - L)(I + L2) = I - L + L2 - L L2.
  product_pair(&L2[0][0], &L2[0][0], r, j0, x0, x1);
  product_pair(&L[0][0], &L2[0][0], r, j0, y0, y1);
  L4[r][j0] = x0;
  L4[r][j0 + 1] = x1;
  P1[r][j0] = float(r == j0) - L[r][j0] + L2[r][j0] - y0;
  P1[r][j0 + 1] = float(r == j0 + 1) - L[r][j0 + 1] + L2[r][j0 + 1] - y1;
  __syncthreads();
  // L8 = L4 L4 and P2 = P1 (I + L4).
  product_pair(&L4[0][0], &L4[0][0], r, j0, x0, x1);
  product_pair(&P1[0][0], &L4[0][0], r, j0, y0, y1);
  L8[r][j0] = x0;
  L8[r][j0 + 1] = x1;
  P2[r][j0] = P1[r][j0] + y0;
  P2[r][j0 + 1] = P1[r][j0 + 1] + y1;
  __syncthreads();
  // INV = P2 (I + L8); W = f16(INV diag(b)).
  product_pair(&P2[0][0], &L8[0][0], r, j0, y0, y1);
  const float inv0 = P2[r][j0] + y0, inv1 = P2[r][j0 + 1] + y1;
  reinterpret_cast<uint32_t*>(record + FKDA_WS_W_OFFSET)[r * 8 + (tid & 7)] =
      pack_f16x2(inv0 * b_of[j0], inv1 * b_of[j0 + 1]);
}
