// SPDX-License-Identifier: MIT
// Kernel 2 of the prefill: the recurrence over the chunks of each sequence.
//
// What it computes, per (sequence n, head h), as the CPU backend would
// (docs/NUMERICS.md steps 6 and 7; the record of chunk c comes from kernel 1):
//
//   S = initial_state[n][h] widened to f32 (V x K), or zeros
//   for each chunk c, with its tokens' v (rows >= len are zero):
//     Sh = f16(S)
//     X  = Kd Sh^T,  Oi = Qd Sh^T                 (16 x V, f32 sums)
//     Y  = f16(v - X)
//     U  = W Y,  Uh = f16(U)
//     O  = Oi + Mqk Uh    -> out = bf16(O) for rows < len
//     S  = S diag(decay) + Uh^T Kr
//   final_state[n][h] = S rounded to the state dtype
//
// One launch covers the chunks whose slots lie in the current window
// (prefill_params.h): a block starts from the initial state only if its
// sequence's chunk 0 is in the window, else from the carry the previous
// window left, and ends with the final state only if its last chunk is, else
// with the carry for the next window. Both carries are f32, so the windows
// change no bit of the result. A sequence without chunks is handled by the
// first window alone.
//
// The V rows of S evolve independently, so block (n, h, z) of the grid
// (N, H, vsplit) takes rows [z 128/vsplit, (z + 1) 128/vsplit) and each of its
// warps 16 of them, with all 128 K columns, as f32 mma accumulators (64
// registers). Warps never exchange state. Every product is computed
// transposed, with the warp's 16 V rows as the M dimension:
//   X^T = Sh Kd^T, Oi^T = Sh Qd^T    A = Sh: the accumulators, converted in
//                                    registers (accumulator and A fragments
//                                    share their layout); B = Kd, Qd rows
//   U^T = Y^T W^T,  O^T += Uh^T Mqk^T
//   S  += Uh^T Kr                    B = Kr through ldmatrix.trans
// The chunk records and v tiles stream through a ring of shared-memory
// stages filled by cp.async several chunks ahead of the one in use. (One
// bulk copy per record on sm_90 measured the same on an H200, so both
// architectures share this path.)
#pragma once

#include "device_common.cuh"

namespace fkda_dev {

struct StateAccess {
  const void* initial;
  void* final;
  bool bf16;
  bool kv;
  int64_t base;  // element offset of this (n, h) matrix
};

// S[e][k] for the warp's rows e0 + g, e0 + g + 8 and columns nt*8 + 2t, +1:
// s[nt][0..1] row g, s[nt][2..3] row g + 8 (the m16n8 accumulator layout).
__device__ __forceinline__ void load_state(const StateAccess& st, int e0, int g, int t, float (&s)[16][4]) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t e = e0 + g + 8 * half;
      const int64_t k = nt * 8 + 2 * t;
      float v0 = 0.f, v1 = 0.f;
      if (st.initial != nullptr) {
        if (!st.kv) {
          const int64_t at = st.base + e * FKDA_HEAD_DIM + k;
          if (st.bf16) {
            const uint32_t pair = __ldg(reinterpret_cast<const unsigned int*>(
                static_cast<const uint16_t*>(st.initial) + at));
            v0 = bf16_lo(pair);
            v1 = bf16_hi(pair);
          } else {
            const float2 pair = __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(st.initial) + at));
            v0 = pair.x;
            v1 = pair.y;
          }
        } else {
          const int64_t at = st.base + k * FKDA_HEAD_DIM + e;
          if (st.bf16) {
            const uint16_t* src = static_cast<const uint16_t*>(st.initial);
            v0 = bf16_bits(__ldg(src + at));
            v1 = bf16_bits(__ldg(src + at + FKDA_HEAD_DIM));
          } else {
            const float* src = static_cast<const float*>(st.initial);
            v0 = __ldg(src + at);
            v1 = __ldg(src + at + FKDA_HEAD_DIM);
          }
        }
      }
      s[nt][2 * half] = v0;
      s[nt][2 * half + 1] = v1;
    }
  }
}

__device__ __forceinline__ void store_state(const StateAccess& st, int e0, int g, int t, const float (&s)[16][4]) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t e = e0 + g + 8 * half;
      const int64_t k = nt * 8 + 2 * t;
      const float v0 = s[nt][2 * half], v1 = s[nt][2 * half + 1];
      if (!st.kv) {
        const int64_t at = st.base + e * FKDA_HEAD_DIM + k;
        if (st.bf16) {
          *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(st.final) + at) = pack_bf16x2(v0, v1);
        } else {
          *reinterpret_cast<float2*>(static_cast<float*>(st.final) + at) = make_float2(v0, v1);
        }
      } else {
        const int64_t at = st.base + k * FKDA_HEAD_DIM + e;
        if (st.bf16) {
          uint16_t* dst = static_cast<uint16_t*>(st.final);
          dst[at] = to_bf16(v0);
          dst[at + FKDA_HEAD_DIM] = to_bf16(v1);
        } else {
          float* dst = static_cast<float*>(st.final);
          dst[at] = v0;
          dst[at + FKDA_HEAD_DIM] = v1;
        }
      }
    }
  }
}

// Copies of one chunk into a stage, shared by the whole block. The record
// lands byte for byte (it is stored in its shared-memory layout), so with the
// thread count fixed at compile time each 16-byte piece is one instruction.
template <int kThreads>
__device__ __forceinline__ void stage_record(uint32_t stage, const unsigned char* record) {
  constexpr int kRecordPieces = FKDA_WS_RECORD_BYTES / 16;
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < (kRecordPieces + kThreads - 1) / kThreads; ++i) {
    const int piece = tid + i * kThreads;
    if (kRecordPieces % kThreads == 0 || piece < kRecordPieces) cp_async_16(stage + piece * 16, record + piece * 16, 16);
  }
}

// One 16-byte piece of the v tile per thread (16 rows of kVCols / 8 pieces);
// rows past the sequence's end are zero-filled.
template <int kThreads, int kVCols>
__device__ __forceinline__ void stage_v_rows(uint32_t stage, const uint16_t* v_first, int64_t v_stride_t, int len) {
  constexpr int kRowPieces = kVCols / 8;
  static_assert(FKDA_CHUNK * kRowPieces == kThreads, "one v piece per thread");
  const int row = threadIdx.x / kRowPieces, col = threadIdx.x % kRowPieces;
  const bool valid = row < len;
  cp_async_16(stage + FKDA_STAGE_V + row * (kVCols * 2 + 16) + col * 16,
              v_first + (valid ? row * v_stride_t + col * 8 : 0), valid ? 16 : 0);
}

// Zeros over the block's V columns of the output rows of a padding
// sequence's chunks [chunk_first, chunk_end), one 16-byte piece a thread.
template <int kThreads, int kVCols>
__device__ __forceinline__ void zero_output_rows(const FkdaPrefillParams& p, const Sequence& seq, int head,
                                                 int v_block, int64_t chunk_first, int64_t chunk_end) {
  constexpr int kPieces = kVCols / 8;
  const int64_t first = seq.begin + chunk_first * FKDA_CHUNK;
  const int64_t end = seq.begin + chunk_end * FKDA_CHUNK < seq.end ? seq.begin + chunk_end * FKDA_CHUNK : seq.end;
  uint16_t* out = static_cast<uint16_t*>(p.call.out.data) + seq.row * p.call.out.stride_b + int64_t(head) * p.call.out.stride_h +
                  v_block;
  for (int64_t i = threadIdx.x; i < (end - first) * kPieces; i += kThreads) {
    *reinterpret_cast<uint4*>(out + (first + i / kPieces) * p.call.out.stride_t + (i % kPieces) * 8) =
        make_uint4(0u, 0u, 0u, 0u);
  }
}

// The next checkpoint of a sequence: its column in checkpoint_offsets and
// the token count after which it is taken (-1: none left).
struct CheckpointCursor {
  int64_t column;
  int64_t boundary;
};

// Moves the cursor to the first column from its own on whose offset is a
// chunk boundary after `after` tokens and within the sequence's length.
// Offsets that are not (device values are untrusted) are skipped, and so are
// offsets at or before `after`: those belong to earlier chunks.
__device__ __forceinline__ void seek_checkpoint(const FkdaPrefillParams& p, int64_t n, int64_t length, int64_t after,
                                                CheckpointCursor& cursor) {
  cursor.boundary = -1;
  if (p.checkpoint_offsets.data == nullptr) return;
  for (; cursor.column < p.checkpoint_offsets.cols; ++cursor.column) {
    const int64_t offset = load_index(p.checkpoint_offsets, n, cursor.column);
    if (offset > after && offset <= length && offset % FKDA_CHUNK == 0) {
      cursor.boundary = offset;
      return;
    }
  }
}

// Where checkpoint `column` of sequence n goes; false when its pool slot is
// null or outside the pool.
__device__ __forceinline__ bool checkpoint_destination(const FkdaPrefillParams& p, int64_t n, int64_t column,
                                                       int64_t head_offset, StateAccess& to) {
  to.initial = nullptr;
  to.kv = p.call.state_is_kv != 0;
  if (p.checkpoints != nullptr) {
    to.final = p.checkpoints;
    to.bf16 = p.checkpoint_is_bf16 != 0;
    to.base = n * p.checkpoint_stride_n + column * p.checkpoint_stride_c + head_offset;
    return true;
  }
  const int64_t slot = usable_slot(load_index(p.checkpoint_slots, n, column), p.call.first_real_slot, p.pool_slots);
  to.final = p.state_pool;
  to.bf16 = p.call.state_is_bf16 != 0;
  to.base = slot * p.pool_slot_stride + head_offset;
  return slot >= 0;
}

// kServing: the call may address states in a pool (state_indices), start
// some sequences from zeros (has_initial_state) or keep checkpoints.
// Without it those paths are compiled out: on sm_90a the kernels then hold
// 8-17 fewer registers and run 2-11% faster on an H200 (bench/RESULTS.md).
// What a launch of the recurrence does with each block's chunks:
//   kWholeRange   all of its sequence's chunks in the window, in order
//   kTransition   (chunk-parallel, first pass) one segment's transition: from
//                 a zero state the segment's E, or from the identity with
//                 v = 0 its M (blockIdx.z >= vsplit); no output rows
//   kSegment      (chunk-parallel, last pass) one segment from the state the
//                 scan left for it: output rows, checkpoints, final state
enum RecurrenceMode { kWholeRange = 0, kTransition = 1, kSegment = 2 };

// The f32 V x K matrix of segment record `index` and head `head`.
__device__ __forceinline__ StateAccess segment_matrix(float* base, int64_t index, int head, int num_heads) {
  StateAccess m;
  m.initial = base;
  m.final = base;
  m.bf16 = false;
  m.kv = false;
  m.base = (index * num_heads + head) * int64_t(FKDA_HEAD_DIM * FKDA_HEAD_DIM);
  return m;
}

// ------------------------------------------- the steps of the recurrence ---
// The functions below are the steps of chunk_recurrence, in its order.

// The chunks a block runs, [run_first, run_end): the window's chunks of its
// sequence, or one segment of them. A zero-length sequence has one empty
// segment.
struct BlockRun {
  int64_t n;  // the sequence
  Sequence seq;
  WindowChunks window;
  int64_t run_first, run_end;
  bool first_segment, last_segment;
  int64_t segment_index;  // the segment's record in seg_m / seg_e
};

// Finds the chunks of sequence n the block runs; false when it has nothing
// to do: its sequence has no chunk in this window (one without chunks is
// handled by the first window alone), or, in the segment passes, its
// segment does not exist or (transitions) is not needed by the scan.
// forms_m: a transition block that forms M.
template <int kMode>
__device__ __forceinline__ bool locate_run(const FkdaPrefillParams& p, int64_t n, bool forms_m, BlockRun& run) {
  run.n = n;
  run.seq = sequence_of(p, n);
  run.window = window_chunks(p, run.seq);
  const int64_t chunks = run.window.chunks, chunk_first = run.window.first, chunk_end = run.window.end;
  if (chunks == 0 ? p.window_first != 0 : chunk_first >= chunk_end) return false;

  run.run_first = chunk_first;
  run.run_end = chunk_end;
  run.first_segment = true;
  run.last_segment = true;
  run.segment_index = 0;
  if constexpr (kMode != kWholeRange) {
    if (chunks == 0) {
      // A zero-length sequence: its one empty segment copies the state in
      // the segment pass (no record needed); nothing to form before.
      if (kMode == kTransition || int64_t(blockIdx.x) % p.segments_per_seq != 0) return false;
    }
  }
  if (kMode != kWholeRange && chunks > 0) {
    const int64_t L = p.segment_chunks;
    const int64_t s0 = chunk_first / L;
    const int64_t s_last = chunk_end > chunk_first ? (chunk_end - 1) / L : s0;
    const int64_t s = s0 + int64_t(blockIdx.x) % p.segments_per_seq;
    if (s > s_last) return false;
    run.first_segment = s == s0;
    run.last_segment = s == s_last;
    run.run_first = run.first_segment ? chunk_first : s * L;
    run.run_end = run.last_segment ? chunk_end : (s + 1) * L;
    run.segment_index = fkda_segment_index(run.seq.slot_base + s * L, p.window_first, L, n);
    if (run.segment_index < 0 || run.segment_index >= p.segment_capacity) return false;  // unsorted offsets only
    if (kMode == kTransition && !p.transitions_only) {
      // The scan needs E of every segment but the last, M of every segment
      // but the first and the last (the first one's incoming state is known).
      if (run.last_segment || (forms_m && run.first_segment)) return false;
    }
  }
  return true;
}

// The caller's state of sequence n: initial_state / final_state, or its
// slot of the pool, read as zeros where has_initial_state says so. False
// for a padding sequence (a null slot, or one outside the pool).
template <bool kServing>
__device__ __forceinline__ bool caller_state(const FkdaPrefillParams& p, int64_t n, int64_t head_offset,
                                             StateAccess& state) {
  state.initial = p.initial_state;
  state.final = p.final_state;
  state.bf16 = p.call.state_is_bf16 != 0;
  state.kv = p.call.state_is_kv != 0;
  state.base = n * p.call.num_heads * int64_t(FKDA_HEAD_DIM * FKDA_HEAD_DIM) + head_offset;
  if (kServing && p.state_indices.data != nullptr) {
    const int64_t slot = usable_slot(load_index(p.state_indices, n, 0), p.call.first_real_slot, p.pool_slots);
    if (slot < 0) return false;
    state.initial = p.state_pool;
    state.final = p.state_pool;
    state.base = slot * p.pool_slot_stride + head_offset;
  }
  if (kServing && p.has_initial_state.data != nullptr && load_index(p.has_initial_state, n, 0) == 0) {
    state.initial = nullptr;
  }
  return true;
}

// Where the block's state comes from and goes to: the caller's state, this
// head's f32 V x K carry matrices between windows, or segment records.
template <int kMode>
__device__ __forceinline__ void state_ends(const FkdaPrefillParams& p, const BlockRun& run, int head, bool forms_m,
                                           const StateAccess& state, StateAccess& from, StateAccess& to) {
  from = state;
  to = state;
  if (run.window.first > 0) {
    from.initial = p.carry_in;
    from.bf16 = false;
    from.kv = false;
    from.base = int64_t(head) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM);
  }
  if (run.window.end < run.window.chunks) {
    to.final = p.carry_out;
    to.bf16 = false;
    to.kv = false;
    to.base = int64_t(head) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM);
  }
  if constexpr (kMode == kTransition) {
    // Only the first segment starts from the sequence's state (and, outside
    // fkda_transitions, keeps a copy in its M record for the last pass,
    // since the final state may overwrite it in place); the others from
    // zeros, or the identity for M. Transitions end in their records.
    const bool from_state = run.first_segment && !p.transitions_only;
    if (!from_state) from.initial = nullptr;
    to = segment_matrix(forms_m ? p.seg_m : p.seg_e, run.segment_index, head, p.call.num_heads);
  } else if constexpr (kMode == kSegment) {
    if (!run.first_segment) {
      from = segment_matrix(p.seg_e, run.segment_index - 1, head, p.call.num_heads);
    } else if (!run.last_segment) {
      from = segment_matrix(p.seg_m, run.segment_index, head, p.call.num_heads);
    }
    if (!run.last_segment) to.final = nullptr;
  }
}

// The incoming state of the warp's rows into S; a transition block forming
// M starts from the identity instead, and the first segment's E block
// copies its incoming state to the segment's M record (see state_ends).
template <int kMode>
__device__ __forceinline__ void load_incoming_state(const FkdaPrefillParams& p, const BlockRun& run, int head,
                                                    bool forms_m, const StateAccess& from, int e0, int g, int t,
                                                    float (&S)[16][4]) {
  load_state(from, e0, g, t, S);
  if constexpr (kMode == kTransition) {
    if (forms_m) {
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) S[nt][r] = (e0 + g + 8 * (r >> 1) == nt * 8 + 2 * t + (r & 1)) ? 1.f : 0.f;
      }
    } else if (run.first_segment && !p.transitions_only) {
      store_state(segment_matrix(p.seg_m, run.segment_index, head, p.call.num_heads), e0, g, t, S);
    }
  }
}

// Per-lane ldmatrix offsets (bytes, within a stage). Kd, Qd, W, Mqk:
// matrices (rows 0-7, cols 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
// give the B fragments of both 8-row n-tiles. Kr and v through .trans:
// (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15). In the
// swizzled tiles, k-step ks moves a lane's piece index by 2 ks, which is an
// XOR of its offset with ks << 5. Qd shares Kd's offset.
struct StageLanes {
  uint32_t kd, kr, w, mqk, v;
};

template <int kVPitch>
__device__ __forceinline__ StageLanes stage_lanes(int lane, int warp) {
  const int row_a = (lane >> 4) * 8 + (lane & 7), col_a = ((lane >> 3) & 1) * 8;
  const int row_t = ((lane >> 3) & 1) * 8 + (lane & 7), col_t = (lane >> 4) * 8;
  StageLanes at;
  at.kd = wide_tile_offset(row_a, col_a);
  at.kr = wide_tile_offset(row_t, col_t);
  at.w = FKDA_WS_W_OFFSET + small_tile_offset(row_a, col_a);
  at.mqk = FKDA_WS_MQK_OFFSET + small_tile_offset(row_a, col_a);
  at.v = FKDA_STAGE_V + row_a * kVPitch + (warp * 16 + col_a) * 2;
  return at;
}

// Step 6's state step of one chunk for the warp's 16 V rows, from the
// chunk's stage (`stage` its shared address, `stage_bytes` the same bytes
// through a pointer): Sh = f16(S), X = Kd Sh^T, Y = f16(v - X),
// U = W Y, Uh = f16(U), S = S diag(decay) + Uh^T Kr, all transposed (the
// warp's V rows as M). Leaves Sh, Uh and the Mqk fragments for the output.
__device__ __forceinline__ void advance_state(uint32_t stage, const unsigned char* stage_bytes,
                                              const StageLanes& at, int t, float (&S)[16][4], uint32_t (&sh)[8][4],
                                              uint32_t (&uh)[4], uint32_t (&mqk)[4]) {
  // Operands off the chain first: v^T (A-fragment order, k = tokens), W, Mqk.
  uint32_t v[4], w[4];
  ldmatrix_x4_trans(v, stage + at.v);
  ldmatrix_x4(w, stage + at.w);
  ldmatrix_x4(mqk, stage + at.mqk);

  // Sh = f16(S) as A fragments: k-step ks covers columns 16 ks .. 16 ks + 15.
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    sh[ks][0] = pack_f16x2(S[2 * ks][0], S[2 * ks][1]);
    sh[ks][1] = pack_f16x2(S[2 * ks][2], S[2 * ks][3]);
    sh[ks][2] = pack_f16x2(S[2 * ks + 1][0], S[2 * ks + 1][1]);
    sh[ks][3] = pack_f16x2(S[2 * ks + 1][2], S[2 * ks + 1][3]);
  }
  // S diag(decay) now, while the products below wait on their inputs.
  const float* decay = reinterpret_cast<const float*>(stage_bytes + FKDA_WS_DECAY_OFFSET);
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const float2 d = *reinterpret_cast<const float2*>(decay + nt * 8 + 2 * t);
    S[nt][0] *= d.x;
    S[nt][1] *= d.y;
    S[nt][2] *= d.x;
    S[nt][3] *= d.y;
  }

  // X^T (16 V rows x 16 tokens, two n-tiles) is on the chain to the next
  // chunk: four partial sums cut its dependent mmas from eight to two.
  float x[4][2][4] = {};
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    uint32_t kd[4];
    ldmatrix_x4(kd, stage + FKDA_WS_KD_OFFSET + (at.kd ^ (ks << 5)));
    mma_f16(x[ks & 3][0], sh[ks], kd[0], kd[1]);
    mma_f16(x[ks & 3][1], sh[ks], kd[2], kd[3]);
  }

  // Y^T = f16(v^T - X^T), straight into A-fragment order.
  uint32_t y[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float xs[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) xs[r] = (x[0][nt][r] + x[1][nt][r]) + (x[2][nt][r] + x[3][nt][r]);
    y[2 * nt] = pack_f16x2(bf16_lo(v[2 * nt]) - xs[0], bf16_hi(v[2 * nt]) - xs[1]);
    y[2 * nt + 1] = pack_f16x2(bf16_lo(v[2 * nt + 1]) - xs[2], bf16_hi(v[2 * nt + 1]) - xs[3]);
  }

  // U^T = Y^T W^T, Uh^T = f16(U^T).
  float u[2][4] = {};
  mma_f16(u[0], y, w[0], w[1]);
  mma_f16(u[1], y, w[2], w[3]);
  uh[0] = pack_f16x2(u[0][0], u[0][1]);
  uh[1] = pack_f16x2(u[0][2], u[0][3]);
  uh[2] = pack_f16x2(u[1][0], u[1][1]);
  uh[3] = pack_f16x2(u[1][2], u[1][3]);

  // S += Uh^T Kr closes the chain.
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t kr[4];
    ldmatrix_x4_trans(kr, stage + FKDA_WS_KR_OFFSET + (at.kr ^ (j << 5)));
    mma_f16(S[2 * j], uh, kr[0], kr[1]);
    mma_f16(S[2 * j + 1], uh, kr[2], kr[3]);
  }
}

// Step 6's output of chunk `chunk` of the sequence, off the chain:
// Oi^T = Sh Qd^T, O^T = Oi^T + Uh^T Mqk^T, out = bf16(O) for the chunk's
// tokens before the sequence's end, through the warp's tile (token-major)
// so that each lane writes one 16-byte piece.
__device__ __forceinline__ void write_chunk_output(uint32_t stage, const StageLanes& at, int lane,
                                                   const uint32_t (&sh)[8][4], const uint32_t (&uh)[4],
                                                   const uint32_t (&mqk)[4], unsigned char* out_tile,
                                                   uint16_t* out_row, int64_t out_stride_t, const Sequence& seq,
                                                   int64_t chunk) {
  const int g = lane >> 2, t = lane & 3;
  float o[2][4] = {};
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    uint32_t qd[4];
    ldmatrix_x4(qd, stage + FKDA_WS_QD_OFFSET + (at.kd ^ (ks << 5)));
    mma_f16(o[0], sh[ks], qd[0], qd[1]);
    mma_f16(o[1], sh[ks], qd[2], qd[3]);
  }

  mma_f16(o[0], uh, mqk[0], mqk[1]);
  mma_f16(o[1], uh, mqk[2], mqk[3]);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int token = nt * 8 + 2 * t + (r & 1);
      const int col = g + 8 * (r >> 1);
      *reinterpret_cast<uint16_t*>(out_tile + token * FKDA_OUT_TILE_PITCH_BYTES + col * 2) = to_bf16(o[nt][r]);
    }
  }
  __syncwarp();
  const int64_t first = seq.begin + chunk * FKDA_CHUNK;
  const int token = lane >> 1, piece = lane & 1;
  if (first + token < seq.end) {
    const uint4 value = *reinterpret_cast<const uint4*>(out_tile + token * FKDA_OUT_TILE_PITCH_BYTES + piece * 16);
    *reinterpret_cast<uint4*>(out_row + (first + token) * out_stride_t + piece * 8) = value;
  }
}

// Stores S as the checkpoint under the cursor (unless its slot is null)
// and moves the cursor to the next one.
__device__ __forceinline__ void store_checkpoint(const FkdaPrefillParams& p, const BlockRun& run,
                                                 int64_t head_offset, int e0, int g, int t, const float (&S)[16][4],
                                                 CheckpointCursor& checkpoint) {
  StateAccess to_checkpoint;
  if (checkpoint_destination(p, run.n, checkpoint.column, head_offset, to_checkpoint)) {
    store_state(to_checkpoint, e0, g, t, S);
  }
  ++checkpoint.column;
  seek_checkpoint(p, run.n, run.seq.end - run.seq.begin, checkpoint.boundary, checkpoint);
}

// The recurrence kernels' body for a V split, serving form and mode (above):
// the block's chunks and state ends, then the chain of chunks, then the
// state it leaves.
template <int kVsplit, bool kServing, int kMode = kWholeRange>
__device__ __forceinline__ void chunk_recurrence(const FkdaPrefillParams& p) {
  constexpr int kWarps = 8 / kVsplit;
  constexpr int kThreads = 32 * kWarps;
  static_assert(kThreads <= 256, "the kernels are launched with at most 256 threads");
  constexpr int kVCols = FKDA_HEAD_DIM / kVsplit;
  constexpr int kVPitch = kVCols * 2 + 16;
  constexpr int kStageBytes = FKDA_STAGE_V + FKDA_CHUNK * kVPitch;
  extern __shared__ __align__(128) unsigned char smem[];

  // The block's sequence (one block per sequence, or per segment of one),
  // head and V rows.
  const int64_t n = kMode == kWholeRange ? int64_t(blockIdx.x) : int64_t(blockIdx.x) / p.segments_per_seq;
  const int head = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  // kTransition: blocks z < vsplit form E, the others M.
  const bool forms_m = kMode == kTransition && int(blockIdx.z) >= kVsplit;
  const int v_block = (kMode == kTransition ? int(blockIdx.z) % kVsplit : int(blockIdx.z)) * kVCols;
  const int e0 = v_block + warp * 16;       // first V row of this warp

  // ---- the chunks it runs, where its state comes from and goes to -----------
  BlockRun run;
  if (!locate_run<kMode>(p, n, forms_m, run)) return;
  const Sequence& seq = run.seq;
  const int64_t head_offset = int64_t(head) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM);
  StateAccess state;
  if (!caller_state<kServing>(p, n, head_offset, state)) {
    // A padding sequence: zero output rows, no state read or written.
    if (kMode != kTransition) zero_output_rows<kThreads, kVCols>(p, seq, head, v_block, run.run_first, run.run_end);
    return;
  }
  StateAccess from, to;
  state_ends<kMode>(p, run, head, forms_m, state, from, to);
  float S[16][4];
  load_incoming_state<kMode>(p, run, head, forms_m, from, e0, g, t, S);

  // ---- the chunks' stages --------------------------------------------------
  const uint32_t stages = smem_address(smem);
  unsigned char* out_tile = smem + FKDA_RECURRENCE_STAGES * kStageBytes + warp * FKDA_OUT_TILE_BYTES;
  uint16_t* out_row = static_cast<uint16_t*>(p.call.out.data) + seq.row * p.call.out.stride_b +
                      int64_t(head) * p.call.out.stride_h + e0;

  CheckpointCursor checkpoint{0, -1};
  if constexpr (kServing && kMode != kTransition) {
    seek_checkpoint(p, n, seq.end - seq.begin, run.run_first * FKDA_CHUNK, checkpoint);
  }

  // The next chunk to stage, its record and its first v row.
  const int64_t run_first = run.run_first, run_end = run.run_end;
  int64_t next = run_first;
  const int64_t record_step = int64_t(p.call.num_heads) * FKDA_WS_RECORD_BYTES;
  const unsigned char* next_record = record_of(p, seq.slot_base + run_first - p.window_first, head);
  const uint16_t* next_v = static_cast<const uint16_t*>(p.call.v.data) + seq.row * p.call.v.stride_b +
                           int64_t(head) * p.call.v.stride_h + v_block +
                           (seq.begin + run_first * FKDA_CHUNK) * p.call.v.stride_t;
  const int64_t v_step = FKDA_CHUNK * p.call.v.stride_t;
  auto issue = [&]() {
    if (next < run_end) {
      const int64_t left = seq.end - (seq.begin + next * FKDA_CHUNK);
      const uint32_t stage = stages + int(next % FKDA_RECURRENCE_STAGES) * kStageBytes;
      stage_record<kThreads>(stage, next_record);
      // M is the same recurrence with v = 0: zero-filled rows.
      stage_v_rows<kThreads, kVCols>(stage, next_v, p.call.v.stride_t,
                                     forms_m ? 0 : int(left < FKDA_CHUNK ? left : FKDA_CHUNK));
      next_record += record_step;
      next_v += v_step;
    }
    ++next;
    // Always one group per chunk index, so wait_group counts stay aligned.
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < FKDA_RECURRENCE_STAGES - 1; ++s) issue();
  const StageLanes at = stage_lanes<kVPitch>(lane, warp);

  // ---- the chain: state step, output and checkpoints per chunk --------------
  // The chunks run in stretches that end at the next checkpoint inside this
  // window (or at the window's end), so that the checkpoint store stays out
  // of the chunk loop, whose body is the latency chain every sequence waits on.
  int64_t chunk = run_first;
  for (;;) {
    const bool checkpoint_here = kServing && kMode != kTransition && checkpoint.boundary > 0 &&
                                 checkpoint.boundary <= run_end * FKDA_CHUNK;
    const int64_t stretch_end = checkpoint_here ? checkpoint.boundary / FKDA_CHUNK : run_end;
    for (; chunk < stretch_end; ++chunk) {
      cp_async_wait<FKDA_RECURRENCE_STAGES - 2>();
      // The chunk's stage is complete for every thread, and every warp is done
      // with the stage that the next issue overwrites (the one of chunk - 1).
      __syncthreads();
      issue();
      const uint32_t stage = stages + int(chunk % FKDA_RECURRENCE_STAGES) * kStageBytes;
      uint32_t sh[8][4], uh[4], mqk[4];
      advance_state(stage, smem + (stage - stages), at, t, S, sh, uh, mqk);
      // Transitions write no output.
      if constexpr (kMode != kTransition) {
        write_chunk_output(stage, at, lane, sh, uh, mqk, out_tile, out_row, p.call.out.stride_t, seq, chunk);
      }
    }
    if (!checkpoint_here) break;
    store_checkpoint(p, run, head_offset, e0, g, t, S, checkpoint);
  }
  // Drain the empty trailing groups before the block's shared memory goes away.
  cp_async_wait<0>();

  // ---- the final state, carry or segment record ----------------------------
  if (to.final != nullptr) store_state(to, e0, g, t, S);
}

}  // namespace fkda_dev

// One kernel per V split, so that thread counts and tile widths are
// constants, each in two forms: plain (contiguous states or none) and
// serving (pool slots, has_initial_state, checkpoints). A window's chain of
// chunks leaves most of each multiprocessor idle, so when the next window's
// preparation follows (overlap_next) it may start on what is left at once:
// it writes the other half of the double-buffered records and reads
// nothing this window writes.
#define FKDA_DEFINE_RECURRENCE(vsplit)                                              \
  extern "C" __global__ void __launch_bounds__(256 / (vsplit), 1)                   \
      fkda_prefill_chunk_recurrence_v##vsplit(const FkdaPrefillParams p) {          \
    if (p.overlap_next) fkda_dev::allow_dependent_launch();                         \
    fkda_dev::chunk_recurrence<vsplit, false>(p);                                   \
  }                                                                                 \
  extern "C" __global__ void __launch_bounds__(256 / (vsplit), 1)                   \
      fkda_prefill_chunk_recurrence_serving_v##vsplit(const FkdaPrefillParams p) {  \
    if (p.overlap_next) fkda_dev::allow_dependent_launch();                         \
    fkda_dev::chunk_recurrence<vsplit, true>(p);                                    \
  }
FKDA_DEFINE_RECURRENCE(1)
FKDA_DEFINE_RECURRENCE(2)
FKDA_DEFINE_RECURRENCE(4)
FKDA_DEFINE_RECURRENCE(8)
#undef FKDA_DEFINE_RECURRENCE

// The two passes of chunk-parallel prefill around the scan, in the serving
// form only (the chunk-parallel calls are long and few; registers are not
// what limits them), for the V splits that give a segment enough warps to
// share its records: 1 and 2. The transition pass has 2 * vsplit blocks
// along z.
#define FKDA_DEFINE_SEGMENT_PASSES(vsplit)                                           \
  extern "C" __global__ void __launch_bounds__(256 / (vsplit), 1)                    \
      fkda_prefill_segment_transitions_v##vsplit(const FkdaPrefillParams p) {        \
    fkda_dev::chunk_recurrence<vsplit, true, fkda_dev::kTransition>(p);              \
  }                                                                                  \
  extern "C" __global__ void __launch_bounds__(256 / (vsplit), 1)                    \
      fkda_prefill_segment_recurrence_v##vsplit(const FkdaPrefillParams p) {         \
    fkda_dev::chunk_recurrence<vsplit, true, fkda_dev::kSegment>(p);                 \
  }
FKDA_DEFINE_SEGMENT_PASSES(1)
FKDA_DEFINE_SEGMENT_PASSES(2)
#undef FKDA_DEFINE_SEGMENT_PASSES
