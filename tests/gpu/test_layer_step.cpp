// SPDX-License-Identifier: MIT
// The layer step on the GPU (flashkda.h, "The layer step around the
// recurrence"): the same fkda_fwd and fkda_decode calls with a convolution
// and an output gate on a GPU plan and on a CPU plan, whose layer step the
// unit tests hold to the fp64 whole step. The raw projections are views into
// one packed [T, 3*H*K] buffer and the conv states views into one pool (one
// case channel-last), so strides are exercised; slots are scattered, with a
// padding sequence. Sequences are shorter than W, empty, and end part way
// through either half of a chunk, so that the preparation kernel's
// convolution of q and k reaches back into conv states, raw tokens of the
// chunk before and zeros. Outputs and pools start poisoned; conv states are
// copies of raw inputs and must agree bit for bit, the output and the
// recurrent states to the accuracy of two backends.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"

namespace {

using namespace fkda_ref;

constexpr int64_t kDim = 128;
// GPU against CPU: each backend is within 3e-3 (prefill) / 2e-3 (decode)
// of fp64, so they agree to the sum.
constexpr double kFwdOut = 6e-3;
constexpr double kDecodeOut = 4e-3;
constexpr double kState = 2e-3;
constexpr double kDecodeState = 2e-6;  // f32 pool, the decode's exact arithmetic
// bf16 pool: both round the same f32 state, so they differ where a value
// sits next to a rounding boundary, by one bf16 step (2^-8 relative).
constexpr double kDecodeBf16State = 2e-3;

struct LayerCase {
  std::string name;
  std::vector<int64_t> lengths;  // packed with cu_seqlens; empty: B rows of T tokens
  int64_t B = 0, T = 0;
  int64_t H = 2;
  int32_t width = 4, state_width = 3;
  fkda_dtype weight_dtype = FKDA_DTYPE_F32;
  fkda_dtype conv_state_dtype = FKDA_DTYPE_BF16;
  bool bias = true;
  bool channel_last = false;  // conv states [slots, Wc, 3*H*K]
  bool states = true;         // conv states passed
  bool conv = true;
  bool gate = true;
  int32_t gate_mode = FKDA_GATE_BOUNDED;
  bool g_f32 = false;  // LOG_DECAY only
  bool checkpoints = false;  // fwd: a checkpoint at 16 tokens to a pool slot
  bool fresh_first = false;  // fwd: has_initial_state (bool), 0 for sequence 0
  fkda_null_slot_rule null_slot_rule = FKDA_NULL_SLOT_NEGATIVE;
  int64_t window_slots = 0;  // the plan's (fwd)
  int32_t vsplit = 0;        // the plan's (fwd); 0: automatic
  int32_t chunk_parallel = FKDA_CHUNK_PARALLEL_AUTO;  // the plan's (fwd)
  bool pool_states = true;   // fwd: states in the pool by slot; else contiguous [N, H, V, K], in place
  fkda_dtype pool_dtype = FKDA_DTYPE_F32;  // the recurrent states' pool
  fkda_state_layout layout = FKDA_STATE_LAYOUT_VK;
  uint64_t seed = 7;
};

// Host bytes of one buffer, and where the backend under test sees them.
struct Bytes {
  std::vector<unsigned char> host;
  DeviceBuffer device;
  void* at(bool gpu) { return gpu ? device.get() : host.data(); }
  template <typename T>
  explicit Bytes(const std::vector<T>& values)
      : host(reinterpret_cast<const unsigned char*>(values.data()),
             reinterpret_cast<const unsigned char*>(values.data()) + values.size() * sizeof(T)),
        device(host) {}
  void download() { check_cuda(cudaMemcpy(host.data(), device.get(), host.size(), cudaMemcpyDeviceToHost), "copy"); }
};

std::vector<float> random_floats(size_t count, uint64_t seed, float scale) {
  const std::vector<uint16_t> bits = quick_normals(count, seed);
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = from_bf16(bits[i]) * scale;
  return values;
}

std::vector<uint16_t> as_bf16(const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = to_bf16(values[i]);
  return bits;
}

fkda_tensor strided(void* data, fkda_dtype dtype, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  fkda_tensor t = FKDA_TENSOR_NONE;
  t.data = data;
  t.dtype = dtype;
  t.rank = int32_t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

size_t element_bytes(fkda_dtype dtype) { return dtype == FKDA_DTYPE_F32 ? 4 : 2; }

// Everything one case reads and writes, on both sides.
struct LayerSetup {
  LayerCase c;
  Problem p;
  int64_t slots = 0, channels = 0;
  std::vector<int64_t> indices;  // pool slot of each sequence, one null
  Bytes projections, g, beta, A_log, dt_bias, cu_seqlens, out, pool, weights, biases, conv_states, out_gate,
      norm_weight, state_indices, checkpoint_offsets, checkpoint_slots, has_initial_state;

  static std::vector<uint16_t> packed_projections(const Problem& p) {
    const int64_t rows = p.B * p.T, width = p.H * kDim;
    std::vector<uint16_t> packed(size_t(rows * 3 * width));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(&packed[size_t(r * 3 * width)], &p.q[size_t(r * width)], size_t(width) * 2);
      std::memcpy(&packed[size_t(r * 3 * width + width)], &p.k[size_t(r * width)], size_t(width) * 2);
      std::memcpy(&packed[size_t(r * 3 * width + 2 * width)], &p.v[size_t(r * width)], size_t(width) * 2);
    }
    return packed;
  }
  static Problem make_problem(const LayerCase& c) {
    ProblemShape shape;
    shape.H = c.H;
    shape.lengths = c.lengths;
    shape.B = c.lengths.empty() ? c.B : 1;
    shape.T = c.T;
    shape.gate_mode = c.gate_mode;
    shape.with_initial_state = false;
    const Problem p = random_problem(slow_decay(shape), c.seed);
    return c.g_f32 ? as_log_decay(p, true) : p;
  }
  // g as the call passes it: f32 where the problem has it so.
  static std::vector<unsigned char> g_bytes(const Problem& p) {
    const unsigned char* data = p.g_f32.empty() ? reinterpret_cast<const unsigned char*>(p.g.data())
                                                : reinterpret_cast<const unsigned char*>(p.g_f32.data());
    const size_t bytes = p.g_f32.empty() ? p.g.size() * 2 : p.g_f32.size() * 4;
    return std::vector<unsigned char>(data, data + bytes);
  }
  static std::vector<float> weight_values(const LayerCase& c, int64_t channels, uint64_t seed) {
    return random_floats(size_t(3 * channels * c.width), seed, 0.5f);
  }
  static std::vector<unsigned char> in_dtype(const std::vector<float>& values, fkda_dtype dtype) {
    std::vector<unsigned char> bytes(values.size() * element_bytes(dtype));
    if (dtype == FKDA_DTYPE_F32) {
      std::memcpy(bytes.data(), values.data(), bytes.size());
    } else {
      const std::vector<uint16_t> bits = as_bf16(values);
      std::memcpy(bytes.data(), bits.data(), bytes.size());
    }
    return bytes;
  }

  explicit LayerSetup(const LayerCase& lc)
      : c(lc),
        p(make_problem(lc)),
        slots(p.num_seqs() + 3),
        channels(lc.H * kDim),
        projections(packed_projections(p)),
        g(g_bytes(p)),
        beta(p.beta),
        A_log(p.A_log.empty() ? std::vector<float>(1) : p.A_log),
        dt_bias(p.dt_bias.empty() ? std::vector<float>(1) : p.dt_bias),
        cu_seqlens(p.cu_seqlens),
        out(std::vector<uint16_t>(p.q.size(), 0xFFFF)),
        pool(in_dtype(random_floats(size_t(slots * lc.H * kDim * kDim), lc.seed + 1, 0.5f), lc.pool_dtype)),
        weights(in_dtype(weight_values(lc, channels, lc.seed + 2), lc.weight_dtype)),
        biases(in_dtype(random_floats(size_t(3 * channels), lc.seed + 3, 0.3f), lc.weight_dtype)),
        conv_states(in_dtype(random_floats(size_t(slots * 3 * channels * lc.state_width), lc.seed + 4, 1.f),
                             lc.conv_state_dtype)),
        out_gate(quick_normals(p.q.size(), lc.seed + 5)),
        norm_weight(random_floats(size_t(kDim), lc.seed + 6, 1.f)),
        state_indices(std::vector<int64_t>{}),
        checkpoint_offsets(std::vector<int64_t>{}),
        checkpoint_slots(std::vector<int64_t>{}),
        has_initial_state(std::vector<uint8_t>{}) {
    const int64_t N = p.num_seqs();
    // Sequence n at slot slots - 1 - n; sequence 2 is padding (null slot -1).
    for (int64_t n = 0; n < N; ++n) indices.push_back(n == 2 ? -1 : slots - 1 - n);
    state_indices = Bytes(indices);
    std::vector<int64_t> offsets(size_t(N), -1), checkpoint_to(size_t(N), -1);
    offsets[0] = 16;
    checkpoint_to[0] = 0;  // slot 0 is no sequence's
    checkpoint_offsets = Bytes(offsets);
    checkpoint_slots = Bytes(checkpoint_to);
    std::vector<uint8_t> flags(size_t(N), 1);
    flags[0] = 0;
    has_initial_state = Bytes(flags);
  }

  // The three [H*K, W] weight views (or [H*K] biases) into the packed buffer.
  fkda_tensor weight(bool gpu, int proj) {
    auto* base = static_cast<unsigned char*>(weights.at(gpu)) + size_t(proj * channels * c.width) * element_bytes(c.weight_dtype);
    return strided(base, c.weight_dtype, {channels, c.width}, {c.width, 1});
  }
  fkda_tensor bias(bool gpu, int proj) {
    auto* base = static_cast<unsigned char*>(biases.at(gpu)) + size_t(proj * channels) * element_bytes(c.weight_dtype);
    return strided(base, c.weight_dtype, {channels}, {1});
  }
  // [slots, 3*H*K, Wc], or channel-last [slots, Wc, 3*H*K], viewed per
  // projection; without the pool, its first N rows (one per sequence).
  fkda_tensor conv_state(bool gpu, int proj) {
    const int64_t all = 3 * channels;
    const int64_t rows = c.pool_states ? slots : p.num_seqs();
    auto* base = static_cast<unsigned char*>(conv_states.at(gpu));
    if (c.channel_last) {
      return strided(base + size_t(proj * channels) * element_bytes(c.conv_state_dtype), c.conv_state_dtype,
                     {rows, channels, c.state_width}, {all * c.state_width, 1, all});
    }
    return strided(base + size_t(proj * channels * c.state_width) * element_bytes(c.conv_state_dtype),
                   c.conv_state_dtype, {rows, channels, c.state_width}, {all * c.state_width, c.state_width, 1});
  }
  // q, k, v: views into the packed [T, 3*H*K] buffer.
  void set_projections(bool gpu, fkda_tensor& q, fkda_tensor& k, fkda_tensor& v) {
    const int64_t all = 3 * channels;
    auto* base = static_cast<uint16_t*>(projections.at(gpu));
    const std::vector<int64_t> shape = {p.B, p.T, p.H, kDim};
    const std::vector<int64_t> strides = {p.T * all, all, kDim, 1};
    q = strided(base, FKDA_DTYPE_BF16, shape, strides);
    k = strided(base + channels, FKDA_DTYPE_BF16, shape, strides);
    v = strided(base + 2 * channels, FKDA_DTYPE_BF16, shape, strides);
  }
  fkda_layer_step layer(bool gpu) {
    fkda_layer_step l = FKDA_LAYER_STEP_INIT;
    if (c.conv) {
      l.conv_weight_q = weight(gpu, 0);
      l.conv_weight_k = weight(gpu, 1);
      l.conv_weight_v = weight(gpu, 2);
      if (c.bias) {
        l.conv_bias_q = bias(gpu, 0);
        l.conv_bias_k = bias(gpu, 1);
        l.conv_bias_v = bias(gpu, 2);
      }
      if (c.states) {
        l.conv_state_q = conv_state(gpu, 0);
        l.conv_state_k = conv_state(gpu, 1);
        l.conv_state_v = conv_state(gpu, 2);
      }
    }
    if (c.gate) {
      l.out_gate = tensor(out_gate.at(gpu), FKDA_DTYPE_BF16, {p.B, p.T, p.H, kDim});
      l.out_norm_weight = tensor(norm_weight.at(gpu), FKDA_DTYPE_F32, {kDim});
      l.out_norm_eps = 1e-5f;
    }
    return l;
  }
  Buffers buffers(bool gpu) {
    Buffers b{nullptr, nullptr, nullptr, g.at(gpu), beta.at(gpu), A_log.at(gpu), dt_bias.at(gpu), out.at(gpu)};
    b.cu_seqlens = p.cu_seqlens.empty() ? nullptr : cu_seqlens.at(gpu);
    return b;
  }
  fkda_tensor pool_tensor(bool gpu) { return tensor(pool.at(gpu), c.pool_dtype, {slots, p.H, kDim, kDim}); }

  fkda_fwd_args fwd_args(bool gpu) {
    fkda_fwd_args a = make_args(p, buffers(gpu), FKDA_DTYPE_F32);
    set_projections(gpu, a.q, a.k, a.v);
    if (c.pool_states) {
      a.state_pool = pool_tensor(gpu);
      a.state_indices = tensor(state_indices.at(gpu), FKDA_DTYPE_I64, {p.num_seqs()});
      if (c.checkpoints) {
        a.checkpoint_offsets = tensor(checkpoint_offsets.at(gpu), FKDA_DTYPE_I64, {p.num_seqs(), 1});
        a.checkpoint_slots = tensor(checkpoint_slots.at(gpu), FKDA_DTYPE_I64, {p.num_seqs(), 1});
      }
      if (c.fresh_first) a.has_initial_state = tensor(has_initial_state.at(gpu), FKDA_DTYPE_BOOL, {p.num_seqs()});
    } else {
      // The pool's first N matrices as sequence n's state, without
      // indices: the plain forms of the kernels.
      a.initial_state = tensor(pool.at(gpu), c.pool_dtype, {p.num_seqs(), p.H, kDim, kDim});
      a.final_state = a.initial_state;
    }
    a.layer = layer(gpu);
    return a;
  }
  fkda_decode_args decode_args(bool gpu) {
    fkda_decode_args a = make_decode_args(p, buffers(gpu));
    set_projections(gpu, a.q, a.k, a.v);
    a.state_pool = pool_tensor(gpu);
    a.state_indices = tensor(state_indices.at(gpu), FKDA_DTYPE_I64, {p.num_seqs()});
    a.layer = layer(gpu);
    return a;
  }
};

struct Outcome {
  std::vector<float> out;
  std::vector<float> pool;
  std::vector<unsigned char> conv_states;
};

fkda_plan_desc layer_plan(const LayerSetup& s, fkda_backend backend) {
  fkda_plan_desc desc =
      plan_desc(s.p.H, s.p.lower_bound, s.c.pool_dtype, s.c.layout, backend, s.c.null_slot_rule);
  apply_gate(s.p, &desc);
  desc.layer_step = 1;
  desc.window_slots = s.c.window_slots;
  desc.vsplit = s.c.vsplit;
  desc.chunk_parallel = s.c.chunk_parallel;
  return desc;
}

// One call on one backend, from a fresh copy of the case's inputs.
template <typename Call>
Outcome run(const LayerCase& c, bool gpu, const Call& call) {
  LayerSetup s(c);
  const fkda_plan_desc desc = layer_plan(s, gpu ? FKDA_BACKEND_GPU : FKDA_BACKEND_CPU);
  fkda_plan_t plan = nullptr;
  FKDA_REQUIRE(fkda_plan_create(&desc, &plan));
  call(s, plan, gpu);
  fkda_plan_destroy(plan);
  if (gpu) {
    CUDA_REQUIRE(cudaDeviceSynchronize());
    s.out.download();
    s.pool.download();
    s.conv_states.download();
  }
  Outcome o;
  std::vector<uint16_t> out_bits(s.p.q.size());
  std::memcpy(out_bits.data(), s.out.host.data(), s.out.host.size());
  o.out = bf16_to_float(out_bits);
  if (c.pool_dtype == FKDA_DTYPE_F32) {
    o.pool.resize(s.pool.host.size() / 4);
    std::memcpy(o.pool.data(), s.pool.host.data(), s.pool.host.size());
  } else {
    std::vector<uint16_t> bits(s.pool.host.size() / 2);
    std::memcpy(bits.data(), s.pool.host.data(), s.pool.host.size());
    o.pool = bf16_to_float(bits);
  }
  o.conv_states = s.conv_states.host;
  return o;
}

void fwd_call(LayerSetup& s, fkda_plan_t plan, bool gpu) {
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan, s.p.B * s.p.T, s.p.num_seqs(), &bytes));
  std::vector<unsigned char> host(bytes + 16);
  DeviceBuffer device(bytes);
  const fkda_fwd_args a = s.fwd_args(gpu);
  FKDA_REQUIRE(fkda_fwd(plan, &a, gpu ? device.get() : host.data(), bytes, nullptr));
  if (gpu) CUDA_REQUIRE(cudaDeviceSynchronize());
}

// fwd_call's call captured in a CUDA graph on a stream of its own, and the
// graph launched once: the windows' programmatic dependents become the
// graph's edges.
void graph_fwd_call(LayerSetup& s, fkda_plan_t plan, bool gpu) {
  if (!gpu) return fwd_call(s, plan, gpu);
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan, s.p.B * s.p.T, s.p.num_seqs(), &bytes));
  DeviceBuffer device(bytes);
  const fkda_fwd_args a = s.fwd_args(gpu);
  fkda_ref::Stream owned;
  const cudaStream_t stream = owned.get();
  const fkda_ref::CapturedCall graph(stream, cudaStreamCaptureModeThreadLocal,
                                     [&] { return fkda_fwd(plan, &a, device.get(), bytes, stream); });
  graph.replay(stream);
  CHECK(launch_report(plan).windows > 3);  // overlapped windows
}

void decode_call(LayerSetup& s, fkda_plan_t plan, bool gpu) {
  const fkda_decode_args a = s.decode_args(gpu);
  FKDA_REQUIRE(fkda_decode(plan, &a, nullptr, 0, nullptr));
}

std::vector<double> widened(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

void compare(const Outcome& gpu, const Outcome& cpu, double out_tolerance, double state_tolerance) {
  for (float x : gpu.out) REQUIRE(std::isfinite(x));  // every row written (poison is NaN)
  CHECK(rel_l2(gpu.out, widened(cpu.out)) <= out_tolerance);
  CHECK(rel_l2(gpu.pool, widened(cpu.pool)) <= state_tolerance);
  CHECK(gpu.conv_states == cpu.conv_states);
}

// One fkda_fwd call of the case on each backend, compared.
void compare_fwd(const LayerCase& c) {
  const Outcome gpu = run(c, true, fwd_call);
  const Outcome cpu = run(c, false, fwd_call);
  compare(gpu, cpu, kFwdOut, kState);
}

// One decode call of the case on each backend, compared.
void compare_decode(const LayerCase& c) {
  const Outcome gpu = run(c, true, decode_call);
  const Outcome cpu = run(c, false, decode_call);
  compare(gpu, cpu, kDecodeOut, c.pool_dtype == FKDA_DTYPE_F32 ? kDecodeState : kDecodeBf16State);
}

std::vector<LayerCase> fwd_cases() {
  std::vector<LayerCase> cases;
  LayerCase base;
  base.lengths = {37, 0, 70, 2, 130, 1, 29};
  base.name = "W4 Wc3 bf16 states, f32 weights, bias, gate, pool checkpoint";
  base.checkpoints = true;
  cases.push_back(base);
  LayerCase c = base;
  c.name = "W3 Wc3 f32 channel-last states, bf16 weights, no bias, softplus";
  c.width = 3;
  c.weight_dtype = FKDA_DTYPE_BF16;
  c.conv_state_dtype = FKDA_DTYPE_F32;
  c.channel_last = true;
  c.bias = false;
  c.gate_mode = FKDA_GATE_SOFTPLUS;
  cases.push_back(c);
  c = base;
  c.name = "W2 Wc2, no gate, log-decay";
  c.width = 2;
  c.state_width = 2;
  c.gate = false;
  c.gate_mode = FKDA_GATE_LOG_DECAY;
  cases.push_back(c);
  c = base;
  c.name = "W3 Wc2, has_initial_state 0 for one sequence, null slot rule NONPOSITIVE, windows of 3 slots";
  c.width = 3;
  c.state_width = 2;
  c.fresh_first = true;
  c.null_slot_rule = FKDA_NULL_SLOT_NONPOSITIVE;
  c.window_slots = 3;
  cases.push_back(c);
  c = base;
  c.name = "W4 Wc4 f32 states, no bias, log-decay f32 g";
  c.state_width = 4;
  c.conv_state_dtype = FKDA_DTYPE_F32;
  c.bias = false;
  c.gate_mode = FKDA_GATE_LOG_DECAY;
  c.g_f32 = true;
  cases.push_back(c);
  c = base;
  c.name = "W2 Wc1, batch rows without cu_seqlens, three heads, softplus";
  c.lengths = {};
  c.B = 3;
  c.T = 41;
  c.H = 3;
  c.width = 2;
  c.state_width = 1;
  c.gate_mode = FKDA_GATE_SOFTPLUS;
  cases.push_back(c);
  c = base;
  c.name = "W4 without conv states, one head";
  c.states = false;
  c.H = 1;
  cases.push_back(c);
  c = base;
  c.name = "gate only";
  c.conv = false;
  cases.push_back(c);
  return cases;
}

// The layer step on every route of the recurrence: each V split of the
// serial kernels (1 to 8 blocks a head), in the plain form (contiguous
// states, no pool) and the serving form; across windows; and through
// chunk-parallel prefill's segments. Sequences of several chunks, an empty
// one, and ends part way through a chunk.
std::vector<LayerCase> recurrence_route_cases() {
  std::vector<LayerCase> cases;
  LayerCase base;
  base.lengths = {93, 0, 50, 130, 16, 7};
  base.H = 3;
  for (int32_t vsplit : {1, 2, 4, 8}) {
    for (bool pool_states : {false, true}) {
      LayerCase c = base;
      c.vsplit = vsplit;
      c.pool_states = pool_states;
      c.checkpoints = pool_states;
      c.name = "V split " + std::to_string(vsplit) + (pool_states ? ", pool with a checkpoint" : ", contiguous states");
      cases.push_back(c);
    }
  }
  LayerCase c = base;
  // The layer step across windows, each window's recurrence reading its
  // chunks of the convolved v.
  c.name = "V split 2, windows of 3 slots";
  c.vsplit = 2;
  c.window_slots = 3;
  cases.push_back(c);
  c.name = "V split 1, windows of 2 slots, pool with a checkpoint";
  c.vsplit = 1;
  c.window_slots = 2;
  c.pool_states = true;
  c.checkpoints = true;
  cases.push_back(c);
  c = base;
  c.name = "V split 2, windows of 3 slots, gate only";
  c.vsplit = 2;
  c.window_slots = 3;
  c.conv = false;
  cases.push_back(c);
  c = base;
  c.name = "batch rows without cu_seqlens, windows of 3 slots, one head";
  c.lengths = {};
  c.B = 3;
  c.T = 41;
  c.H = 1;
  c.window_slots = 3;
  cases.push_back(c);
  c = base;
  c.name = "chunk-parallel, one long sequence";
  c.lengths = {300, 61};
  c.chunk_parallel = FKDA_CHUNK_PARALLEL_ON;
  cases.push_back(c);
  c.name = "chunk-parallel, one long sequence, contiguous states";
  c.pool_states = false;
  cases.push_back(c);
  return cases;
}

}  // namespace

TEST_CASE("layer step: GPU fkda_fwd matches the CPU backend", "[gpu][layer_step]") {
  for (const LayerCase& c : fwd_cases()) {
    SECTION(c.name) { compare_fwd(c); }
  }
}

TEST_CASE("layer step: every route of the recurrence matches the CPU backend", "[gpu][layer_step]") {
  for (const LayerCase& c : recurrence_route_cases()) {
    SECTION(c.name) { compare_fwd(c); }
  }
}

// The layer step's kernels around overlapped windows, whose preparations
// are programmatic dependents of the recurrences before them: captured in a
// graph, that order is the graph's, and the staged v, the gate and the conv
// states must still come before and after every window.
TEST_CASE("layer step: overlapped windows run from a captured CUDA graph", "[gpu][layer_step]") {
  LayerCase c;
  c.lengths = {93, 0, 50, 130, 16, 7};
  c.H = 3;
  c.vsplit = 2;
  c.window_slots = 3;
  c.checkpoints = true;
  const Outcome gpu = run(c, true, graph_fwd_call);
  const Outcome cpu = run(c, false, graph_fwd_call);
  compare(gpu, cpu, kFwdOut, kState);
}

TEST_CASE("layer step: GPU fkda_decode matches the CPU backend", "[gpu][layer_step]") {
  std::vector<LayerCase> cases;
  for (LayerCase c : fwd_cases()) {
    c.lengths = {1, 1, 3, 0, 2, 1};
    c.checkpoints = false;
    cases.push_back(c);
  }
  LayerCase wide = cases[0];
  wide.name = "W4 Wc4, 16 tokens";
  wide.state_width = 4;
  wide.lengths = {16, 5};
  cases.push_back(wide);
  // More (sequence, head) pairs: the plain kernels' blocks would split a
  // head in fewer of them; the layer kernels' clusters stay at 2 blocks.
  auto lengths_of = [](int count) {
    std::vector<int64_t> lengths;
    for (int i = 0; i < count; ++i) lengths.push_back(i % 7 == 3 ? 0 : 1 + i % 3);
    return lengths;
  };
  LayerCase quarter = cases[0];
  quarter.name = "80 (sequence, head) pairs";
  quarter.H = 4;
  quarter.lengths = lengths_of(20);
  cases.push_back(quarter);
  LayerCase half = cases[1];
  half.name = "280 (sequence, head) pairs, softplus, channel-last f32 states";
  half.H = 4;
  half.lengths = lengths_of(70);
  cases.push_back(half);
  // The pool's other forms: the layer kernels stage each form's rows in
  // shared memory in its own pieces (K x V: four rows of a column each).
  LayerCase bf16_pool = cases[0];
  bf16_pool.name = "bf16 pool";
  bf16_pool.pool_dtype = FKDA_DTYPE_BF16;
  cases.push_back(bf16_pool);
  LayerCase kv_pool = cases[0];
  kv_pool.name = "K x V f32 pool";
  kv_pool.layout = FKDA_STATE_LAYOUT_KV;
  cases.push_back(kv_pool);
  LayerCase kv_bf16_pool = wide;
  kv_bf16_pool.name = "K x V bf16 pool, 16 tokens";
  kv_bf16_pool.pool_dtype = FKDA_DTYPE_BF16;
  kv_bf16_pool.layout = FKDA_STATE_LAYOUT_KV;
  cases.push_back(kv_bf16_pool);
  for (const LayerCase& c : cases) {
    SECTION(c.name) { compare_decode(c); }
  }
}

namespace {

// Batches the streamed kernel's layer form takes (src/gpu/gpu_decode.cpp:
// [N] indices, a V x K pool, conv states with contiguous channels, and at
// least two heads for each block, one a multiprocessor), in each of
// fwd_cases' forms (the channel-last one stays on the plain kernel), with
// sequences of 0 to 16 tokens: one and two come with their stage, longer
// ones read the rest from global memory.
std::vector<LayerCase> streamed_cases() {
  const int64_t H = 12, N = (2 * multiprocessors() + H - 1) / H + 3;
  const int64_t pattern[] = {1, 2, 1, 0, 16, 1, 3, 1, 9, 2, 1, 1};
  std::vector<LayerCase> cases;
  for (LayerCase c : fwd_cases()) {
    c.name = "streamed: " + c.name;
    c.checkpoints = false;
    c.H = H;
    c.lengths.clear();
    for (int64_t n = 0; n < N; ++n) c.lengths.push_back(pattern[n % 12]);
    cases.push_back(c);
  }
  LayerCase c = cases[0];
  c.name = "streamed: bf16 pool";
  c.pool_dtype = FKDA_DTYPE_BF16;
  cases.push_back(c);
  c = cases[0];
  c.name = "streamed: batch rows of one token (no cu_seqlens)";
  c.lengths.clear();
  c.B = N;
  c.T = 1;
  cases.push_back(c);
  c.name = "streamed: batch rows of two tokens, bf16 pool";
  c.T = 2;
  c.pool_dtype = FKDA_DTYPE_BF16;
  cases.push_back(c);
  return cases;
}

}  // namespace

TEST_CASE("layer step: the streamed decode matches the CPU backend", "[gpu][layer_step][streamed]") {
  for (const LayerCase& c : streamed_cases()) {
    SECTION(c.name) { compare_decode(c); }
  }
}

TEST_CASE("layer step: the streamed decode under the sanitizers", "[gpu][layer_step][sanitize][streamed]") {
  const std::vector<LayerCase> cases = streamed_cases();
  for (size_t i : {size_t(0), size_t(4), cases.size() - 3}) (void)run(cases[i], true, decode_call);
}

TEST_CASE("layer step: GPU calls under the sanitizers", "[gpu][layer_step][sanitize]") {
  // The last sequence ends a token into its second chunk: the preparation
  // kernel's threads of that chunk's second half must not reach for inputs
  // past the projections' end.
  for (LayerCase c : fwd_cases()) {
    if (!c.lengths.empty()) c.lengths = {20, 0, 33, 1, 17};
    (void)run(c, true, fwd_call);
  }
  for (LayerCase c : recurrence_route_cases()) {
    if (c.chunk_parallel == FKDA_CHUNK_PARALLEL_AUTO) c.lengths = {40, 0, 33, 1, 17};
    (void)run(c, true, fwd_call);
  }
  LayerCase c = fwd_cases()[0];
  c.lengths = {1, 1, 2};
  c.checkpoints = false;
  for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
    for (fkda_dtype pool_dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      c.layout = layout;
      c.pool_dtype = pool_dtype;
      (void)run(c, true, decode_call);
    }
  }
}
