// SPDX-License-Identifier: MIT
#include "timing.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kda_reference.h"
#include "random_fill.h"
#include "run_memory.h"

namespace fkda_bench {
namespace {

constexpr int64_t kHeadDim = 128;
constexpr int kMinInputSets = 2;
constexpr int kMaxInputSets = 64;
// The rotated input sets together should exceed the L2 cache this many times.
constexpr double kL2Multiple = 8.0;
// Used when the device does not report its L2 size.
constexpr size_t kFallbackL2Bytes = size_t(64) << 20;
// Leaves room for the context, the workspace's neighbours and the driver.
constexpr double kUsableFreeMemory = 0.85;

// Tensors of one input set. Outputs rotate with the inputs so that writes
// to one set's output do not warm the cache for the next call either.
struct InputSet {
  DeviceBuffer q, k, v, g, beta, initial_state, out, final_state;
};

struct Shapes {
  int64_t tokens, seqs, heads;
  size_t activation_elems, beta_elems, state_elems;
};

size_t input_set_bytes(const Shapes& s, fkda_dtype state_dtype) {
  return 5 * s.activation_elems * 2 + s.beta_elems * 2 +
         2 * s.state_elems * state_dtype_bytes(state_dtype);
}

}  // namespace

int choose_input_sets(size_t set_bytes, size_t workspace_bytes, const DeviceContext& device,
                      const std::string& id) {
  const size_t l2 = device.l2_bytes ? device.l2_bytes : kFallbackL2Bytes;
  int sets = int(std::ceil(kL2Multiple * double(l2) / double(set_bytes)));
  sets = std::clamp(sets, kMinInputSets, kMaxInputSets);

  size_t free_bytes = 0, total_bytes = 0;
  FKDA_BENCH_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double usable = kUsableFreeMemory * double(free_bytes) - double(workspace_bytes);
  const int fit = usable > 0 ? int(usable / double(set_bytes)) : 0;
  if (fit < 1)
    throw BenchError(id + ": needs " + std::to_string(set_bytes + workspace_bytes) +
                         " bytes of device memory, " + std::to_string(free_bytes) + " free",
                     kExitFailure);
  if (fit < sets) {
    std::fprintf(stderr,
                 "fkda-bench: %s: only %d input set(s) fit in device memory (wanted %d); "
                 "caches may flatter this case\n",
                 id.c_str(), fit, sets);
    sets = fit;
  }
  return sets;
}

namespace {

void upload(const DeviceBuffer& dst, const void* src, size_t bytes) {
  FKDA_BENCH_CUDA(cudaMemcpy(dst.get(), src, bytes, cudaMemcpyHostToDevice));
}

bool buffer_finite(const DeviceBuffer& buffer, bool is_f32) {
  return all_finite(RunMemory(true).read(buffer.get(), buffer.bytes()), is_f32);
}

constexpr int kGraphReplays = 5;

// See CallTimes::graph_mean_ms. A call that fails inside the capture ends
// it and throws as it would outside.
double graph_mean_ms(const std::function<void(int)>& call, const TimingOptions& options,
                     cudaStream_t stream) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nan("");
  }
  cudaGraph_t graph = nullptr;
  try {
    for (int i = 0; i < options.iters; ++i) call(options.warmup + i);
  } catch (...) {
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    throw;
  }
  if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || graph == nullptr) {
    (void)cudaGetLastError();
    return std::nan("");
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (instantiated != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nan("");
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<double> per_call;
  try {
    FKDA_BENCH_CUDA(cudaEventCreate(&start));
    FKDA_BENCH_CUDA(cudaEventCreate(&stop));
    FKDA_BENCH_CUDA(cudaGraphLaunch(exec, stream));  // uploads the graph; untimed
    for (int r = 0; r < kGraphReplays; ++r) {
      FKDA_BENCH_CUDA(cudaEventRecord(start, stream));
      FKDA_BENCH_CUDA(cudaGraphLaunch(exec, stream));
      FKDA_BENCH_CUDA(cudaEventRecord(stop, stream));
      FKDA_BENCH_CUDA(cudaEventSynchronize(stop));
      float elapsed = 0;
      FKDA_BENCH_CUDA(cudaEventElapsedTime(&elapsed, start, stop));
      per_call.push_back(double(elapsed) / options.iters);
    }
  } catch (...) {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    cudaGraphExecDestroy(exec);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

}  // namespace

CallTimes time_calls(const std::function<void(int)>& call, const TimingOptions& options,
                     cudaStream_t stream) {
  for (int i = 0; i < options.warmup; ++i) call(i);
  FKDA_BENCH_CUDA(cudaStreamSynchronize(stream));

  // One event pair per call and a single synchronisation at the end: the
  // host queues ahead, so small cases are not timed waiting for the launch.
  std::vector<cudaEvent_t> starts(size_t(options.iters)), stops(size_t(options.iters));
  for (int i = 0; i < options.iters; ++i) {
    FKDA_BENCH_CUDA(cudaEventCreate(&starts[size_t(i)]));
    FKDA_BENCH_CUDA(cudaEventCreate(&stops[size_t(i)]));
  }
  CallTimes times;
  std::vector<double> ms(size_t(options.iters));
  try {
    for (int i = 0; i < options.iters; ++i) {
      FKDA_BENCH_CUDA(cudaEventRecord(starts[size_t(i)], stream));
      call(options.warmup + i);
      FKDA_BENCH_CUDA(cudaEventRecord(stops[size_t(i)], stream));
    }
    FKDA_BENCH_CUDA(cudaStreamSynchronize(stream));
    for (int i = 0; i < options.iters; ++i) {
      float elapsed = 0;
      FKDA_BENCH_CUDA(cudaEventElapsedTime(&elapsed, starts[size_t(i)], stops[size_t(i)]));
      ms[size_t(i)] = elapsed;
    }
    float span = 0;
    FKDA_BENCH_CUDA(cudaEventElapsedTime(&span, starts.front(), stops.back()));
    times.back_to_back_mean_ms = double(span) / options.iters;
  } catch (...) {
    for (auto event : starts) cudaEventDestroy(event);
    for (auto event : stops) cudaEventDestroy(event);
    throw;
  }
  for (int i = 0; i < options.iters; ++i) {
    FKDA_BENCH_CUDA(cudaEventDestroy(starts[size_t(i)]));
    FKDA_BENCH_CUDA(cudaEventDestroy(stops[size_t(i)]));
  }
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  times.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  times.min_ms = ms.front();
  times.max_ms = ms.back();
  times.graph_mean_ms = graph_mean_ms(call, options, stream);
  const auto issued = std::chrono::steady_clock::now();
  for (int i = 0; i < options.iters; ++i) call(options.warmup + i);
  const std::chrono::duration<double, std::micro> issuing = std::chrono::steady_clock::now() - issued;
  FKDA_BENCH_CUDA(cudaStreamSynchronize(stream));
  times.host_us_per_call = issuing.count() / options.iters;
  return times;
}

TimingResult time_case(const BenchCase& c, const TimingOptions& options,
                       const DeviceContext& device) {
  validate_case(c);
  const auto setup_start = std::chrono::steady_clock::now();

  Shapes s;
  s.tokens = c.total_tokens();
  s.seqs = c.num_seqs();
  s.heads = c.H;
  s.activation_elems = size_t(s.tokens) * size_t(s.heads) * kHeadDim;
  s.beta_elems = size_t(s.tokens) * size_t(s.heads);
  s.state_elems = size_t(s.seqs) * size_t(s.heads) * kHeadDim * kHeadDim;
  const bool state_f32 = options.state_dtype == FKDA_DTYPE_F32;
  const size_t state_bytes = s.state_elems * state_dtype_bytes(options.state_dtype);

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(c.H);
  desc.state_dtype = options.state_dtype;
  desc.backend = FKDA_BACKEND_GPU;
  desc.gate_mode = options.gate_mode;
  if (options.gate_mode == FKDA_GATE_BOUNDED) desc.lower_bound = options.lower_bound;
  Plan plan(desc);

  TimingResult result;
  FKDA_BENCH_FKDA(fkda_plan_workspace_size(plan.get(), s.tokens, s.seqs, &result.workspace_bytes));
  result.input_set_bytes = input_set_bytes(s, options.state_dtype);
  result.input_sets =
      choose_input_sets(result.input_set_bytes, result.workspace_bytes, device, c.id);
  DeviceBuffer workspace(result.workspace_bytes);

  // Parameters shared by every set: A_log, dt_bias ~ U(0, 1), cu_seqlens.
  std::vector<float> A_log(size_t(c.H)), dt_bias(size_t(c.H) * kHeadDim);
  fill_f32_uniform(A_log.data(), A_log.size(), 0.f, 1.f, derive_seed(options.seed, 0, 1));
  fill_f32_uniform(dt_bias.data(), dt_bias.size(), 0.f, 1.f, derive_seed(options.seed, 0, 2));
  if (options.gate_mode == FKDA_GATE_SOFTPLUS) {
    // Kimi-Linear's initialisation: A_log = log U(1, 16), dt_bias the inverse
    // softplus of a log-uniform value in [0.001, 0.1].
    for (float& x : A_log) x = std::log(1.f + 15.f * x);
    for (float& x : dt_bias) {
      const double rate = std::exp(std::log(0.001) + double(x) * (std::log(0.1) - std::log(0.001)));
      x = float(std::log(std::expm1(rate)));
    }
  }
  DeviceBuffer A_log_device(A_log.size() * sizeof(float));
  DeviceBuffer dt_bias_device(dt_bias.size() * sizeof(float));
  upload(A_log_device, A_log.data(), A_log_device.bytes());
  upload(dt_bias_device, dt_bias.data(), dt_bias_device.bytes());
  DeviceBuffer cu_seqlens_device;
  std::vector<int64_t> cu_seqlens;
  if (c.varlen()) {
    cu_seqlens.push_back(0);
    for (int64_t n : c.lengths) cu_seqlens.push_back(cu_seqlens.back() + n);
    cu_seqlens_device = DeviceBuffer(cu_seqlens.size() * sizeof(int64_t));
    upload(cu_seqlens_device, cu_seqlens.data(), cu_seqlens_device.bytes());
  }

  // One host staging buffer reused for every tensor keeps host memory at the
  // size of the largest tensor (the state is the larger one for short sequences).
  std::vector<uint16_t> staging_bf16(std::max(s.activation_elems, s.state_elems));
  std::vector<float> staging_f32(state_f32 ? s.state_elems : 0);
  std::vector<InputSet> sets(size_t(result.input_sets));
  for (size_t set = 0; set < sets.size(); ++set) {
    InputSet& in = sets[set];
    DeviceBuffer* activations[] = {&in.q, &in.k, &in.v, &in.g};
    for (size_t t = 0; t < 4; ++t) {
      *activations[t] = DeviceBuffer(s.activation_elems * 2);
      fill_bf16_normal(staging_bf16.data(), s.activation_elems, 1.f,
                       derive_seed(options.seed, set + 1, t));
      upload(*activations[t], staging_bf16.data(), activations[t]->bytes());
    }
    in.beta = DeviceBuffer(s.beta_elems * 2);
    fill_bf16_normal(staging_bf16.data(), s.beta_elems, 1.f, derive_seed(options.seed, set + 1, 4));
    upload(in.beta, staging_bf16.data(), in.beta.bytes());

    in.initial_state = DeviceBuffer(state_bytes);
    if (state_f32) {
      fill_f32_normal(staging_f32.data(), s.state_elems, 0.1f, derive_seed(options.seed, set + 1, 5));
      upload(in.initial_state, staging_f32.data(), state_bytes);
    } else {
      fill_bf16_normal(staging_bf16.data(), s.state_elems, 0.1f,
                       derive_seed(options.seed, set + 1, 5));
      upload(in.initial_state, staging_bf16.data(), state_bytes);
    }

    // All-ones bytes are NaN in bf16 and f32: anything left unwritten shows.
    in.out = DeviceBuffer(s.activation_elems * 2);
    in.final_state = DeviceBuffer(state_bytes);
    FKDA_BENCH_CUDA(cudaMemset(in.out.get(), 0xFF, in.out.bytes()));
    FKDA_BENCH_CUDA(cudaMemset(in.final_state.get(), 0xFF, in.final_state.bytes()));
  }
  FKDA_BENCH_CUDA(cudaDeviceSynchronize());
  result.setup_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();

  // Shapes for make_args; the activations' host vectors of this Problem stay
  // empty. make_args passes the gate parameters a Problem holds.
  fkda_ref::Problem shape;
  shape.B = c.varlen() ? 1 : c.B;
  shape.T = c.varlen() ? s.tokens : c.T;
  shape.H = c.H;
  shape.cu_seqlens = cu_seqlens;
  shape.lower_bound = options.lower_bound;
  shape.gate_mode = options.gate_mode;
  shape.A_log = A_log;
  shape.dt_bias = dt_bias;

  std::vector<fkda_fwd_args> args(sets.size());
  for (size_t set = 0; set < sets.size(); ++set) {
    const InputSet& in = sets[set];
    fkda_ref::Buffers buffers{in.q.get(),        in.k.get(),           in.v.get(),
                               in.g.get(),        in.beta.get(),        A_log_device.get(),
                               dt_bias_device.get(), in.out.get()};
    buffers.initial_state = in.initial_state.get();
    buffers.final_state = in.final_state.get();
    buffers.cu_seqlens = cu_seqlens_device.get();
    args[set] = fkda_ref::make_args(shape, buffers, options.state_dtype);
    if (options.gate_mode == FKDA_GATE_LOG_DECAY) {
      // g ~ N(0, 1) read as log-decays (the positive half as 0).
      args[set].A_log = FKDA_TENSOR_NONE;
      args[set].dt_bias = FKDA_TENSOR_NONE;
    }
  }

  Stream stream;
  const auto fwd = [&](int call) {
    FKDA_BENCH_FKDA(fkda_fwd(plan.get(), &args[size_t(call) % args.size()], workspace.get(),
                             workspace.bytes(), stream.get()));
  };
  static_cast<CallTimes&>(result) = time_calls(fwd, options, stream.get());

  // Every set ran at least once when warmup + iters >= sets; check those.
  const size_t sets_run = std::min(sets.size(), size_t(options.warmup + options.iters));
  for (size_t set = 0; set < sets_run; ++set) {
    if (!buffer_finite(sets[set].out, false))
      throw BenchError(c.id + ": out of input set " + std::to_string(set) +
                           " holds NaN/inf or unwritten elements",
                       kExitFailure);
    if (!buffer_finite(sets[set].final_state, state_f32))
      throw BenchError(c.id + ": final_state of input set " + std::to_string(set) +
                           " holds NaN/inf or unwritten elements",
                       kExitFailure);
  }

  result.bytes_moved = bytes_moved(c, options.state_dtype);
  result.gbps = result.bytes_moved / (result.median_ms * 1e-3) / 1e9;
  return result;
}

}  // namespace fkda_bench
