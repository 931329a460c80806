// SPDX-License-Identifier: MIT
// Device primitives shared by the prefill and decode kernels: the
// conversions whose rounding docs/NUMERICS.md fixes, warp-level matrix
// products (mma.sync m16n8k16 and m16n8k8, the same instructions on sm_80 and
// sm_90a), ldmatrix, cp.async, the sequence bounds the kernels must agree on
// and the reading of untrusted device-side offsets and pool slots.
#pragma once

#include <stdint.h>

#include "prefill_params.h"

namespace fkda_dev {

constexpr float kLog2e = FKDA_LOG2E;

// 2^x by the hardware's approximation (about 2 ulp), as the contract allows.
// Flushing subnormals costs nothing here: the bounded gate's exponents lie in
// [-116, 116], so no result is subnormal; the unbounded gates' per-token
// decays (exponents down to FKDA_LOG2_DECAY_FLOOR) flush to 0 below 2^-126,
// a decay no f32 state could tell from 0 after one more token.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) by the hardware's approximation (absolute error about 2^-22 near
// 1): used where an absolute error of that size in a log-decay is harmless.
__device__ __forceinline__ float log2_fast(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x by the hardware's approximation (at most 1 ulp off). Flushing a
// subnormal result to zero is harmless where it is used (docs/NUMERICS.md).
__device__ __forceinline__ float rcp_fast(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// sigmoid(x) = 1 / (1 + 2^(-x log2 e)), with an IEEE division.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + exp2_fast(-x * kLog2e)); }

// The same with the hardware reciprocal: for the gate, where it runs once
// per element and the contract allows it.
__device__ __forceinline__ float sigmoid_fast(float x) { return rcp_fast(1.0f + exp2_fast(-x * kLog2e)); }

// sigmoid(x) with the library's expf and an IEEE division, a few ulp from
// exact: for the decode, whose f32 state is compared with the fp64
// recurrence at 1e-6 after several steps.
__device__ __forceinline__ float sigmoid_accurate(float x) { return 1.0f / (1.0f + expf(-x)); }

// ------------------------------------------------------------ the gate ---
// The gate forms of flashkda.h's fkda_gate_mode. Bounded gates lie in
// [lower_bound, 0]; the unbounded ones (SOFTPLUS, LOG_DECAY) are clamped to
// FKDA_LOG2_DECAY_FLOOR per token, which changes no f32 decay factor.
constexpr float kLn2 = 0.693147180559945309f;

// exp(A_log[h]) and dt_bias[h][channel], or 1 and 0 where they are absent.
// rate_of_a_log takes A_log[h] as loaded (any value where A_log is absent),
// for kernels that load it long before they use it.
__device__ __forceinline__ float rate_of_a_log(const float* A_log, float a_log, bool accurate) {
  if (A_log == nullptr) return 1.f;
  return accurate ? expf(a_log) : exp2_fast(a_log * kLog2e);
}
__device__ __forceinline__ float load_a_log(const float* A_log, int head) {
  return A_log != nullptr ? __ldg(A_log + head) : 0.f;
}
__device__ __forceinline__ float gate_rate(const float* A_log, int head, bool accurate) {
  return rate_of_a_log(A_log, load_a_log(A_log, head), accurate);
}

// The base-2 log-decay of an unbounded gate for x = g + dt_bias (SOFTPLUS)
// or g (LOG_DECAY). softplus(x) = max(x, 0) + log(1 + exp(-|x|)), taken as
// x above 20; the hardware's exp2 and log2 approximations err by about
// 2^-22 absolute in the log-decay, a relative 2^-22 in the decay. The mode
// is a template argument: a run-time test per element costs the prefill's
// preparation a branch per element.
template <int32_t kMode>
__device__ __forceinline__ float unbounded_log2_decay_fast(float x, float rate) {
  static_assert(kMode == FKDA_KERNEL_GATE_SOFTPLUS || kMode == FKDA_KERNEL_GATE_LOG_DECAY, "an unbounded gate");
  float a2;
  if constexpr (kMode == FKDA_KERNEL_GATE_SOFTPLUS) {
    const float softplus = x > 20.f ? x : fmaxf(x, 0.f) + kLn2 * log2_fast(1.f + exp2_fast(-fabsf(x) * kLog2e));
    a2 = -rate * softplus * kLog2e;
  } else {
    a2 = fminf(x, 0.f) * kLog2e;
  }
  return fmaxf(a2, FKDA_LOG2_DECAY_FLOOR);
}

// The same with the library's accurate functions, and the bounded gate
// too (for the decode, whose f32 state is held to 1e-6 of the fp64
// recurrence): the decay factor 2^(log2-decay).
__device__ __forceinline__ float decay_accurate(const FkdaGate& gate, float gate_scale, float g, float rate, float dt) {
  const float x = g + dt;
  float a2;
  if (gate.mode == FKDA_KERNEL_GATE_BOUNDED) {
    a2 = gate_scale * sigmoid_accurate(rate * x);
  } else if (gate.mode == FKDA_KERNEL_GATE_SOFTPLUS) {
    a2 = fmaxf(-rate * (x > 20.f ? x : log1pf(expf(x))) * kLog2e, FKDA_LOG2_DECAY_FLOOR);
  } else {
    a2 = fmaxf(fminf(g, 0.f) * kLog2e, FKDA_LOG2_DECAY_FLOOR);
  }
  return exp2f(a2);
}

// beta element `at` as stored (bf16 or f32).
__device__ __forceinline__ float load_beta(const FkdaGate& gate, const void* beta, int64_t at) {
  return gate.beta_is_f32 ? __ldg(static_cast<const float*>(beta) + at)
                          : __uint_as_float(uint32_t(__ldg(static_cast<const unsigned short*>(beta) + at)) << 16);
}

// The delta rule's step size: sigmoid of a logit, or a probability clamped
// into [0, 1] (which keeps |L| <= 1 for the chunk inverse).
__device__ __forceinline__ float step_size(const FkdaGate& gate, float beta, bool accurate) {
  if (gate.beta_mode == FKDA_KERNEL_BETA_PROBABILITIES) return fminf(fmaxf(beta, 0.f), 1.f);
  return accurate ? sigmoid_accurate(beta) : sigmoid(beta);
}

// Two floats to f16x2 (lo in bits 0..15), round to nearest even, saturating
// to +-65504 so that no step makes an infinity.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two floats to bf16x2 (lo in bits 0..15), round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint16_t to_bf16(float x) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float bf16_lo(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }

// d += a * b for a 16x16 (row) by 16x8 (col) tile, f32 accumulate.
// Pure register operations (not volatile): the compiler may schedule them
// around the loads they do not depend on.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a * b for a 16x8 (row) by 8x8 (col) tile of tf32 values, f32
// accumulate. The tensor cores read only the tf32 bits of each register.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices; lane l names row (l % 8) of matrix (l / 8).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// As ldmatrix_x4, each matrix transposed on the way.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// 16 bytes global -> shared without a register round trip; with
// src_bytes == 0 nothing is read and the destination is zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
}

// Lets the stream's next kernel, if it was launched as a programmatic
// dependent, start on the resources this grid leaves free. Its wait for
// this grid's writes is its own (it calls none when it reads none of them);
// sm_80 has no such launches.
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ------------------------------------------------------ record layout ---
// Byte offset of element (row, col) in a record's swizzled tiles
// (prefill_params.h): 16 x 128 f16 (Kd, Qd, Kr) and 16 x 16 f16 (W, Mqk).
__device__ __forceinline__ int wide_tile_offset(int row, int col) {
  return row * 256 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2;
}
__device__ __forceinline__ int small_tile_offset(int row, int col) {
  return row * 32 + (((col >> 3) ^ ((row >> 2) & 1)) << 4) + (col & 7) * 2;
}

// ------------------------------------------------------------ sequences ---
// Device-side offsets are never trusted: each is clamped into [0, T] and an
// end below its begin becomes an empty sequence, so a bad cu_seqlens can give
// wrong numbers but never an access outside the tensors or the workspace.
// The host reads offsets through sequence_tokens (src/prefill_problem.h),
// which clamps the same way; this is the device's own copy because the
// kernels are compiled apart from the host code and read through __ldg.
struct Sequence {
  int64_t row;        // batch row of its tokens
  int64_t begin;      // first token along the row
  int64_t end;        // one past the last
  int64_t slot_base;  // first workspace slot of its chunks
};

// Element `at` of a device-side i32 or i64 array.
__device__ __forceinline__ int64_t load_integer(const void* data, bool is_i64, int64_t at) {
  return is_i64 ? int64_t(__ldg(static_cast<const long long*>(data) + at))
                : int64_t(__ldg(static_cast<const int*>(data) + at));
}

// Offset i of cu_seqlens, clamped into [0, seq_len].
__device__ __forceinline__ int64_t load_clamped_offset(const void* cu_seqlens, int64_t stride, bool is_i64,
                                                       int64_t seq_len, int64_t i) {
  const int64_t value = load_integer(cu_seqlens, is_i64, i * stride);
  return value < 0 ? 0 : (value > seq_len ? seq_len : value);
}

// Offset i of a call's cu_seqlens, clamped into [0, seq_len].
__device__ __forceinline__ int64_t load_offset_of(const FkdaRecurrenceCall& call, int64_t i) {
  return load_clamped_offset(call.cu_seqlens, call.cu_seqlens_stride, call.cu_seqlens_is_i64 != 0, call.seq_len, i);
}

__device__ __forceinline__ int64_t load_offset(const FkdaPrefillParams& p, int64_t i) { return load_offset_of(p.call, i); }

// Element (row, col) of a device-side index table, widened to i64.
__device__ __forceinline__ int64_t load_index(const FkdaIndexTable& table, int64_t row, int64_t col) {
  const int64_t at = row * table.stride_row + col * table.stride_col;
  if (table.element_bytes == 1) return int64_t(__ldg(static_cast<const unsigned char*>(table.data) + at));
  return load_integer(table.data, table.element_bytes == 8, at);
}

// A pool slot from the device, or -1 when it is null under the plan's rule
// (below first_real_slot) or outside the pool: both make the sequence padding.
__device__ __forceinline__ int64_t usable_slot(int64_t index, int64_t first_real_slot, int64_t slots) {
  return index >= first_real_slot && index < slots ? index : -1;
}

__device__ __forceinline__ int64_t slot_base_of(const FkdaPrefillParams& p, int64_t n) {
  const int64_t start = p.call.cu_seqlens ? load_offset(p, n) : n * p.call.seq_len;
  return start / FKDA_CHUNK + n;
}

__device__ __forceinline__ Sequence sequence_of(const FkdaPrefillParams& p, int64_t n) {
  Sequence s;
  if (p.call.cu_seqlens == nullptr) {
    s.row = n;
    s.begin = 0;
    s.end = p.call.seq_len;
    s.slot_base = (n * p.call.seq_len) / FKDA_CHUNK + n;
  } else {
    s.row = 0;
    s.begin = load_offset(p, n);
    const int64_t end = load_offset(p, n + 1);
    s.end = end < s.begin ? s.begin : end;
    s.slot_base = s.begin / FKDA_CHUNK + n;
  }
  return s;
}

__device__ __forceinline__ int64_t num_chunks(const Sequence& s) {
  return (s.end - s.begin + FKDA_CHUNK - 1) / FKDA_CHUNK;
}

// A sequence's chunks and those of them in the current window,
// [first, end). In the first window first is 0 and in the last end is
// chunks, so the carries are never needed where they do not exist. A
// sequence without chunks has first = end = chunks = 0 in every window; only
// the first one handles it (it goes from initial to final state there).
struct WindowChunks {
  int64_t chunks, first, end;
};

__device__ __forceinline__ WindowChunks window_chunks(const FkdaPrefillParams& p, const Sequence& seq) {
  WindowChunks w;
  w.chunks = num_chunks(seq);
  // Only reachable with unsorted offsets; keeps every record read inside the workspace.
  if (seq.slot_base + w.chunks > p.num_slots) w.chunks = p.num_slots - seq.slot_base;
  if (w.chunks < 0) w.chunks = 0;
  w.first = p.window_first - seq.slot_base;
  if (w.first < 0) w.first = 0;
  w.end = p.window_end - seq.slot_base;
  if (w.end > w.chunks) w.end = w.chunks;
  if (w.end < 0) w.end = 0;
  return w;
}

// The record of a slot of the current window, by its index in the window.
__device__ __forceinline__ unsigned char* record_of(const FkdaPrefillParams& p, int64_t window_slot, int head) {
  return p.workspace + (window_slot * p.call.num_heads + head) * int64_t(FKDA_WS_RECORD_BYTES);
}

}  // namespace fkda_dev
