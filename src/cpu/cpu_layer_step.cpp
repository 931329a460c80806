// SPDX-License-Identifier: MIT
// The layer step on the CPU (cpu_layer_step.h). The convolution of one
// (sequence, head) keeps, per channel, a window of its last W inputs: before
// the first token the last columns of the conv state (or zeros), then each
// token's raw input pushed in at the end. The window after token t is
// what the conv state holds after t + 1 tokens, so the final state and the
// checkpoints are its last Wc values, and a sequence shorter than Wc keeps
// the old state's newest columns without reading them twice.
#include "cpu/cpu_layer_step.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/cpu_chunks.h"
#include "cpu/cpu_rounding.h"
#include "flashkda.h"

namespace fkda::cpu {
namespace {

constexpr int64_t kChunkTokens = 16;

// Element `offset` of a bf16 or f32 tensor, widened to f32.
float element(const void* data, int32_t dtype, int64_t offset) {
  if (dtype == FKDA_DTYPE_BF16) return float_of_bf16(static_cast<const uint16_t*>(data)[offset]);
  return static_cast<const float*>(data)[offset];
}

// `value` into a bf16 (rounded to nearest even) or f32 tensor.
void store(void* data, int32_t dtype, int64_t offset, float value) {
  if (dtype == FKDA_DTYPE_BF16) {
    static_cast<uint16_t*>(data)[offset] = bf16_bits_of(value);
  } else {
    static_cast<float*>(data)[offset] = value;
  }
}

int64_t row_offset(const ActView& view, int64_t batch_row, int64_t token, int32_t head) {
  return batch_row * view.stride_b + token * view.stride_t + int64_t(head) * view.stride_h;
}

float silu(float x) { return x / (1.f + std::exp(-x)); }
float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// One (sequence, head) of a call's convolution: tokens [begin, begin +
// length) of batch row `batch_row`, its conv state row (-1: the call passed
// no conv states) and whether it starts from that row or from zeros.
struct ConvTask {
  int64_t seq = 0;
  int32_t head = 0;
  int64_t batch_row = 0, begin = 0, length = 0;
  int64_t state_row = -1;
  bool reads_state = false;
};

int64_t state_offset(const ConvView& conv, int64_t row, int64_t channel, int64_t column) {
  return row * conv.state_stride_row + channel * conv.state_stride_c + column * conv.state_stride_w;
}

// The windows before the task's first token: column Wc - W + j of the conv
// state at window[j] (columns before the state's first are never convolved
// and read as zeros), or zeros when the task does not read its state.
void load_windows(const LayerStep& layer, const ConvView& conv, const ConvTask& task, int K, float* windows) {
  const int W = layer.conv_width, Wc = layer.conv_state_width;
  for (int i = 0; i < K; ++i) {
    const int64_t channel = int64_t(task.head) * K + i;
    float* window = &windows[size_t(i) * kMaxConvWidth];
    for (int j = 0; j < W; ++j) {
      const int column = Wc - W + j;
      window[j] = task.reads_state && column >= 0
                      ? element(conv.state, layer.conv_state_dtype, state_offset(conv, task.state_row, channel, column))
                      : 0.f;
    }
  }
}

// The last Wc inputs of each window into conv state row `row`.
void store_windows(const LayerStep& layer, const ConvView& conv, int64_t row, int32_t head, int K,
                   const float* windows) {
  const int W = layer.conv_width, Wc = layer.conv_state_width;
  for (int i = 0; i < K; ++i) {
    const int64_t channel = int64_t(head) * K + i;
    const float* window = &windows[size_t(i) * kMaxConvWidth];
    for (int j = 0; j < Wc; ++j) {
      store(conv.state, layer.conv_state_dtype, state_offset(conv, row, channel, j), window[W - Wc + j]);
    }
  }
}

// One token: its K raw inputs pushed into the windows, and the K convolved
// values silu(bias + Σ_j weight[j] · window[j]), summed with fmaf from the
// bias in the order of j.
void convolve_token(const LayerStep& layer, const ConvView& conv, const uint16_t* raw, int32_t head, int K,
                    float* windows, float* values) {
  const int W = layer.conv_width;
  for (int i = 0; i < K; ++i) {
    const int64_t channel = int64_t(head) * K + i;
    float* window = &windows[size_t(i) * kMaxConvWidth];
    for (int j = 0; j + 1 < W; ++j) window[j] = window[j + 1];
    window[W - 1] = float_of_bf16(raw[i]);
    float sum = conv.bias != nullptr ? element(conv.bias, layer.conv_dtype, channel * conv.bias_stride) : 0.f;
    for (int j = 0; j < W; ++j) {
      const float weight =
          element(conv.weight, layer.conv_dtype, channel * conv.weight_stride_c + j * conv.weight_stride_w);
      sum = std::fma(weight, window[j], sum);
    }
    values[i] = silu(sum);
  }
}

const ActView& projection_input(const RecurrenceCall& call, int projection) {
  return projection == 0 ? call.q : projection == 1 ? call.k : call.v;
}

// One projection (0 q, 1 k, 2 v) of one task: emit(t, values) receives the
// K convolved values of token t, after_token(t + 1, windows) sees the
// windows after it; then the task's conv state row is written.
template <typename Emit, typename AfterToken>
void convolve_task(const RecurrenceCall& call, int projection, const ConvTask& task, float* windows, float* values,
                   const Emit& emit, const AfterToken& after_token) {
  const LayerStep& layer = call.layer;
  const ConvView& conv = layer.conv[projection];
  const ActView& input = projection_input(call, projection);
  const int K = call.head_dim_k;
  load_windows(layer, conv, task, K, windows);
  for (int64_t t = 0; t < task.length; ++t) {
    const uint16_t* raw =
        static_cast<const uint16_t*>(input.data) + row_offset(input, task.batch_row, task.begin + t, task.head);
    convolve_token(layer, conv, raw, task.head, K, windows, values);
    emit(t, values);
    after_token(t + 1, windows);
  }
  if (task.state_row >= 0) store_windows(layer, conv, task.state_row, task.head, K, windows);
}

// Where sequence n of a fwd call keeps its conv state and whether it reads
// it: the rows follow the recurrent states (pool slot or sequence), and so
// does the reading (flashkda.h).
struct PrefillSequence {
  bool padding = false;
  int64_t state_row = -1;
  bool reads_state = false;
};

PrefillSequence prefill_sequence(const PrefillProblem& p, int64_t n) {
  PrefillSequence s;
  const bool from_zeros = p.has_initial_state.present() && p.has_initial_state.at(n) == 0;
  bool reads_recurrent_state = false;
  int64_t row = n;
  if (p.state_indices.present()) {
    row = p.state_indices.at(n);
    if (is_null_slot(row, p.null_slot_rule)) {
      s.padding = true;
      return s;
    }
    reads_recurrent_state = !from_zeros;
  } else {
    reads_recurrent_state = p.initial_state != nullptr && !from_zeros;
  }
  if (p.layer.has_conv_state()) {
    s.state_row = row;
    s.reads_state = reads_recurrent_state;
  }
  return s;
}

// The (sequence, head) tasks of a fwd call's real sequences that have tokens.
std::vector<ConvTask> prefill_tasks(const PrefillProblem& p, int64_t* token_heads) {
  std::vector<ConvTask> tasks;
  *token_heads = 0;
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const TokenRange range = sequence_tokens(p.cu_seqlens, p.seq_len, n);
    if (range.length() == 0) continue;  // touches nothing
    const PrefillSequence s = prefill_sequence(p, n);
    if (s.padding) continue;
    for (int32_t h = 0; h < p.num_heads; ++h) {
      tasks.push_back({n, h, range.row, range.begin, range.length(), s.state_row, s.reads_state});
    }
    *token_heads += range.length() * p.num_heads;
  }
  return tasks;
}

// Workers for tasks worth `token_heads` rows of one head.
int64_t layer_workers(size_t tasks, int64_t token_heads) {
  return worker_count(int64_t(tasks), token_heads / kChunkTokens);
}

}  // namespace

void convolve_prefill(const PrefillProblem& p, const ConvStaging& staging) {
  int64_t token_heads = 0;
  const std::vector<ConvTask> tasks = prefill_tasks(p, &token_heads);
  if (tasks.empty()) return;
  const int K = p.head_dim_k;
  const int64_t workers = layer_workers(tasks.size(), token_heads);
  // Allocated before any worker starts, so that no worker can throw.
  std::vector<std::vector<float>> windows(size_t(workers), std::vector<float>(size_t(K) * size_t(kMaxConvWidth)));
  std::vector<std::vector<float>> values(size_t(workers), std::vector<float>(size_t(K), 0.f));
  const ActView staged[3] = {staging.view_of(staging.q), staging.view_of(staging.k), staging.view_of(staging.v)};
  const bool conv_checkpoints = p.checkpoint_slots.present() && p.layer.has_conv_state();

  run_parallel(tasks.size(), workers, [&](int64_t worker, size_t index) {
    const ConvTask& task = tasks[index];
    for (int projection = 0; projection < 3; ++projection) {
      const ActView& to = staged[projection];
      const ConvView& conv = p.layer.conv[projection];
      // The staged view is the workspace's, writable.
      auto round_into_staging = [&](int64_t t, const float* row) {
        uint16_t* out = static_cast<uint16_t*>(const_cast<void*>(to.data)) +
                        row_offset(to, task.batch_row, task.begin + t, task.head);
        for (int i = 0; i < K; ++i) out[i] = bf16_bits_of(row[i]);
      };
      // A checkpoint into a pool slot holds the conv state after its offset.
      auto store_checkpoints = [&](int64_t tokens_done, const float* window_values) {
        if (!conv_checkpoints) return;
        for (int64_t c = 0; c < p.checkpoint_offsets.cols; ++c) {
          if (p.checkpoint_offsets.at(task.seq, c) != tokens_done) continue;
          const int64_t slot = p.checkpoint_slots.at(task.seq, c);
          if (!is_null_slot(slot, p.null_slot_rule)) store_windows(p.layer, conv, slot, task.head, K, window_values);
        }
      };
      convolve_task(p, projection, task, windows[size_t(worker)].data(), values[size_t(worker)].data(),
                    round_into_staging, store_checkpoints);
    }
  });
}

void gate_output_row(const LayerStep& layer, const uint16_t* gate, int V, float* row) {
  float sum = 0.f;
  for (int e = 0; e < V; ++e) sum += row[e] * row[e];
  const float inverse_rms = 1.f / std::sqrt(sum / float(V) + layer.norm_eps);
  for (int e = 0; e < V; ++e) {
    const float weight = element(layer.norm_weight, layer.norm_weight_dtype, e * layer.norm_weight_stride);
    row[e] = row[e] * inverse_rms * weight * sigmoid(float_of_bf16(gate[e]));
  }
}

const uint16_t* out_gate_row(const LayerStep& layer, int64_t batch_row, int64_t token, int32_t head) {
  return static_cast<const uint16_t*>(layer.out_gate.data) + row_offset(layer.out_gate, batch_row, token, head);
}

void gate_prefill_output(const PrefillProblem& p) {
  int64_t token_heads = 0;
  const std::vector<ConvTask> tasks = prefill_tasks(p, &token_heads);
  if (tasks.empty()) return;
  const int V = p.head_dim_v;
  const int64_t workers = layer_workers(tasks.size(), token_heads);
  std::vector<std::vector<float>> rows(size_t(workers), std::vector<float>(size_t(V), 0.f));
  run_parallel(tasks.size(), workers, [&](int64_t worker, size_t index) {
    const ConvTask& task = tasks[index];
    float* row = rows[size_t(worker)].data();
    for (int64_t token = task.begin; token < task.begin + task.length; ++token) {
      // The out view's data is writable; ActView only carries it as const.
      uint16_t* out = static_cast<uint16_t*>(const_cast<void*>(p.out.data)) +
                      row_offset(p.out, task.batch_row, token, task.head);
      for (int e = 0; e < V; ++e) row[e] = float_of_bf16(out[e]);
      gate_output_row(p.layer, out_gate_row(p.layer, task.batch_row, token, task.head), V, row);
      for (int e = 0; e < V; ++e) out[e] = bf16_bits_of(row[e]);
    }
  });
}

DecodeConvScratch::DecodeConvScratch(int head_dim_k)
    : convolved(size_t(3) * kMaxDecodeTokens * size_t(head_dim_k)),
      windows(size_t(head_dim_k) * kMaxConvWidth),
      values(size_t(head_dim_k)) {}

void convolve_decode_head(const DecodeProblem& p, int32_t head, int64_t batch_row, int64_t begin, int64_t length,
                          int64_t slot, DecodeConvScratch& s) {
  ConvTask task;
  task.head = head;
  task.batch_row = batch_row;
  task.begin = begin;
  task.length = length;
  // A decode always starts from its pool slot.
  if (p.layer.has_conv_state()) {
    task.state_row = slot;
    task.reads_state = true;
  }
  const int K = p.head_dim_k;
  for (int projection = 0; projection < 3; ++projection) {
    auto keep = [&](int64_t t, const float* row) {
      std::copy(row, row + K, s.row(projection, t, K));
    };
    convolve_task(p, projection, task, s.windows.data(), s.values.data(), keep, [](int64_t, const float*) {});
  }
}

}  // namespace fkda::cpu
