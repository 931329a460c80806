/* SPDX-License-Identifier: MIT */
// The layer step around the recurrence on the CPU (flashkda.h, "The layer
// step around the recurrence"): the causal depthwise convolution of q, k and
// v with its SiLU and conv states, and the output gate. fkda_fwd convolves
// every sequence before the recurrence, rounding into the bf16 staging area
// it then reads, and gates the bf16 output after it; fkda_decode convolves
// and gates inside each (sequence, head), in f32.
#pragma once

#include <cstdint>
#include <vector>

#include "decode_problem.h"
#include "layer_step.h"
#include "prefill_problem.h"

namespace fkda::cpu {

constexpr int kMaxConvWidth = 4;

// fkda_fwd, before the recurrence: every real sequence's q, k and v
// convolved and rounded to bf16 into the staging area, then its conv state
// and the conv states of its checkpoints into pool slots written. A sequence
// reads its own conv state row before it writes any row.
void convolve_prefill(const PrefillProblem& problem, const ConvStaging& staging);

// fkda_fwd, after the recurrence: the output gate on every real sequence's
// bf16 output rows, in place. Padding rows stay zero.
void gate_prefill_output(const PrefillProblem& problem);

// fkda_decode's scratch for one worker: the convolved rows of one
// (sequence, head) and the convolution's sliding inputs.
struct DecodeConvScratch {
  std::vector<float> convolved;  // [3][kMaxDecodeTokens][K]: q, k, v
  std::vector<float> windows;    // [K][kMaxConvWidth]
  std::vector<float> values;     // [K]
  explicit DecodeConvScratch(int head_dim_k);
  float* row(int projection, int64_t token, int head_dim_k) {
    return &convolved[(size_t(projection) * kMaxDecodeTokens + size_t(token)) * size_t(head_dim_k)];
  }
};

// fkda_decode, one (sequence, head) with tokens [begin, begin + length) of
// batch row `batch_row`, starting from pool slot `slot`: the head's K
// channels of q, k and v convolved in f32 into `scratch`, the slot's conv
// state read and then written.
void convolve_decode_head(const DecodeProblem& problem, int32_t head, int64_t batch_row, int64_t begin,
                          int64_t length, int64_t slot, DecodeConvScratch& scratch);

// The output gate of one head's row of V f32 outputs, in place: RMSNorm
// over the row, times the norm weight and sigmoid of `gate` (bf16 bits).
void gate_output_row(const LayerStep& layer, const uint16_t* gate, int V, float* row);

// The out_gate row of (batch_row, token, head).
const uint16_t* out_gate_row(const LayerStep& layer, int64_t batch_row, int64_t token, int32_t head);

}  // namespace fkda::cpu
