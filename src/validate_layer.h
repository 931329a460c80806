/* SPDX-License-Identifier: MIT */
// The checks of fkda_layer_step (flashkda.h, "The layer step around the
// recurrence"), one set for fkda_fwd and fkda_decode: each call says what
// it allows and which rows its conv states have, and adds the layer's
// tensors to its own memory, residency and GPU row checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkda.h"
#include "plan.h"
#include "prefill_problem.h"
#include "validate_checks.h"

namespace fkda::checks {

// What the layer step's checks need to know of the call around it.
struct LayerCall {
  int64_t batch = 0, tokens = 0;  // B and T of q
  // Rows of the conv states, and what they are for messages ("the pool's
  // slots, as the call takes state_indices", "one per sequence").
  int64_t conv_state_rows = 0;
  const char* rows_are = "";
  // A call that cannot take the convolution: the status and why, refused
  // naming layer.conv_weight_q (FKDA_SUCCESS: the convolution is allowed).
  fkda_status conv_refusal = FKDA_SUCCESS;
  const char* conv_refusal_reason = "";
  // A call that cannot take conv states (refused naming layer.conv_state_q); null: allowed.
  const char* conv_state_refusal = nullptr;
};

// Checks every field of `layer` (absent parts pass) and returns it as the
// backends read it.
LayerStep check_layer_step(const Plan& plan, const fkda_layer_step& layer, const LayerCall& call);

// The call's own operands, pointers and GPU rows followed by the layer's:
// for check_no_shared_memory (the conv states written, the rest read),
// check_residency and check_gpu_rows (out_gate, whose rows the kernels move
// like v's).
ArgList<Operand> with_layer_operands(ArgList<Operand> operands, const fkda_layer_step& layer);
ArgList<Located> with_layer_pointers(ArgList<Located> pointers, const fkda_layer_step& layer);
ArgList<Named> with_layer_rows(ArgList<Named> tensors, const fkda_layer_step& layer);

}  // namespace fkda::checks
