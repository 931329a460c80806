// SPDX-License-Identifier: MIT
// fkda-demo: one Kimi Delta Attention prefill through libflashkda's C ABI.
//
// Three packed sequences of 300, 77 and 700 tokens over 4 heads, with an
// initial state in and the final state out (f32 state), run on the GPU when
// one is usable and on the CPU reference backend otherwise. The result is
// checked against the fp64 token-by-token recurrence and the run fails when
// the error exceeds the f32-state accuracy targets of docs/BENCHMARKS.md.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "flashkda.h"
#include "kda_reference.h"

namespace {

constexpr double kTargetOutRelL2 = 4.0e-3;    // docs/BENCHMARKS.md, f32 state
constexpr double kTargetStateRelL2 = 2.9e-3;  // docs/BENCHMARKS.md, f32 state
constexpr uint64_t kSeed = 20261130;

const char* const kUsage =
    "usage: fkda-demo [--cpu] [--help]\n"
    "\n"
    "Runs one KDA prefill (fkda_fwd) on varlen sequences [300, 77, 700], H=4,\n"
    "K=V=128, with an initial and a final f32 state, on the GPU when one is\n"
    "usable and on the CPU backend otherwise, and compares out and the final\n"
    "state with the fp64 recurrence.\n"
    "\n"
    "  --cpu    use the CPU backend even when a GPU is usable\n"
    "  --help   print this text\n"
    "\n"
    "Exit status: 0 when the errors are within the f32-state targets\n"
    "(out <= 4.0e-3, final state <= 2.9e-3), 1 otherwise or on any failure,\n"
    "2 on a bad command line.\n";

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "fkda-demo: %s\n", message.c_str());
  std::exit(1);
}

void check(fkda_status status, const char* call) {
  if (status != FKDA_SUCCESS)
    fail(std::string(call) + ": " + fkda_status_string(status) + ": " + fkda_last_error());
}

void check_cuda(cudaError_t error, const char* call) {
  if (error != cudaSuccess) fail(std::string(call) + ": " + cudaGetErrorString(error));
}

// Where the tensors live: host memory for the CPU backend, device memory
// (on the current device) for the GPU backend.
class Memory {
 public:
  explicit Memory(bool on_device) : on_device_(on_device) {}
  ~Memory() {
    for (void* p : device_allocations_) cudaFree(p);
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  void* copy_in(const void* src, size_t bytes) {
    void* dst = allocate(bytes);
    if (on_device_)
      check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
    else
      std::memcpy(dst, src, bytes);
    return dst;
  }

  // Filled with all-ones bytes, a NaN in bf16 and f32, so that any element
  // the library failed to write shows up in the error below.
  void* poisoned(size_t bytes) {
    void* dst = allocate(bytes);
    if (on_device_)
      check_cuda(cudaMemset(dst, 0xFF, bytes), "cudaMemset");
    else
      std::memset(dst, 0xFF, bytes);
    return dst;
  }

  void copy_out(void* dst, const void* src, size_t bytes) {
    if (on_device_)
      check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
    else
      std::memcpy(dst, src, bytes);
  }

 private:
  void* allocate(size_t bytes) {
    if (bytes == 0) return nullptr;
    if (on_device_) {
      void* p = nullptr;
      check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
      device_allocations_.push_back(p);
      return p;
    }
    host_allocations_.emplace_back(bytes);
    return host_allocations_.back().data();
  }

  bool on_device_;
  std::vector<void*> device_allocations_;
  // The bytes of a std::vector stay put when the outer vector grows.
  std::vector<std::vector<unsigned char>> host_allocations_;
};

struct BackendChoice {
  fkda_plan_t plan = nullptr;
  fkda_backend backend = FKDA_BACKEND_CPU;
  std::string why;
};

fkda_status create_plan(fkda_backend backend, int64_t heads, fkda_plan_t* plan) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(heads);
  desc.state_dtype = FKDA_DTYPE_F32;
  desc.backend = backend;
  desc.lower_bound = -5.0f;
  return fkda_plan_create(&desc, plan);
}

// The GPU when the driver, a device and this build's kernels are all there;
// otherwise the CPU backend, with the reason.
BackendChoice choose_backend(bool force_cpu, int64_t heads) {
  BackendChoice choice;
  std::string problem;
  if (force_cpu) {
    choice.why = "forced by --cpu";
  } else {
    fkda_device_info info = FKDA_DEVICE_INFO_INIT;
    check(fkda_query_device(-1, &info), "fkda_query_device");
    const std::string arch = "sm_" + std::to_string(info.cc_major) + std::to_string(info.cc_minor);
    if (!info.driver_loaded)
      problem = "the CUDA driver could not be loaded";
    else if (info.device_count <= 0)
      problem = "no CUDA device";
    else if (!info.has_kernels)
      problem = std::string("this build has no kernels for ") + info.name + " (" + arch + ")";

    if (problem.empty()) {
      // The library works in the caller's current context: make one.
      cudaError_t error = cudaSetDevice(0);
      if (error == cudaSuccess) error = cudaFree(nullptr);
      if (error != cudaSuccess) problem = std::string("cudaSetDevice(0): ") + cudaGetErrorString(error);
    }
    if (problem.empty()) {
      if (create_plan(FKDA_BACKEND_GPU, heads, &choice.plan) == FKDA_SUCCESS) {
        choice.backend = FKDA_BACKEND_GPU;
        choice.why = std::string(info.name) + ", " + arch;
        return choice;
      }
      problem = fkda_last_error();
    } else {
      // The library's own account of why it cannot use the GPU, when it has one.
      fkda_plan_t gpu_plan = nullptr;
      if (create_plan(FKDA_BACKEND_GPU, heads, &gpu_plan) != FKDA_SUCCESS &&
          *fkda_last_error() != '\0')
        problem = fkda_last_error();
      fkda_plan_destroy(gpu_plan);
    }
    choice.why = "no usable GPU: " + problem;
  }
  check(create_plan(FKDA_BACKEND_CPU, heads, &choice.plan), "fkda_plan_create (CPU)");
  choice.backend = FKDA_BACKEND_CPU;
  return choice;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

}  // namespace

int main(int argc, char** argv) {
  bool force_cpu = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--cpu") {
      force_cpu = true;
    } else if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      std::fprintf(stderr, "fkda-demo: unknown argument %s\n\n%s", arg.c_str(), kUsage);
      return 2;
    }
  }

  // Random inputs as in docs/BENCHMARKS.md's accuracy case: q, k, v, g, beta
  // ~ N(0,1); A_log, dt_bias ~ U(0,1); initial state ~ 0.1 N(0,1).
  fkda_ref::ProblemShape problem_shape;
  problem_shape.H = 4;
  problem_shape.lengths = {300, 77, 700};
  problem_shape.with_initial_state = true;
  problem_shape.lower_bound = -5.0f;
  const fkda_ref::Problem p = fkda_ref::random_problem(problem_shape, kSeed);
  const int64_t N = p.num_seqs(), T = p.T, H = p.H, K = p.K, V = p.V;

  std::printf("libflashkda %s\n", fkda_version_string());
  BackendChoice choice = choose_backend(force_cpu, H);
  const bool on_gpu = choice.backend == FKDA_BACKEND_GPU;
  std::printf("backend: %s (%s)\n", on_gpu ? "GPU" : "CPU", choice.why.c_str());

  // Every tensor of the call, described by data pointer, dtype and shape
  // (contiguous row-major). Varlen: B = 1 and cu_seqlens marks the sequences.
  const std::vector<int64_t> act_shape = {1, T, H, K};
  const std::vector<int64_t> beta_shape = {1, T, H};
  const std::vector<int64_t> state_shape = {N, H, V, K};
  const std::vector<int64_t> offsets_shape = {N + 1};
  const size_t act_bytes = size_t(T * H * K) * 2;
  const size_t state_bytes = size_t(N * H * V * K) * 4;

  Memory memory(on_gpu);
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
  args.q = fkda_ref::tensor(memory.copy_in(p.q.data(), act_bytes), FKDA_DTYPE_BF16, act_shape);
  args.k = fkda_ref::tensor(memory.copy_in(p.k.data(), act_bytes), FKDA_DTYPE_BF16, act_shape);
  args.v = fkda_ref::tensor(memory.copy_in(p.v.data(), act_bytes), FKDA_DTYPE_BF16, act_shape);
  args.g = fkda_ref::tensor(memory.copy_in(p.g.data(), act_bytes), FKDA_DTYPE_BF16, act_shape);
  args.beta = fkda_ref::tensor(memory.copy_in(p.beta.data(), size_t(T * H) * 2),
                                FKDA_DTYPE_BF16, beta_shape);
  args.A_log = fkda_ref::tensor(memory.copy_in(p.A_log.data(), size_t(H) * 4), FKDA_DTYPE_F32, {H});
  args.dt_bias = fkda_ref::tensor(memory.copy_in(p.dt_bias.data(), size_t(H * K) * 4),
                                   FKDA_DTYPE_F32, {H, K});
  args.initial_state = fkda_ref::tensor(memory.copy_in(p.initial_state.data(), state_bytes),
                                         FKDA_DTYPE_F32, state_shape);
  args.cu_seqlens = fkda_ref::tensor(
      memory.copy_in(p.cu_seqlens.data(), p.cu_seqlens.size() * sizeof(int64_t)), FKDA_DTYPE_I64,
      offsets_shape);
  args.out = fkda_ref::tensor(memory.poisoned(act_bytes), FKDA_DTYPE_BF16, act_shape);
  args.final_state = fkda_ref::tensor(memory.poisoned(state_bytes), FKDA_DTYPE_F32, state_shape);
  args.scale = p.scale;

  // The caller owns the workspace; the plan says how much it needs.
  size_t workspace_bytes = 0;
  check(fkda_plan_workspace_size(choice.plan, T, N, &workspace_bytes), "fkda_plan_workspace_size");
  void* workspace = memory.poisoned(workspace_bytes);
  float lower_bound = 0;
  check(fkda_get_lower_bound(choice.plan, &lower_bound), "fkda_get_lower_bound");

  std::string offsets = "[";
  for (size_t i = 0; i < p.cu_seqlens.size(); ++i)
    offsets += (i ? ", " : "") + std::to_string(p.cu_seqlens[i]);
  offsets += "]";
  std::printf("problem: %lld sequences, lengths [300, 77, 700] packed into T=%lld, H=%lld, K=V=%lld\n",
              (long long)N, (long long)T, (long long)H, (long long)K);
  std::printf("  q, k, v, g, out              bf16 %s\n", shape_text(act_shape).c_str());
  std::printf("  beta                         bf16 %s\n", shape_text(beta_shape).c_str());
  std::printf("  A_log, dt_bias               f32  %s, %s\n", shape_text({H}).c_str(),
              shape_text({H, K}).c_str());
  std::printf("  cu_seqlens                   i64  %s = %s\n", shape_text(offsets_shape).c_str(),
              offsets.c_str());
  std::printf("  initial_state, final_state   f32  %s (V-first)\n", shape_text(state_shape).c_str());
  std::printf("lower_bound: %g, scale: %.6g\n", lower_bound, args.scale);
  std::printf("workspace: %zu bytes\n", workspace_bytes);

  double milliseconds = 0;
  std::string timing_note;
  if (on_gpu) {
    // The first call loads the kernels into the context; time the second.
    check(fkda_fwd(choice.plan, &args, workspace, workspace_bytes, nullptr), "fkda_fwd");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cudaEvent_t start = nullptr, stop = nullptr;
    check_cuda(cudaEventCreate(&start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
    check_cuda(cudaEventRecord(start, nullptr), "cudaEventRecord");
    check(fkda_fwd(choice.plan, &args, workspace, workspace_bytes, nullptr), "fkda_fwd");
    check_cuda(cudaEventRecord(stop, nullptr), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float elapsed = 0;
    check_cuda(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
    check_cuda(cudaEventDestroy(start), "cudaEventDestroy");
    check_cuda(cudaEventDestroy(stop), "cudaEventDestroy");
    milliseconds = elapsed;
    timing_note = "GPU time of the second call, CUDA events";
  } else {
    const auto start = std::chrono::steady_clock::now();
    check(fkda_fwd(choice.plan, &args, workspace, workspace_bytes, nullptr), "fkda_fwd");
    milliseconds =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    timing_note = "wall clock";
  }
  std::printf("time: %.3f ms (%s)\n", milliseconds, timing_note.c_str());

  std::vector<uint16_t> out_bits(size_t(T * H * V));
  std::vector<float> final_state(size_t(N * H * V * K));
  memory.copy_out(out_bits.data(), args.out.data, act_bytes);
  memory.copy_out(final_state.data(), args.final_state.data, state_bytes);
  check(fkda_plan_destroy(choice.plan), "fkda_plan_destroy");

  const fkda_ref::Reference reference = fkda_ref::reference_recurrence(p);
  const double out_error = fkda_ref::rel_l2(fkda_ref::bf16_to_float(out_bits), reference.out);
  const double state_error = fkda_ref::rel_l2(final_state, reference.final_state);
  const bool out_ok = out_error <= kTargetOutRelL2;
  const bool state_ok = state_error <= kTargetStateRelL2;
  std::printf("relative L2 error against the fp64 recurrence:\n");
  std::printf("  out          %.3e  (target <= %.1e)  %s\n", out_error, kTargetOutRelL2,
              out_ok ? "ok" : "ABOVE TARGET");
  std::printf("  final state  %.3e  (target <= %.1e)  %s\n", state_error, kTargetStateRelL2,
              state_ok ? "ok" : "ABOVE TARGET");
  return out_ok && state_ok ? 0 : 1;
}
