// Timings of the serving cases (hidden: run with "[timing][decode]" or
// "[timing][pool]"): the decode cases D1-D8 and speculative-verify cases
// S1-S3 on f32 (D8: bf16) pools of scattered slots with slot 0 reserved and
// int32 cu_seqlens, and the prefill by pool slot R1 and R2 against the same
// prefill with contiguous states (P8). Each prints its median (calls replayed
// from a CUDA graph) and its target; the targets are for an H200.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"
#include "serving_support.h"

namespace {

using namespace fkda_ref;

constexpr int kWarmup = 3;
constexpr int kIterations = 30;
constexpr int kCallsPerGraph = 10;

// Median milliseconds of one call of `launch(stream)`: kCallsPerGraph calls
// captured in a CUDA graph and replayed, so that the host's part of a call
// (validation, launch) does not count, as in a runtime that replays graphs.
template <typename Launch>
double median_ms(Launch&& launch) {
  cudaStream_t stream = nullptr;
  CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kCallsPerGraph; ++i) launch(stream);
  CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph));
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_REQUIRE(cudaEventCreate(&start));
  CUDA_REQUIRE(cudaEventCreate(&stop));
  for (int i = 0; i < kWarmup; ++i) CUDA_REQUIRE(cudaGraphLaunch(exec, stream));
  std::vector<float> times;
  for (int i = 0; i < kIterations; ++i) {
    CUDA_REQUIRE(cudaEventRecord(start, stream));
    CUDA_REQUIRE(cudaGraphLaunch(exec, stream));
    CUDA_REQUIRE(cudaEventRecord(stop, stream));
    CUDA_REQUIRE(cudaEventSynchronize(stop));
    float ms = 0.f;
    CUDA_REQUIRE(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / kCallsPerGraph);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  std::sort(times.begin(), times.end());
  return double(times[times.size() / 2]);
}

// Activations of `tokens` tokens of H heads, random, on the device.
struct DeviceActivations {
  DeviceBuffer q, k, v, g, beta, A_log, dt_bias, out;
  DeviceActivations(int64_t tokens, int64_t H, uint64_t seed)
      : q(quick_normals(size_t(tokens * H * 128), seed)), k(quick_normals(size_t(tokens * H * 128), seed + 1)),
        v(quick_normals(size_t(tokens * H * 128), seed + 2)), g(quick_normals(size_t(tokens * H * 128), seed + 3)),
        beta(quick_normals(size_t(tokens * H), seed + 4)), A_log(std::vector<float>(size_t(H), 0.5f)),
        dt_bias(std::vector<float>(size_t(H * 128), 0.25f)), out(size_t(tokens * H * 128) * 2) {}
};

struct DecodeTiming {
  const char* name;
  int64_t N, H, T;  // T > 1: a speculative verify with an [N, T] slot table
  fkda_dtype dtype;
  double fla_ms, target_ms;
};

}  // namespace

TEST_CASE("decode timing: D1-D8 and S1-S3", "[.][timing][decode]") {
  const DecodeTiming cases[] = {
      {"D1", 1, 32, 1, FKDA_DTYPE_F32, 0.016, 0.008},     {"D2", 16, 32, 1, FKDA_DTYPE_F32, 0.029, 0.020},
      {"D3", 64, 32, 1, FKDA_DTYPE_F32, 0.092, 0.070},    {"D4", 256, 32, 1, FKDA_DTYPE_F32, 0.366, 0.270},
      {"D5", 256, 96, 1, FKDA_DTYPE_F32, 1.171, 0.800},   {"D6", 256, 12, 1, FKDA_DTYPE_F32, 0.128, 0.105},
      {"D7", 1024, 12, 1, FKDA_DTYPE_F32, 0.543, 0.420},  {"D8", 256, 32, 1, FKDA_DTYPE_BF16, 0.227, 0.140},
      {"S1", 64, 32, 4, FKDA_DTYPE_F32, 0.225, 0.175},    {"S2", 256, 12, 4, FKDA_DTYPE_F32, 0.352, 0.260},
      {"S3", 64, 12, 8, FKDA_DTYPE_F32, 0.158, 0.120},
  };
  for (const DecodeTiming& c : cases) {
    const int64_t tokens = c.N * c.T, columns = c.T;
    const int64_t slots = c.N * columns * 2 + 1;  // slot 0 reserved as the null slot
    const size_t element = dtype_bytes(c.dtype), matrix_bytes = size_t(kMatrixElements) * element;
    DeviceBuffer pool(size_t(slots * c.H) * matrix_bytes);
    CUDA_REQUIRE(cudaMemset(pool.get(), 0, pool.bytes()));
    DeviceActivations a(tokens, c.H, 7);
    DeviceBuffer indices(integer_bytes(scattered_slots(c.N * columns, 1, slots, 3), FKDA_DTYPE_I32));
    std::vector<int64_t> offsets, accepted;
    for (int64_t n = 0; n <= c.N; ++n) offsets.push_back(n * c.T);
    for (int64_t n = 0; n < c.N; ++n) accepted.push_back(1 + n % c.T);
    DeviceBuffer cu_seqlens(integer_bytes(offsets, FKDA_DTYPE_I32)), counts(integer_bytes(accepted, FKDA_DTYPE_I32));

    Problem shape;
    shape.H = c.H;
    OwnedPlan plan(shape, c.dtype, FKDA_STATE_LAYOUT_VK, FKDA_NULL_SLOT_NONPOSITIVE);
    fkda_decode_args args = FKDA_DECODE_ARGS_INIT;
    args.q = tensor(a.q.get(), FKDA_DTYPE_BF16, {1, tokens, c.H, 128});
    args.k = tensor(a.k.get(), FKDA_DTYPE_BF16, {1, tokens, c.H, 128});
    args.v = tensor(a.v.get(), FKDA_DTYPE_BF16, {1, tokens, c.H, 128});
    args.g = tensor(a.g.get(), FKDA_DTYPE_BF16, {1, tokens, c.H, 128});
    args.beta = tensor(a.beta.get(), FKDA_DTYPE_BF16, {1, tokens, c.H});
    args.out = tensor(a.out.get(), FKDA_DTYPE_BF16, {1, tokens, c.H, 128});
    args.A_log = tensor(a.A_log.get(), FKDA_DTYPE_F32, {c.H});
    args.dt_bias = tensor(a.dt_bias.get(), FKDA_DTYPE_F32, {c.H, 128});
    args.state_pool = tensor(pool.get(), c.dtype, {slots, c.H, 128, 128});
    args.state_indices = c.T > 1 ? tensor(indices.get(), FKDA_DTYPE_I32, {c.N, columns})
                                 : tensor(indices.get(), FKDA_DTYPE_I32, {c.N});
    if (c.T > 1) args.num_accepted_tokens = tensor(counts.get(), FKDA_DTYPE_I32, {c.N});
    args.cu_seqlens = tensor(cu_seqlens.get(), FKDA_DTYPE_I32, {c.N + 1});

    fkda_status status = FKDA_SUCCESS;
    const double ms = median_ms([&](cudaStream_t stream) {
      const fkda_status s = fkda_decode(plan.get(), &args, nullptr, 0, stream);
      if (s != FKDA_SUCCESS) status = s;
    });
    FKDA_REQUIRE(status);
    // One read and one write (a table: one write per token) of each state.
    const double bytes = double(c.N * c.H) * double(matrix_bytes) * double(1 + c.T);
    std::printf("timing %-3s N=%-4lld H=%-3lld T=%lld %s: %.4f ms (target <= %.3f, FLA %.3f)%s, %.0f GB/s of state\n",
                c.name, (long long)c.N, (long long)c.H, (long long)c.T, c.dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32 ",
                ms, c.target_ms, c.fla_ms, ms <= c.target_ms ? "" : " ABOVE TARGET", bytes / (ms * 1e6));
    std::fflush(stdout);
    CHECK(ms > 0.0);
  }
}

TEST_CASE("pool prefill timing: R1 and R2 against P8", "[.][timing][pool]") {
  // P8: 8 sequences of 1024 tokens, 96 heads; R1 its states in an f32 pool of
  // 4096 slots at scattered indices; R2 that plus a checkpoint every 256
  // tokens (3 interior per sequence) to pool slots.
  const int64_t N = 8, length = 1024, H = 96, slots = 4096, C = 3, tokens = N * length;
  DeviceActivations a(tokens, H, 11);
  std::vector<int64_t> offsets;
  for (int64_t n = 0; n <= N; ++n) offsets.push_back(n * length);
  DeviceBuffer cu_seqlens(integer_bytes(offsets, FKDA_DTYPE_I32));
  const std::vector<int64_t> chosen = scattered_slots(N + N * C, 1, slots, 5);
  DeviceBuffer indices(integer_bytes(std::vector<int64_t>(chosen.begin(), chosen.begin() + N), FKDA_DTYPE_I32));
  DeviceBuffer checkpoint_slots(integer_bytes(std::vector<int64_t>(chosen.begin() + N, chosen.end()), FKDA_DTYPE_I32));
  std::vector<int64_t> checkpoint_offsets;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 1; c <= C; ++c) checkpoint_offsets.push_back(c * 256);
  DeviceBuffer checkpoint_offsets_device(integer_bytes(checkpoint_offsets, FKDA_DTYPE_I32));
  const size_t matrix_bytes = size_t(kMatrixElements) * 4;
  DeviceBuffer pool(size_t(slots * H) * matrix_bytes);
  CUDA_REQUIRE(cudaMemset(pool.get(), 0, pool.bytes()));
  DeviceBuffer initial(size_t(N * H) * matrix_bytes), final_state(size_t(N * H) * matrix_bytes);
  CUDA_REQUIRE(cudaMemset(initial.get(), 0, initial.bytes()));

  Problem shape;
  shape.H = H;
  OwnedPlan plan(shape, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, FKDA_NULL_SLOT_NONPOSITIVE);
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), tokens, N, &bytes));
  DeviceBuffer workspace(bytes);
  fkda_fwd_args base = FKDA_FWD_ARGS_INIT;
  base.q = tensor(a.q.get(), FKDA_DTYPE_BF16, {1, tokens, H, 128});
  base.k = tensor(a.k.get(), FKDA_DTYPE_BF16, {1, tokens, H, 128});
  base.v = tensor(a.v.get(), FKDA_DTYPE_BF16, {1, tokens, H, 128});
  base.g = tensor(a.g.get(), FKDA_DTYPE_BF16, {1, tokens, H, 128});
  base.beta = tensor(a.beta.get(), FKDA_DTYPE_BF16, {1, tokens, H});
  base.out = tensor(a.out.get(), FKDA_DTYPE_BF16, {1, tokens, H, 128});
  base.A_log = tensor(a.A_log.get(), FKDA_DTYPE_F32, {H});
  base.dt_bias = tensor(a.dt_bias.get(), FKDA_DTYPE_F32, {H, 128});
  base.cu_seqlens = tensor(cu_seqlens.get(), FKDA_DTYPE_I32, {N + 1});

  fkda_fwd_args contiguous = base;
  contiguous.initial_state = tensor(initial.get(), FKDA_DTYPE_F32, {N, H, 128, 128});
  contiguous.final_state = tensor(final_state.get(), FKDA_DTYPE_F32, {N, H, 128, 128});
  fkda_fwd_args r1 = base;
  r1.state_pool = tensor(pool.get(), FKDA_DTYPE_F32, {slots, H, 128, 128});
  r1.state_indices = tensor(indices.get(), FKDA_DTYPE_I32, {N});
  fkda_fwd_args r2 = r1;
  r2.checkpoint_offsets = tensor(checkpoint_offsets_device.get(), FKDA_DTYPE_I32, {N, C});
  r2.checkpoint_slots = tensor(checkpoint_slots.get(), FKDA_DTYPE_I32, {N, C});

  auto time = [&](const fkda_fwd_args& args) {
    fkda_status status = FKDA_SUCCESS;
    const double ms = median_ms([&](cudaStream_t stream) {
      const fkda_status s = fkda_fwd(plan.get(), &args, workspace.get(), bytes, stream);
      if (s != FKDA_SUCCESS) status = s;
    });
    FKDA_REQUIRE(status);
    return ms;
  };
  const double p8 = time(contiguous), t1 = time(r1), t2 = time(r2);
  std::printf("timing P8 contiguous states: %.4f ms\n", p8);
  std::printf("timing R1 pool: %.4f ms = %.3fx P8 (target <= 1.02x)%s\n", t1, t1 / p8, t1 <= 1.02 * p8 ? "" : " ABOVE TARGET");
  std::printf("timing R2 pool + checkpoints: %.4f ms = %.3fx P8 (target <= 1.10x)%s\n", t2, t2 / p8,
              t2 <= 1.10 * p8 ? "" : " ABOVE TARGET");
  std::fflush(stdout);
  CHECK(p8 > 0.0);
}
