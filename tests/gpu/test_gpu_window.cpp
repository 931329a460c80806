// The GPU backend processes the chunk slots of a call in windows, so that its
// workspace holds one window's records plus an f32 state carry per window
// boundary (kernels/prefill_params.h, src/gpu/gpu_backend.cpp). Windows must change
// no bit of the result. Here: the workspace sizes the window rule gives, and
// a problem large enough to need several windows by default against its
// sequences run one call each (one window each), compared bit for bit.
// gpu_check.sh's `window` step reruns the [window] tests with
// FKDA_WINDOW_SLOTS forcing windows of 1, 3 and 7 slots, where every
// boundary falls somewhere else.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"

namespace {

using fkda_ref::DeviceBuffer;

// The record and carry sizes of kernels/prefill_params.h.
constexpr int64_t kRecordBytes = 13824;
constexpr int64_t kCarryBytesPerHead = 128 * 128 * 4;

// FKDA_WINDOW_SLOTS as the library reads it: 0 when absent or not positive.
int64_t forced_window_slots() {
  const char* text = std::getenv("FKDA_WINDOW_SLOTS");
  const long long value = text != nullptr ? std::atoll(text) : 0;
  return value > 0 ? int64_t(value) : 0;
}

size_t gpu_workspace(int64_t heads, int64_t tokens, int64_t seqs) {
  const fkda_ref::Plan plan(fkda_ref::plan_desc(heads, -5.0f, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK));
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), tokens, seqs, &bytes));
  return bytes;
}

int64_t total_slots(int64_t tokens, int64_t seqs) { return tokens / 16 + seqs + 1; }


struct Run {
  std::vector<uint16_t> out;
  std::vector<unsigned char> final_state;
};

// p on the GPU with initial and final state in `dtype` (V-first); the
// initial state is given in that dtype's bytes.
Run run_gpu(const fkda_ref::Problem& p, fkda_dtype dtype, const std::vector<unsigned char>& initial) {
  const fkda_ref::Plan plan(fkda_ref::plan_desc(p.H, p.lower_bound, dtype, FKDA_STATE_LAYOUT_VK));
  fkda_ref::DeviceProblem device(p);
  DeviceBuffer initial_state(initial), final_state(initial.size());
  CUDA_REQUIRE(cudaMemset(final_state.get(), 0xFF, final_state.bytes()));
  fkda_ref::Buffers buffers = device.buffers();
  buffers.initial_state = initial_state.get();
  buffers.final_state = final_state.get();
  const fkda_fwd_args args = fkda_ref::make_args(p, buffers, dtype);
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &bytes));
  DeviceBuffer workspace(bytes);
  CUDA_REQUIRE(cudaMemset(workspace.get(), 0xFF, workspace.bytes()));
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), bytes, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return Run{device.out.read<uint16_t>(), final_state.read<unsigned char>()};
}

}  // namespace

TEST_CASE("window: workspace sizes of the window rule", "[gpu][window]") {
  // src/gpu/gpu_backend.cpp: windows of at most 256 MiB of records unless 160
  // slots per sequence need more, as few as that allows, of equal slot
  // counts; FKDA_WINDOW_SLOTS sets the slots per window instead.
  struct Shape {
    int64_t tokens, seqs, heads, windows;  // windows: the count without FKDA_WINDOW_SLOTS
  };
  // docs/BENCHMARKS.md's P1, P2, P5, P7 (as 6 sequences of its total), P8 and
  // P10, a long varlen call, and a call without tokens.
  const std::vector<Shape> shapes = {{8192, 1, 96, 3},  {8192, 1, 64, 2},  {32768, 1, 8, 1},  {8192, 6, 96, 1},
                                     {8192, 8, 96, 1},  {512, 1, 32, 1},   {65536, 4, 96, 7}, {0, 3, 4, 1}};
  const int64_t forced = forced_window_slots();
  for (const Shape& s : shapes) {
    CAPTURE(s.tokens, s.seqs, s.heads, forced);
    const int64_t slots = total_slots(s.tokens, s.seqs);
    int64_t per_window = 0, windows = 0;
    if (forced > 0) {
      per_window = std::min(forced, slots);
      windows = (slots + per_window - 1) / per_window;
    } else {
      windows = s.windows;
      per_window = (slots + windows - 1) / windows;
      const int64_t most = std::max<int64_t>(160 * s.seqs, (int64_t(256) << 20) / (s.heads * kRecordBytes));
      CHECK((slots + most - 1) / most == windows);
    }
    const size_t bytes = gpu_workspace(s.heads, s.tokens, s.seqs);
    CHECK(int64_t(bytes) == per_window * s.heads * kRecordBytes + (windows - 1) * s.heads * kCarryBytesPerHead);
  }
  // docs/BENCHMARKS.md's memory target for P1 (682 MB in one window).
  if (forced == 0) CHECK(gpu_workspace(96, 8192, 1) <= size_t(340) * 1000 * 1000);
}

TEST_CASE("window: several windows give the bits of one window per sequence", "[gpu][window]") {
  // 40,000 tokens of 8 heads need two windows by default (2504 slots of
  // 110,592 bytes against a 256 MiB budget), and the middle sequence spans
  // the boundary. Each sequence alone fits one window. With 3 sequences or
  // 1 the V split is the same (N * H <= 33), so only the windows differ.
  const std::vector<int64_t> lengths = {10000, 25000, 5000};
  fkda_ref::Problem p;
  p.H = 8;
  p.cu_seqlens = {0};
  for (int64_t len : lengths) p.cu_seqlens.push_back(p.cu_seqlens.back() + len);
  p.T = p.cu_seqlens.back();
  const size_t token_elems = size_t(p.H * 128);
  p.q = fkda_ref::quick_normals(size_t(p.T) * token_elems, 1);
  p.k = fkda_ref::quick_normals(size_t(p.T) * token_elems, 2);
  p.v = fkda_ref::quick_normals(size_t(p.T) * token_elems, 3);
  p.g = fkda_ref::quick_normals(size_t(p.T) * token_elems, 4);
  p.beta = fkda_ref::quick_normals(size_t(p.T * p.H), 5);
  for (int64_t i = 0; i < p.H; ++i) p.A_log.push_back(float(i + 1) / float(p.H + 1));
  for (int64_t i = 0; i < p.H * 128; ++i) p.dt_bias.push_back(float((i * 2654435761u) % 1000) / 1000.0f);
  const std::vector<uint16_t> state_normals = fkda_ref::quick_normals(size_t(p.state_elems()), 6);
  const size_t matrices = size_t(p.H) * 128 * 128;  // state elements of one sequence
  if (forced_window_slots() == 0) {
    REQUIRE(gpu_workspace(p.H, p.T, p.num_seqs()) < size_t(total_slots(p.T, 3) * p.H * kRecordBytes));
  }

  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    CAPTURE(dtype);
    const size_t width = dtype == FKDA_DTYPE_F32 ? 4 : 2;
    std::vector<unsigned char> initial(state_normals.size() * width);
    for (size_t i = 0; i < state_normals.size(); ++i) {
      const float x = 0.1f * fkda_ref::from_bf16(state_normals[i]);
      if (dtype == FKDA_DTYPE_F32) {
        std::memcpy(&initial[4 * i], &x, 4);
      } else {
        const uint16_t bits = fkda_ref::to_bf16(x);
        std::memcpy(&initial[2 * i], &bits, 2);
      }
    }
    const Run whole = run_gpu(p, dtype, initial);
    CHECK(std::count(whole.out.begin(), whole.out.end(), uint16_t(0xFFFF)) == 0);

    for (size_t n = 0; n < lengths.size(); ++n) {
      CAPTURE(n);
      const int64_t begin = p.cu_seqlens[n], len = lengths[n];
      fkda_ref::Problem alone = p;
      alone.cu_seqlens.clear();
      alone.T = len;
      auto slice = [&](const std::vector<uint16_t>& x, size_t per_token) {
        return std::vector<uint16_t>(x.begin() + std::ptrdiff_t(size_t(begin) * per_token),
                                     x.begin() + std::ptrdiff_t(size_t(begin + len) * per_token));
      };
      alone.q = slice(p.q, token_elems);
      alone.k = slice(p.k, token_elems);
      alone.v = slice(p.v, token_elems);
      alone.g = slice(p.g, token_elems);
      alone.beta = slice(p.beta, size_t(p.H));
      const size_t state_at = n * matrices * width;
      const std::vector<unsigned char> initial_n(initial.begin() + std::ptrdiff_t(state_at),
                                                 initial.begin() + std::ptrdiff_t(state_at + matrices * width));
      const Run part = run_gpu(alone, dtype, initial_n);
      CHECK(std::memcmp(part.out.data(), whole.out.data() + size_t(begin) * token_elems,
                        part.out.size() * sizeof(uint16_t)) == 0);
      CHECK(std::memcmp(part.final_state.data(), whole.final_state.data() + state_at, part.final_state.size()) == 0);
    }
  }
}
