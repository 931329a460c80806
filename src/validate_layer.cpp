// SPDX-License-Identifier: MIT
// fkda_layer_step's fields, for fkda_fwd and fkda_decode alike (validate_layer.h).
#include "validate_layer.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "dtype_name.h"
#include "error.h"

namespace fkda::checks {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

// The layer's tensors in the struct's order, and whether a call writes them:
// only the conv states are written (in place).
struct LayerTensor {
  fkda_tensor fkda_layer_step::*member;
  const char* name;
  bool written;
};
constexpr LayerTensor kLayerTensors[] = {
    {&fkda_layer_step::conv_weight_q, "layer.conv_weight_q", false},
    {&fkda_layer_step::conv_weight_k, "layer.conv_weight_k", false},
    {&fkda_layer_step::conv_weight_v, "layer.conv_weight_v", false},
    {&fkda_layer_step::conv_bias_q, "layer.conv_bias_q", false},
    {&fkda_layer_step::conv_bias_k, "layer.conv_bias_k", false},
    {&fkda_layer_step::conv_bias_v, "layer.conv_bias_v", false},
    {&fkda_layer_step::conv_state_q, "layer.conv_state_q", true},
    {&fkda_layer_step::conv_state_k, "layer.conv_state_k", true},
    {&fkda_layer_step::conv_state_v, "layer.conv_state_v", true},
    {&fkda_layer_step::out_gate, "layer.out_gate", false},
    {&fkda_layer_step::out_norm_weight, "layer.out_norm_weight", false},
};

// Where each kind starts in kLayerTensors.
constexpr int kWeights = 0, kBiases = 3, kStates = 6, kOutGate = 9, kNormWeight = 10;

// The q, k and v tensors of one kind.
struct Projections {
  const fkda_tensor* tensors[3];
  const char* names[3];
};

Projections projections(const fkda_layer_step& layer, int first) {
  Projections p{};
  for (int i = 0; i < 3; ++i) {
    p.tensors[i] = &(layer.*kLayerTensors[first + i].member);
    p.names[i] = kLayerTensors[first + i].name;
  }
  return p;
}

// Whether the three are given; one or two of them is an error naming the
// first one missing.
bool all_or_none(const Projections& p, const char* what) {
  int given = -1, count = 0;
  for (int i = 0; i < 3; ++i) {
    if (!present(*p.tensors[i])) continue;
    ++count;
    if (given < 0) given = i;
  }
  if (count == 0 || count == 3) return count == 3;
  for (int i = 0; i < 3; ++i) {
    if (present(*p.tensors[i])) continue;
    invalid(std::string(p.names[i]) + ": required tensor is missing (data NULL, rank 0): " + what +
            " come all three or none, and " + p.names[given] + " is given");
  }
  return true;  // not reached
}

// The k and v tensors of a kind take q's dtype.
void check_same_dtype(const Projections& p, int i) {
  const int32_t dtype = p.tensors[0]->dtype, got = p.tensors[i]->dtype;
  if (got != dtype) {
    invalid(std::string(p.names[i]) + ": expected dtype " + dtype_name(dtype) + " (" + p.names[0] + "'s), got " +
            dtype_name(got));
  }
}

ConvView conv_view(const fkda_tensor& weight, const fkda_tensor& bias, const fkda_tensor& state) {
  ConvView view;
  view.weight = weight.data;
  view.weight_stride_c = used_stride(weight, 0);
  view.weight_stride_w = used_stride(weight, 1);
  if (present(bias) && !is_empty(bias)) {
    view.bias = bias.data;
    view.bias_stride = used_stride(bias, 0);
  }
  if (present(state) && !is_empty(state)) {
    view.state = state.data;
    view.state_stride_row = used_stride(state, 0);
    view.state_stride_c = used_stride(state, 1);
    view.state_stride_w = used_stride(state, 2);
  }
  return view;
}

// The convolution's W and Wc (0 without the convolution or without states).
struct ConvWidths {
  int64_t width = 0, state_width = 0;
};

// The convolution's weights, biases and states.
ConvWidths check_convolution(const Plan& plan, const fkda_layer_step& layer, const LayerCall& call) {
  const int64_t channels = int64_t(plan.num_heads) * plan.head_dim_k;
  const Projections weights = projections(layer, kWeights), biases = projections(layer, kBiases),
                    states = projections(layer, kStates);
  ConvWidths widths;
  const bool convolution = all_or_none(weights, "the convolution's weights");
  if (!convolution) {
    for (const Projections* kind : {&biases, &states}) {
      for (int i = 0; i < 3; ++i) {
        if (present(*kind->tensors[i])) {
          invalid(std::string(kind->names[i]) + ": given without the convolution (layer.conv_weight_q, _k and _v "
                  "are absent)");
        }
      }
    }
    return widths;
  }
  if (call.conv_refusal != FKDA_SUCCESS) {
    fail(call.conv_refusal, std::string("layer.conv_weight_q: ") + call.conv_refusal_reason);
  }

  check_tensor(*weights.tensors[0], weights.names[0], {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {channels, kAny},
               Strides::kFree);
  widths.width = weights.tensors[0]->shape[1];
  if (widths.width < 2 || widths.width > 4) {
    invalid("layer.conv_weight_q: expected a width W of 2, 3 or 4 on axis 1, got shape " +
            join(weights.tensors[0]->shape, 2));
  }
  const int32_t dtype = weights.tensors[0]->dtype;
  for (int i = 1; i < 3; ++i) {
    check_same_dtype(weights, i);
    check_tensor(*weights.tensors[i], weights.names[i], {dtype}, {channels, widths.width}, Strides::kFree);
  }

  if (all_or_none(biases, "the biases")) {
    for (int i = 0; i < 3; ++i) {
      if (biases.tensors[i]->dtype != dtype) {
        invalid(std::string(biases.names[i]) + ": expected dtype " + dtype_name(dtype) +
                " (the conv weights'), got " + dtype_name(biases.tensors[i]->dtype));
      }
      check_tensor(*biases.tensors[i], biases.names[i], {dtype}, {channels}, Strides::kFree);
    }
  }

  if (all_or_none(states, "the conv states")) {
    if (call.conv_state_refusal != nullptr) invalid(std::string("layer.conv_state_q: ") + call.conv_state_refusal);
    const fkda_tensor& first = *states.tensors[0];
    check_tensor(first, states.names[0], {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {kAny, channels, kAny}, Strides::kFree);
    if (first.shape[0] != call.conv_state_rows) {
      invalid("layer.conv_state_q: expected " + str(call.conv_state_rows) + " rows on axis 0 (" + call.rows_are +
              "), got shape " + join(first.shape, 3));
    }
    widths.state_width = first.shape[2];
    if (widths.state_width != widths.width - 1 && widths.state_width != widths.width) {
      invalid("layer.conv_state_q: expected a width of W - 1 = " + str(widths.width - 1) + " or W = " +
              str(widths.width) + " on axis 2 (W of layer.conv_weight_q), got shape " + join(first.shape, 3));
    }
    for (int i = 0; i < 3; ++i) {
      if (i > 0) {
        check_same_dtype(states, i);
        check_tensor(*states.tensors[i], states.names[i], {first.dtype},
                     {call.conv_state_rows, channels, widths.state_width}, Strides::kFree);
      }
      check_no_overlap(*states.tensors[i], states.names[i]);
    }
  }
  return widths;
}

void check_output_gate(const Plan& plan, const fkda_layer_step& layer, const LayerCall& call) {
  const char* gate_name = kLayerTensors[kOutGate].name;
  const char* weight_name = kLayerTensors[kNormWeight].name;
  if (!present(layer.out_gate)) {
    if (present(layer.out_norm_weight)) invalid(std::string(weight_name) + ": given without " + gate_name);
    return;
  }
  const int64_t H = plan.num_heads, V = plan.head_dim_v;
  check_tensor(layer.out_gate, gate_name, {FKDA_DTYPE_BF16}, {call.batch, call.tokens, H, V}, Strides::kRows);
  if (!present(layer.out_norm_weight)) {
    invalid(std::string(weight_name) + ": required tensor is missing (data NULL, rank 0): " + gate_name +
            " is given, and the RMSNorm before it takes its weight");
  }
  check_tensor(layer.out_norm_weight, weight_name, {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}, {V}, Strides::kFree);
  if (!std::isfinite(layer.out_norm_eps) || !(layer.out_norm_eps > 0.f)) {
    invalid("layer.out_norm_eps: must be finite and > 0, got " + std::to_string(layer.out_norm_eps));
  }
}

}  // namespace

LayerStep check_layer_step(const Plan& plan, const fkda_layer_step& layer, const LayerCall& call) {
  if (layer.reserved != 0) invalid("layer.reserved: must be 0, got " + str(layer.reserved));
  const ConvWidths widths = check_convolution(plan, layer, call);
  check_output_gate(plan, layer, call);

  LayerStep step;
  if (widths.width > 0) {
    step.conv_width = int32_t(widths.width);
    step.conv_state_width = int32_t(widths.state_width);
    step.conv_dtype = layer.conv_weight_q.dtype;
    step.conv_state_dtype = widths.state_width > 0 ? layer.conv_state_q.dtype : 0;
    const Projections weights = projections(layer, kWeights), biases = projections(layer, kBiases),
                      states = projections(layer, kStates);
    for (int i = 0; i < 3; ++i) step.conv[i] = conv_view(*weights.tensors[i], *biases.tensors[i], *states.tensors[i]);
  }
  if (present(layer.out_gate)) {
    step.out_gate = act_view(layer.out_gate);
    step.norm_weight = layer.out_norm_weight.data;
    step.norm_weight_dtype = layer.out_norm_weight.dtype;
    step.norm_weight_stride = used_stride(layer.out_norm_weight, 0);
    step.norm_eps = layer.out_norm_eps;
  }
  return step;
}

namespace {

// Whether the three conv states are the q, k and v channel blocks of one
// [rows, 3*H*K, Wc] tensor, as a runtime keeps them: the same dtype, shape
// and strides, k's data H*K channels after q's and v's 2*H*K after. `whole`
// is then that tensor. Such views interleave in memory without sharing an
// element when the whole tensor maps no two elements to one address.
bool conv_states_of_one_tensor(const fkda_layer_step& layer, fkda_tensor* whole) {
  const fkda_tensor &q = layer.conv_state_q, &k = layer.conv_state_k, &v = layer.conv_state_v;
  if (!present(q) || is_empty(q)) return false;
  for (const fkda_tensor* t : {&k, &v}) {
    if (t->dtype != q.dtype || t->rank != 3) return false;
    for (int a = 0; a < 3; ++a)
      if (t->shape[a] != q.shape[a] || t->strides[a] != q.strides[a]) return false;
  }
  const intptr_t block = intptr_t(q.shape[1] * q.strides[1] * int64_t(element_bytes(q.dtype)));
  const intptr_t base = reinterpret_cast<intptr_t>(q.data);
  if (reinterpret_cast<intptr_t>(k.data) - base != block || reinterpret_cast<intptr_t>(v.data) - base != 2 * block) {
    return false;
  }
  *whole = q;
  whole->shape[1] = 3 * q.shape[1];
  check_no_overlap(*whole, "layer.conv_state_q");
  return true;
}

}  // namespace

ArgList<Operand> with_layer_operands(ArgList<Operand> operands, const fkda_layer_step& layer) {
  fkda_tensor whole_states = FKDA_TENSOR_NONE;
  const bool one_state_tensor = conv_states_of_one_tensor(layer, &whole_states);
  for (const LayerTensor& t : kLayerTensors) {
    const bool state = &(layer.*t.member) == &layer.conv_state_q || &(layer.*t.member) == &layer.conv_state_k ||
                       &(layer.*t.member) == &layer.conv_state_v;
    if (one_state_tensor && state) continue;
    operands.push_back(Operand::tensor(layer.*t.member, t.name, t.written));
  }
  // The three views as the one tensor they share, checked against the rest.
  if (one_state_tensor) operands.push_back(Operand::tensor(whole_states, "layer.conv_state_q", true));
  return operands;
}

ArgList<Located> with_layer_pointers(ArgList<Located> pointers, const fkda_layer_step& layer) {
  for (const LayerTensor& t : kLayerTensors) pointers.push_back({(layer.*t.member).data, t.name});
  return pointers;
}

ArgList<Named> with_layer_rows(ArgList<Named> tensors, const fkda_layer_step& layer) {
  tensors.push_back({&layer.out_gate, kLayerTensors[kOutGate].name});
  return tensors;
}

}  // namespace fkda::checks
