// The GPU prefill through the public API, against the fp64 token-by-token
// recurrence (docs/BENCHMARKS.md accuracy targets) and against the CPU backend
// (same rounding contract, docs/NUMERICS.md) on random inputs. Every run
// poisons its outputs and the workspace first, checks that every output
// element was written and that nothing between strided rows was touched,
// and runs twice (two streams) to check the result is bitwise repeatable.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"

namespace {

using namespace fkda_ref;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // a NaN
constexpr unsigned char kPoisonByte = 0xFF;  // 0xFFFFFFFF is an f32 NaN, 0xFFFF a bf16 NaN

struct Targets {
  double out;
  double state;
};
// docs/BENCHMARKS.md: relative L2 error against the fp64 recurrence.
constexpr Targets kF32StateTargets{4.0e-3, 2.9e-3};
constexpr Targets kBf16StateTargets{6.0e-3, 5.0e-3};
// GPU against the CPU backend: the same contract, so only ulp-level
// differences (hardware exp2, summation order inside the mma) remain.
constexpr double kCpuAgreement = 1.0e-3;

int sm_count() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}

// The V split the library picks (src/gpu/gpu_backend.cpp), for the report.
int expected_vsplit(int64_t seqs_times_heads) {
  if (const char* forced = std::getenv("FKDA_VSPLIT")) {
    const int value = std::atoi(forced);
    if (value == 1 || value == 2 || value == 4 || value == 8) return value;
  }
  int vsplit = 8;
  while (vsplit > 1 && seqs_times_heads * vsplit > 2 * int64_t(sm_count())) vsplit /= 2;
  return vsplit;
}

// ------------------------------------------------------------- layouts ---

// How the activations sit in memory: packed; padded rows (gaps between
// heads, tokens and batch rows); or head-major ([B, H, T, D] memory viewed
// as [B, T, H, D]). Gaps stay poisoned: a read of one shows in the output,
// a write to one is caught by check_gaps.
enum class Arrangement { kContiguous, kPadded, kHeadMajor };

struct Placement {
  int64_t B, T, H, D;  // D == 0: beta, [B, T, H] with no packed axis
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
  size_t elements = 0;

  Placement(Arrangement arrangement, int64_t b, int64_t t, int64_t h, int64_t d) : B(b), T(t), H(h), D(d) {
    const int64_t row = std::max<int64_t>(D, 1);
    switch (arrangement) {
      case Arrangement::kContiguous:
        stride_h = row;
        stride_t = H * stride_h;
        stride_b = T * stride_t;
        break;
      // Rows of 16 bytes where D > 0 (strides in multiples of 8 elements).
      // beta keeps its head axis packed (validation asks for a unit last
      // stride) and pads the others by odd amounts.
      case Arrangement::kPadded:
        stride_h = D > 0 ? D + 8 : 1;
        stride_t = H * stride_h + (D > 0 ? 16 : 3);
        stride_b = T * stride_t + (D > 0 ? 24 : 5);
        break;
      case Arrangement::kHeadMajor:
        if (D > 0) {
          stride_t = D;
          stride_h = T * stride_t + 8;
          stride_b = H * stride_h;
        } else {
          stride_h = 1;
          stride_t = H + 1;
          stride_b = T * stride_t + 7;
        }
        break;
    }
    elements = size_t(std::max<int64_t>(B * stride_b, 1)) + 8;
  }
  size_t at(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return size_t(b * stride_b + t * stride_t + h * stride_h + d);
  }
  fkda_tensor view(void* data) const {
    std::vector<int64_t> shape = {B, T, H};
    if (D > 0) shape.push_back(D);
    fkda_tensor t = tensor(data, FKDA_DTYPE_BF16, shape);
    t.strides[0] = stride_b;
    t.strides[1] = stride_t;
    t.strides[2] = stride_h;
    return t;
  }
  // Contiguous [B, T, H, D] values into a poisoned arena of this placement.
  std::vector<uint16_t> place(const std::vector<uint16_t>& packed) const {
    std::vector<uint16_t> arena(elements, kPoisonBf16);
    const int64_t row = std::max<int64_t>(D, 1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < row; ++d) arena[at(b, t, h, d)] = packed[size_t(((b * T + t) * H + h) * row + d)];
    return arena;
  }
  std::vector<float> gather(const std::vector<uint16_t>& arena) const {
    std::vector<float> packed(size_t(B * T * H * std::max<int64_t>(D, 1)));
    const int64_t row = std::max<int64_t>(D, 1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < row; ++d)
            packed[size_t(((b * T + t) * H + h) * row + d)] = from_bf16(arena[at(b, t, h, d)]);
    return packed;
  }
  // Elements outside the view that differ from the poison: writes out of bounds.
  size_t touched_gaps(const std::vector<uint16_t>& arena) const {
    std::vector<char> inside(arena.size(), 0);
    const int64_t row = std::max<int64_t>(D, 1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < row; ++d) inside[at(b, t, h, d)] = 1;
    size_t touched = 0;
    for (size_t i = 0; i < arena.size(); ++i) touched += !inside[i] && arena[i] != kPoisonBf16;
    return touched;
  }
};

// ------------------------------------------------------------- states ---

size_t state_bytes(int64_t elements, fkda_dtype dtype) {
  return size_t(elements) * (dtype == FKDA_DTYPE_BF16 ? 2 : 4);
}

// f32 [N, H, V, K] (V-first) into the plan's dtype and layout.
std::vector<unsigned char> encode_state(const std::vector<float>& vk, fkda_dtype dtype, fkda_state_layout layout) {
  const size_t matrices = vk.size() / (128 * 128);
  std::vector<unsigned char> bytes(state_bytes(int64_t(vk.size()), dtype));
  for (size_t m = 0; m < matrices; ++m)
    for (size_t e = 0; e < 128; ++e)
      for (size_t k = 0; k < 128; ++k) {
        const float value = vk[(m * 128 + e) * 128 + k];
        const size_t at = m * 128 * 128 + (layout == FKDA_STATE_LAYOUT_VK ? e * 128 + k : k * 128 + e);
        if (dtype == FKDA_DTYPE_BF16) {
          const uint16_t bits = to_bf16(value);
          std::memcpy(bytes.data() + at * 2, &bits, 2);
        } else {
          std::memcpy(bytes.data() + at * 4, &value, 4);
        }
      }
  return bytes;
}

std::vector<float> decode_state(const std::vector<unsigned char>& bytes, fkda_dtype dtype, fkda_state_layout layout) {
  const size_t elements = bytes.size() / (dtype == FKDA_DTYPE_BF16 ? 2 : 4);
  std::vector<float> vk(elements);
  for (size_t m = 0; m < elements / (128 * 128); ++m)
    for (size_t e = 0; e < 128; ++e)
      for (size_t k = 0; k < 128; ++k) {
        const size_t at = m * 128 * 128 + (layout == FKDA_STATE_LAYOUT_VK ? e * 128 + k : k * 128 + e);
        float value;
        if (dtype == FKDA_DTYPE_BF16) {
          uint16_t bits;
          std::memcpy(&bits, bytes.data() + at * 2, 2);
          value = from_bf16(bits);
        } else {
          std::memcpy(&value, bytes.data() + at * 4, 4);
        }
        vk[(m * 128 + e) * 128 + k] = value;
      }
  return vk;
}

// ------------------------------------------------------------- a case ---

struct Case {
  std::string name;
  ProblemShape shape;
  bool with_final = true;
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  fkda_state_layout state_layout = FKDA_STATE_LAYOUT_VK;
  Arrangement arrangement = Arrangement::kContiguous;
  fkda_dtype offsets_dtype = FKDA_DTYPE_I64;
  int64_t offsets_stride = 1;
  uint64_t seed = 1;
  // Added to every key: a shared direction per head, so that keys within a
  // chunk are correlated and the 16x16 inverse's powers of L are far from 0.
  float key_shift = 0.f;
  float beta_shift = 0.f;  // added to every beta logit
};

// A problem's tensors as host arenas in the case's layouts. The same bytes
// go to the device for the GPU run and stay on the host for the CPU run.
struct Arenas {
  Placement act, beta;
  std::vector<uint16_t> q, k, v, g, b, out;
  std::vector<float> A_log, dt_bias;
  std::vector<unsigned char> initial, final, offsets;

  Arenas(const Problem& p, const Case& c)
      : act(c.arrangement, p.B, p.T, p.H, 128), beta(c.arrangement, p.B, p.T, p.H, 0) {
    q = act.place(p.q);
    k = act.place(p.k);
    v = act.place(p.v);
    g = act.place(p.g);
    b = beta.place(p.beta);
    out.assign(act.elements, kPoisonBf16);
    A_log = p.A_log;
    dt_bias = p.dt_bias;
    if (!p.initial_state.empty()) initial = encode_state(p.initial_state, c.state_dtype, c.state_layout);
    if (c.with_final) final.assign(state_bytes(p.state_elems(), c.state_dtype), kPoisonByte);
    if (!p.cu_seqlens.empty()) {
      const size_t width = c.offsets_dtype == FKDA_DTYPE_I32 ? 4 : 8;
      const size_t count = p.cu_seqlens.size();
      offsets.assign(((count - 1) * size_t(c.offsets_stride) + 1) * width, 0x7F);
      for (size_t i = 0; i < count; ++i) {
        unsigned char* at = offsets.data() + i * size_t(c.offsets_stride) * width;
        if (width == 4) {
          const int32_t value = int32_t(p.cu_seqlens[i]);
          std::memcpy(at, &value, 4);
        } else {
          std::memcpy(at, &p.cu_seqlens[i], 8);
        }
      }
    }
  }
};

struct Pointers {
  void *q, *k, *v, *g, *b, *A_log, *dt_bias, *out, *initial, *final, *offsets;
};

fkda_fwd_args make_case_args(const Problem& p, const Case& c, const Arenas& arenas, const Pointers& at) {
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
  const int64_t N = p.num_seqs();
  args.q = arenas.act.view(at.q);
  args.k = arenas.act.view(at.k);
  args.v = arenas.act.view(at.v);
  args.g = arenas.act.view(at.g);
  args.beta = arenas.beta.view(at.b);
  args.out = arenas.act.view(at.out);
  args.A_log = tensor(at.A_log, FKDA_DTYPE_F32, {p.H});
  args.dt_bias = tensor(at.dt_bias, FKDA_DTYPE_F32, {p.H, 128});
  const std::vector<int64_t> state_shape = {N, p.H, 128, 128};
  if (at.initial) args.initial_state = tensor(at.initial, c.state_dtype, state_shape);
  if (at.final) args.final_state = tensor(at.final, c.state_dtype, state_shape);
  if (at.offsets) {
    args.cu_seqlens = tensor(at.offsets, c.offsets_dtype, {N + 1});
    args.cu_seqlens.strides[0] = c.offsets_stride;
  }
  args.scale = p.scale;
  return args;
}

// The device copies of a case's arenas, plus workspace, and one GPU run.
struct DeviceCase {
  const Problem& p;
  const Case& c;
  const Arenas& host;
  DeviceBuffer q, k, v, g, b, A_log, dt_bias, out, initial, final, offsets, workspace;
  Plan plan;
  fkda_fwd_args args;

  static size_t workspace_bytes(const Problem& p, const Case& c) {
    Plan plan(plan_desc(p.H, p.lower_bound, c.state_dtype, c.state_layout));
    size_t bytes = 0;
    FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &bytes));
    return bytes;
  }

  DeviceCase(const Problem& problem, const Case& a_case, const Arenas& arenas)
      : p(problem), c(a_case), host(arenas),
        q(arenas.q.size() * 2), k(arenas.k.size() * 2), v(arenas.v.size() * 2), g(arenas.g.size() * 2),
        b(arenas.b.size() * 2), A_log(arenas.A_log.size() * 4), dt_bias(arenas.dt_bias.size() * 4),
        out(arenas.out.size() * 2), initial(arenas.initial.size()), final(arenas.final.size()),
        offsets(arenas.offsets.size()), workspace(workspace_bytes(problem, a_case)),
        plan(plan_desc(problem.H, problem.lower_bound, a_case.state_dtype, a_case.state_layout)) {
    q.upload(arenas.q.data());
    k.upload(arenas.k.data());
    v.upload(arenas.v.data());
    g.upload(arenas.g.data());
    b.upload(arenas.b.data());
    A_log.upload(arenas.A_log.data());
    dt_bias.upload(arenas.dt_bias.data());
    if (!arenas.initial.empty()) initial.upload(arenas.initial.data());
    if (!arenas.offsets.empty()) offsets.upload(arenas.offsets.data());
    Pointers at{q.get(), k.get(), v.get(), g.get(), b.get(), A_log.get(), dt_bias.get(), out.get(),
                arenas.initial.empty() ? nullptr : initial.get(), arenas.final.empty() ? nullptr : final.get(),
                arenas.offsets.empty() ? nullptr : offsets.get()};
    args = make_case_args(problem, a_case, arenas, at);
  }

  // Outputs and workspace full of NaNs, so anything left unwritten shows.
  void poison() {
    out.upload(host.out.data());  // the host arena is still all poison
    if (final.bytes()) CUDA_REQUIRE(cudaMemset(final.get(), kPoisonByte, final.bytes()));
    CUDA_REQUIRE(cudaMemset(workspace.get(), kPoisonByte, workspace.bytes()));
  }

  void run(cudaStream_t stream) {
    poison();
    CUDA_REQUIRE(cudaDeviceSynchronize());
    FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), workspace.bytes(), stream));
    CUDA_REQUIRE(cudaGetLastError());
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
  }

  struct Result {
    std::vector<uint16_t> out;
    std::vector<unsigned char> final;
    bool operator==(const Result& o) const { return out == o.out && final == o.final; }
  };
  Result fetch() const {
    Result r;
    r.out.resize(host.out.size());
    out.download(r.out.data());
    r.final.resize(host.final.size());
    if (!r.final.empty()) final.download(r.final.data());
    return r;
  }
};

// The CPU backend on the host arenas.
DeviceCase::Result run_cpu(const Problem& p, const Case& c, const Arenas& arenas) {
  Arenas copy = arenas;
  Plan plan(plan_desc(p.H, p.lower_bound, c.state_dtype, c.state_layout, FKDA_BACKEND_CPU));
  Pointers at{copy.q.data(), copy.k.data(), copy.v.data(), copy.g.data(), copy.b.data(), copy.A_log.data(),
              copy.dt_bias.data(), copy.out.data(), copy.initial.empty() ? nullptr : copy.initial.data(),
              copy.final.empty() ? nullptr : copy.final.data(), copy.offsets.empty() ? nullptr : copy.offsets.data()};
  const fkda_fwd_args args = make_case_args(p, c, copy, at);
  size_t workspace_bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &workspace_bytes));
  std::vector<std::max_align_t> workspace(workspace_bytes / sizeof(std::max_align_t) + 1);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.data(), workspace_bytes, nullptr));
  return DeviceCase::Result{copy.out, copy.final};
}

std::vector<double> widen(const std::vector<float>& values) { return std::vector<double>(values.begin(), values.end()); }

size_t count_nan(const std::vector<float>& values) {
  return size_t(std::count_if(values.begin(), values.end(), [](float x) { return std::isnan(x); }));
}

// The problem of a case, with the initial state rounded to the state dtype
// so that the reference starts from exactly what the kernels read.
Problem problem_of(const Case& c) {
  Problem p = random_problem(c.shape, c.seed);
  if (c.state_dtype == FKDA_DTYPE_BF16)
    for (float& x : p.initial_state) x = from_bf16(to_bf16(x));
  if (c.key_shift != 0.f) {
    const Problem directions = random_problem(ProblemShape{1, 1, p.H, {}, false}, c.seed + 1000);
    for (size_t i = 0; i < p.k.size(); ++i) {
      const size_t d = i % size_t(p.K), h = (i / size_t(p.K)) % size_t(p.H);
      p.k[i] = to_bf16(from_bf16(p.k[i]) + c.key_shift * from_bf16(directions.k[h * size_t(p.K) + d]));
    }
  }
  if (c.beta_shift != 0.f)
    for (uint16_t& x : p.beta) x = to_bf16(from_bf16(x) + c.beta_shift);
  return p;
}

struct Figures {
  double out_vs_ref = 0, state_vs_ref = 0, out_vs_cpu = 0, state_vs_cpu = 0;
};

// Runs one case on the GPU (twice: a non-blocking stream, then the legacy
// default stream) and on the CPU backend, and checks everything.
Figures check_case(const Case& c) {
  const Problem p = problem_of(c);
  const Arenas arenas(p, c);
  DeviceCase device(p, c, arenas);
  const int64_t N = p.num_seqs();
  INFO("case " << c.name << ": B=" << p.B << " T=" << p.T << " H=" << p.H << " N=" << N);

  Stream stream;
  device.run(stream.get());
  const DeviceCase::Result first = device.fetch();
  device.run(nullptr);
  const DeviceCase::Result second = device.fetch();
  CHECK(first == second);  // bitwise, across streams

  // Every output element written, nothing outside the views touched.
  const std::vector<float> out = arenas.act.gather(first.out);
  CHECK(count_nan(out) == 0);
  CHECK(arenas.act.touched_gaps(first.out) == 0);
  std::vector<float> state;
  if (c.with_final) {
    state = decode_state(first.final, c.state_dtype, c.state_layout);
    CHECK(count_nan(state) == 0);
  }

  const Reference ref = reference_recurrence(p);
  const DeviceCase::Result cpu = run_cpu(p, c, arenas);
  const std::vector<float> cpu_out = arenas.act.gather(cpu.out);

  Figures f;
  f.out_vs_ref = rel_l2(out, ref.out);
  f.out_vs_cpu = rel_l2(out, widen(cpu_out));
  if (c.with_final) {
    f.state_vs_ref = rel_l2(state, ref.final_state);
    f.state_vs_cpu = rel_l2(state, widen(decode_state(cpu.final, c.state_dtype, c.state_layout)));
  }
  const Targets targets = c.state_dtype == FKDA_DTYPE_BF16 ? kBf16StateTargets : kF32StateTargets;
  std::printf("%-34s N=%-3lld H=%-3lld vsplit=%d  vs fp64: out %.3e state %.3e | vs CPU: out %.3e state %.3e\n",
              c.name.c_str(), (long long)N, (long long)p.H, expected_vsplit(N * p.H), f.out_vs_ref,
              f.state_vs_ref, f.out_vs_cpu, f.state_vs_cpu);
  std::fflush(stdout);
  CHECK(f.out_vs_ref <= targets.out);
  CHECK(f.state_vs_ref <= targets.state);
  CHECK(f.out_vs_cpu <= kCpuAgreement);
  CHECK(f.state_vs_cpu <= kCpuAgreement);
  return f;
}

Case batched(std::string name, int64_t B, int64_t T, int64_t H, uint64_t seed) {
  Case c;
  c.name = std::move(name);
  c.shape.B = B;
  c.shape.T = T;
  c.shape.H = H;
  c.seed = seed;
  return c;
}

Case varlen(std::string name, std::vector<int64_t> lengths, int64_t H, uint64_t seed) {
  Case c;
  c.name = std::move(name);
  c.shape.lengths = std::move(lengths);
  c.shape.H = H;
  c.seed = seed;
  return c;
}

Case with_state(Case c, fkda_dtype dtype, fkda_state_layout layout, bool initial, bool final) {
  c.state_dtype = dtype;
  c.state_layout = layout;
  c.shape.with_initial_state = initial;
  c.with_final = final;
  return c;
}

}  // namespace

// ------------------------------------------------------------- tests ---

TEST_CASE("prefill: docs/BENCHMARKS.md accuracy cases", "[gpu][window]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    const char* suffix = dtype == FKDA_DTYPE_F32 ? " f32" : " bf16";
    check_case(with_state(batched(std::string("T=1024 H=4") + suffix, 1, 1024, 4, 11), dtype,
                          FKDA_STATE_LAYOUT_VK, true, true));
    check_case(with_state(varlen(std::string("varlen [300,77,700] H=4") + suffix, {300, 77, 700}, 4, 12), dtype,
                          FKDA_STATE_LAYOUT_VK, true, true));
  }
}

TEST_CASE("prefill: varlen with empty, short, chunk-edge and long sequences", "[gpu][vsplit][window]") {
  const std::vector<int64_t> lengths = {0, 1, 15, 16, 17, 0, 33, 200, 5, 0};
  for (fkda_dtype offsets : {FKDA_DTYPE_I64, FKDA_DTYPE_I32}) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
        Case c = with_state(varlen("edges", lengths, 3, 21 + dtype + 10 * layout), dtype, layout, true, true);
        c.offsets_dtype = offsets;
        c.name = std::string("edges ") + (offsets == FKDA_DTYPE_I64 ? "i64 " : "i32 ") +
                 (dtype == FKDA_DTYPE_F32 ? "f32 " : "bf16 ") + (layout == FKDA_STATE_LAYOUT_VK ? "VK" : "KV");
        check_case(c);
      }
    }
  }
}

TEST_CASE("prefill: sequences across many windows", "[gpu][window]") {
  // Under gpu_check.sh's forced small windows (FKDA_WINDOW_SLOTS) the long
  // sequences cross several window boundaries, the short ones sit inside a
  // window or start or end at a boundary, and the empty ones fall anywhere.
  const std::vector<int64_t> lengths = {0, 1, 15, 16, 17, 0, 300, 5, 0, 129, 64, 0, 47};
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
      Case c = with_state(varlen("windows", lengths, 2, 141 + dtype + 10 * layout), dtype, layout, true, true);
      c.name = std::string("windows ") + (dtype == FKDA_DTYPE_F32 ? "f32 " : "bf16 ") +
               (layout == FKDA_STATE_LAYOUT_VK ? "VK" : "KV");
      check_case(c);
    }
  }
  for (int presence = 0; presence < 4; ++presence) {
    const bool initial = presence & 1, final = presence & 2;
    Case c = with_state(batched("windows batched", 3, 100, 2, 151 + presence), FKDA_DTYPE_BF16,
                        FKDA_STATE_LAYOUT_VK, initial, final);
    c.name = std::string("windows batched initial=") + std::to_string(initial) + " final=" + std::to_string(final);
    check_case(c);
  }
}

TEST_CASE("prefill: every presence of initial and final state", "[gpu][vsplit][window]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (int presence = 0; presence < 4; ++presence) {
      const bool initial = presence & 1, final = presence & 2;
      Case c = with_state(batched("presence", 2, 45, 2, 31 + presence), dtype,
                          presence == 3 ? FKDA_STATE_LAYOUT_KV : FKDA_STATE_LAYOUT_VK, initial, final);
      c.name = std::string("presence ") + (dtype == FKDA_DTYPE_F32 ? "f32" : "bf16") + " initial=" +
               std::to_string(initial) + " final=" + std::to_string(final);
      check_case(c);
    }
  }
}

TEST_CASE("prefill: strided activations and offsets", "[gpu][vsplit][window]") {
  Case padded = varlen("padded rows, i32 offsets", {40, 0, 17, 64}, 3, 41);
  padded.arrangement = Arrangement::kPadded;
  padded.offsets_dtype = FKDA_DTYPE_I32;
  check_case(padded);

  Case head_major = with_state(batched("head-major [B,H,T,D]", 2, 70, 3, 42), FKDA_DTYPE_BF16,
                               FKDA_STATE_LAYOUT_KV, true, true);
  head_major.arrangement = Arrangement::kHeadMajor;
  check_case(head_major);

  Case padded_batched = batched("padded batched", 3, 19, 2, 43);
  padded_batched.arrangement = Arrangement::kPadded;
  check_case(padded_batched);
}

TEST_CASE("prefill: shapes that reach every V split", "[gpu]") {
  // N * H against 2 * SMs picks the split (src/gpu/gpu_backend.cpp); these
  // products land on 8, 4, 2 and 1 for any GPU with 64 to 200 SMs.
  const int sms = sm_count();
  struct Shape {
    int64_t N, H;
  };
  const std::vector<Shape> shapes = {{1, 4}, {sms / 4, 2}, {sms / 2, 2}, {3 * sms / 2, 2}};
  uint64_t seed = 51;
  for (const Shape& s : shapes) {
    std::vector<int64_t> lengths;
    for (int64_t n = 0; n < s.N; ++n) lengths.push_back((n * 37) % 53);  // 0 .. 52 tokens
    Case c = varlen("vsplit N=" + std::to_string(s.N), lengths, s.H, seed++);
    check_case(c);
  }
  Case wide = batched("vsplit batched B=1", 1, 300, 1, seed++);
  check_case(wide);
}

TEST_CASE("prefill: gate floors other than -5", "[gpu]") {
  for (float lower_bound : {-0.5f, 0.0f, -3.25f}) {
    Case c = batched("lower_bound " + std::to_string(lower_bound), 2, 80, 2, 61);
    c.shape.lower_bound = lower_bound;
    check_case(c);
  }
}

TEST_CASE("prefill: correlated keys, so that the chunk inverse has large powers", "[gpu]") {
  // Keys sharing a direction (cosine about 0.5) and betas shifted towards 1
  // make L's entries large, so L^2, L^4 and L^8 cancel in (I + L)^-1 (the
  // more so under a weak gate): the tensor-core products of the inverse must
  // keep the CPU backend's f32-level agreement there.
  for (float lower_bound : {-5.0f, -0.5f}) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      Case c = with_state(varlen("correlated keys", {16, 100, 333}, 2, 131), dtype, FKDA_STATE_LAYOUT_VK, true,
                          true);
      c.name = std::string("correlated keys lb ") + std::to_string(lower_bound) +
               (dtype == FKDA_DTYPE_F32 ? " f32" : " bf16");
      c.shape.lower_bound = lower_bound;
      c.key_shift = 1.0f;
      c.beta_shift = 1.0f;
      check_case(c);
    }
  }
}

TEST_CASE("prefill: zero-length sequences copy their initial state bit for bit", "[gpu][window]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    Case c = with_state(varlen("empties", {0, 20, 0, 0}, 2, 71), dtype, FKDA_STATE_LAYOUT_KV, true, true);
    const Problem p = problem_of(c);
    const Arenas arenas(p, c);
    DeviceCase device(p, c, arenas);
    device.run(nullptr);
    const DeviceCase::Result result = device.fetch();
    const size_t matrix = state_bytes(128 * 128, dtype);
    for (int64_t n : {0, 2, 3}) {
      for (int64_t h = 0; h < p.H; ++h) {
        const size_t at = size_t(n * p.H + h) * matrix;
        CHECK(std::memcmp(result.final.data() + at, arenas.initial.data() + at, matrix) == 0);
      }
    }
    // Without an initial state they end at exactly zero.
    Case zero = c;
    zero.shape.with_initial_state = false;
    const Problem pz = problem_of(zero);
    const Arenas az(pz, zero);
    DeviceCase dz(pz, zero, az);
    dz.run(nullptr);
    const std::vector<float> state = decode_state(dz.fetch().final, dtype, FKDA_STATE_LAYOUT_KV);
    for (int64_t n : {0, 2, 3})
      for (size_t i = size_t(n * pz.H) * 128 * 128; i < size_t((n + 1) * pz.H) * 128 * 128; ++i)
        REQUIRE(state[i] == 0.0f);
  }
}

TEST_CASE("prefill: a sequence split at a chunk boundary equals the whole", "[gpu][window]") {
  // With f32 state and a split at a multiple of 16 the chunks are the same,
  // so the state handed from the first half to the second is exact.
  Case whole = batched("whole", 1, 96, 2, 81);
  const Problem p = problem_of(whole);
  const Arenas arenas(p, whole);
  DeviceCase device(p, whole, arenas);
  device.run(nullptr);
  const DeviceCase::Result all = device.fetch();

  Case halves = varlen("halves", {48, 48}, 2, 81);
  Problem split = p;
  split.cu_seqlens = {0, 48, 96};
  split.initial_state.resize(size_t(2 * p.H * 128 * 128));
  std::copy(p.initial_state.begin(), p.initial_state.end(), split.initial_state.begin());
  const Arenas first_arenas(split, halves);
  DeviceCase first(split, halves, first_arenas);
  first.run(nullptr);
  const DeviceCase::Result first_result = first.fetch();
  // The first sequence's output is the whole one's first 48 tokens.
  const std::vector<float> whole_out = arenas.act.gather(all.out);
  const std::vector<float> split_out = first_arenas.act.gather(first_result.out);
  const size_t half = size_t(48 * p.H * 128);
  CHECK(std::equal(whole_out.begin(), whole_out.begin() + std::ptrdiff_t(half), split_out.begin()));

  // Second half alone, starting from the first half's final state.
  Problem second = p;
  second.T = 48;
  const size_t token_elems = size_t(p.H * 128);
  auto tail = [&](const std::vector<uint16_t>& x, size_t per_token) {
    return std::vector<uint16_t>(x.begin() + std::ptrdiff_t(48 * per_token), x.end());
  };
  second.q = tail(p.q, token_elems);
  second.k = tail(p.k, token_elems);
  second.v = tail(p.v, token_elems);
  second.g = tail(p.g, token_elems);
  second.beta = tail(p.beta, size_t(p.H));
  const std::vector<float> mid = decode_state(first_result.final, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
  second.initial_state.assign(mid.begin(), mid.begin() + std::ptrdiff_t(p.H * 128 * 128));
  Case second_case = batched("second half", 1, 48, 2, 81);
  const Arenas second_arenas(second, second_case);
  DeviceCase second_device(second, second_case, second_arenas);
  second_device.run(nullptr);
  const DeviceCase::Result second_result = second_device.fetch();
  const std::vector<float> second_out = second_arenas.act.gather(second_result.out);
  CHECK(std::equal(second_out.begin(), second_out.end(), whole_out.begin() + std::ptrdiff_t(half)));
  CHECK(second_result.final == all.final);
}

TEST_CASE("prefill: a captured CUDA graph replays the direct run", "[gpu][window]") {
  Case c = with_state(varlen("graph", {100, 3, 64, 29}, 4, 91), FKDA_DTYPE_BF16, FKDA_STATE_LAYOUT_VK, true, true);
  const Problem p = problem_of(c);
  const Arenas arenas(p, c);
  DeviceCase device(p, c, arenas);
  Stream stream;
  device.run(stream.get());
  const DeviceCase::Result direct = device.fetch();

  cudaGraph_t graph = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  const fkda_status captured =
      fkda_fwd(device.plan.get(), &device.args, device.workspace.get(), device.workspace.bytes(), stream.get());
  CUDA_REQUIRE(cudaStreamEndCapture(stream.get(), &graph));
  INFO(fkda_last_error());
  REQUIRE(captured == FKDA_SUCCESS);
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    device.poison();
    CUDA_REQUIRE(cudaDeviceSynchronize());
    CUDA_REQUIRE(cudaGraphLaunch(exec, stream.get()));
    CUDA_REQUIRE(cudaStreamSynchronize(stream.get()));
    CHECK(device.fetch() == direct);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("prefill: device offsets out of range or unsorted are clamped", "[gpu][sanitize]") {
  // The host never reads cu_seqlens on a GPU plan; the kernels must stay
  // inside every tensor whatever the offsets say.
  Case c = varlen("bad offsets", {30, 20, 14}, 2, 101);
  c.arrangement = Arrangement::kPadded;
  const Problem p = problem_of(c);
  const Arenas arenas(p, c);
  DeviceCase device(p, c, arenas);
  const std::vector<std::vector<int64_t>> offsets = {
      {0, 50, 20, 64},        // unsorted
      {-7, 10, 1000, 64},     // below 0 and past T
      {64, 0, 64, 3},         // reversed
      {0, 64, 64, 1LL << 40}  // far out
  };
  for (const auto& bad : offsets) {
    std::vector<unsigned char> bytes(bad.size() * 8);
    std::memcpy(bytes.data(), bad.data(), bytes.size());
    device.offsets.upload(bytes.data());
    device.run(nullptr);
    CHECK(arenas.act.touched_gaps(device.fetch().out) == 0);
  }
}

TEST_CASE("prefill: small cases for compute-sanitizer", "[sanitize]") {
  check_case(with_state(varlen("sanitize f32 VK", {0, 1, 15, 16, 17, 40}, 2, 111), FKDA_DTYPE_F32,
                        FKDA_STATE_LAYOUT_VK, true, true));
  Case strided = with_state(batched("sanitize bf16 KV padded", 2, 33, 2, 112), FKDA_DTYPE_BF16,
                            FKDA_STATE_LAYOUT_KV, true, true);
  strided.arrangement = Arrangement::kPadded;
  check_case(strided);
  check_case(varlen("sanitize vsplit 1", std::vector<int64_t>(size_t(2 * sm_count()), 9), 1, 113));
}

// ------------------------------------------------------------- timing ---

namespace {


void time_case(const char* id, int64_t T, int64_t H, fkda_dtype state_dtype) {
  const int64_t tokens = T * H;
  DeviceBuffer q(size_t(tokens) * 256), k(size_t(tokens) * 256), v(size_t(tokens) * 256), g(size_t(tokens) * 256);
  DeviceBuffer beta(size_t(tokens) * 2), out(size_t(tokens) * 256);
  DeviceBuffer A_log(size_t(H) * 4), dt_bias(size_t(H) * 512);
  const size_t state = state_bytes(H * 128 * 128, state_dtype);
  DeviceBuffer initial(state), final(state);
  uint64_t seed = 1;
  for (DeviceBuffer* b : {&q, &k, &v, &g, &beta}) b->upload(quick_normals(b->bytes() / 2, seed++).data());
  std::vector<float> small(size_t(H) * 128);
  for (size_t i = 0; i < small.size(); ++i) small[i] = float((i * 2654435761u) % 1000) / 1000.0f;
  A_log.upload(small.data());
  dt_bias.upload(small.data());
  const std::vector<uint16_t> normals = quick_normals(size_t(H) * 128 * 128, seed++);
  std::vector<float> state_values(normals.size());
  for (size_t i = 0; i < normals.size(); ++i) state_values[i] = 0.1f * from_bf16(normals[i]);
  initial.upload(encode_state(state_values, state_dtype, FKDA_STATE_LAYOUT_VK).data());

  Plan plan(plan_desc(H, -5.0f, state_dtype, FKDA_STATE_LAYOUT_VK));
  size_t workspace_bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), T, 1, &workspace_bytes));
  DeviceBuffer workspace(workspace_bytes);
  Problem shape;
  shape.B = 1;
  shape.T = T;
  shape.H = H;
  Buffers buffers{q.get(), k.get(), v.get(), g.get(), beta.get(), A_log.get(), dt_bias.get(), out.get(),
                  initial.get(), final.get(), nullptr};
  const fkda_fwd_args args = make_args(shape, buffers, state_dtype);

  Stream stream;
  cudaEvent_t start, stop;
  CUDA_REQUIRE(cudaEventCreate(&start));
  CUDA_REQUIRE(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), workspace_bytes, stream.get()));
  std::vector<float> times;
  for (int i = 0; i < 30; ++i) {
    CUDA_REQUIRE(cudaEventRecord(start, stream.get()));
    FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), workspace_bytes, stream.get()));
    CUDA_REQUIRE(cudaEventRecord(stop, stream.get()));
    CUDA_REQUIRE(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_REQUIRE(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  std::vector<uint16_t> result(size_t(tokens) * 128);
  out.download(result.data());
  const size_t nans = size_t(std::count_if(result.begin(), result.end(), [](uint16_t x) {
    return (x & 0x7F80) == 0x7F80;
  }));
  std::printf("timing %-4s T=%lld H=%-3lld state %s vsplit=%d: median %.3f ms (min %.3f, max %.3f), workspace %.3f GB\n",
              id, (long long)T, (long long)H, state_dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32", expected_vsplit(H),
              times[times.size() / 2], times.front(), times.back(), double(workspace_bytes) / 1e9);
  std::fflush(stdout);
  CHECK(nans == 0);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace

TEST_CASE("prefill timing: docs/BENCHMARKS.md P1 and P4", "[.][timing]") {
  time_case("P1", 8192, 96, FKDA_DTYPE_BF16);
  time_case("P4", 8192, 8, FKDA_DTYPE_BF16);
  time_case("P1", 8192, 96, FKDA_DTYPE_F32);
  time_case("P5", 32768, 8, FKDA_DTYPE_BF16);
}
