// SPDX-License-Identifier: MIT
#include "prefill_harness.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace fkda_test {

using fkda_ref::from_bf16;
using fkda_ref::tensor;
using fkda_ref::to_bf16;

// ------------------------------------------------------- environment ---

ScopedEnv::ScopedEnv(const char* name, int64_t value) : name_(name) {
  if (value < 0) return;
  touched_ = true;
  if (const char* old = std::getenv(name)) {
    was_set_ = true;
    old_value_ = old;
  }
  if (value == 0) {
    unsetenv(name);
  } else {
    setenv(name, std::to_string(value).c_str(), 1);
  }
}

ScopedEnv::ScopedEnv(const char* name, const char* text) : name_(name) {
  if (text == nullptr) return;
  touched_ = true;
  if (const char* old = std::getenv(name)) {
    was_set_ = true;
    old_value_ = old;
  }
  setenv(name, text, 1);
}

const char* chunk_parallel_text(int64_t chunk_parallel) {
  switch (chunk_parallel) {
    case FKDA_CHUNK_PARALLEL_AUTO:
      return "auto";
    case FKDA_CHUNK_PARALLEL_OFF:
      return "off";
    case FKDA_CHUNK_PARALLEL_ON:
      return "on";
    default:
      return nullptr;
  }
}

Case in_segments(Case c, int64_t chunks) {
  c.chunk_parallel = FKDA_CHUNK_PARALLEL_ON;
  c.segment_chunks = chunks;
  c.name += " segments of " + std::to_string(chunks);
  return c;
}

ScopedEnv::~ScopedEnv() {
  if (!touched_) return;
  if (was_set_) {
    setenv(name_.c_str(), old_value_.c_str(), 1);
  } else {
    unsetenv(name_.c_str());
  }
}

// ------------------------------------------------------------ layouts ---

Placement::Placement(Arrangement arrangement, int64_t b, int64_t t, int64_t h, int64_t d) : B(b), T(t), H(h), D(d) {
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

fkda_tensor Placement::view(void* data) const {
  std::vector<int64_t> shape = {B, T, H};
  if (D > 0) shape.push_back(D);
  fkda_tensor t = tensor(data, FKDA_DTYPE_BF16, shape);
  t.strides[0] = stride_b;
  t.strides[1] = stride_t;
  t.strides[2] = stride_h;
  return t;
}

std::vector<uint16_t> Placement::place(const std::vector<uint16_t>& packed) const {
  std::vector<uint16_t> arena(elements, kPoisonBf16);
  const int64_t row = std::max<int64_t>(D, 1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < row; ++d) arena[at(b, t, h, d)] = packed[size_t(((b * T + t) * H + h) * row + d)];
  return arena;
}

std::vector<float> Placement::gather(const std::vector<uint16_t>& arena) const {
  std::vector<float> packed(size_t(B * T * H * std::max<int64_t>(D, 1)));
  const int64_t row = std::max<int64_t>(D, 1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < row; ++d)
          packed[size_t(((b * T + t) * H + h) * row + d)] = from_bf16(arena[at(b, t, h, d)]);
  return packed;
}

size_t Placement::touched_gaps(const std::vector<uint16_t>& arena) const {
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

// ------------------------------------------------------------- states ---

size_t state_bytes(int64_t elements, fkda_dtype dtype) {
  return size_t(elements) * (dtype == FKDA_DTYPE_BF16 ? 2 : 4);
}

namespace {

size_t state_index(size_t matrix, size_t e, size_t k, fkda_state_layout layout) {
  return matrix * 128 * 128 + (layout == FKDA_STATE_LAYOUT_VK ? e * 128 + k : k * 128 + e);
}

}  // namespace

std::vector<unsigned char> encode_state(const std::vector<float>& vk, fkda_dtype dtype, fkda_state_layout layout) {
  const size_t matrices = vk.size() / (128 * 128);
  std::vector<unsigned char> bytes(state_bytes(int64_t(vk.size()), dtype));
  for (size_t m = 0; m < matrices; ++m)
    for (size_t e = 0; e < 128; ++e)
      for (size_t k = 0; k < 128; ++k) {
        const float value = vk[(m * 128 + e) * 128 + k];
        const size_t at = state_index(m, e, k, layout);
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
        const size_t at = state_index(m, e, k, layout);
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

// -------------------------------------------------------------- cases ---

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

Case slowly_decaying(Case c) {
  c.shape = fkda_ref::slow_decay(c.shape);
  c.slow = true;
  c.name += " slow decay";
  return c;
}

fkda_ref::AccuracyTargets targets_of(const Case& c) { return fkda_ref::accuracy_targets(c.state_dtype, c.slow); }

Problem problem_of(const Case& c) {
  Problem p = fkda_ref::random_problem(c.shape, c.seed);
  if (c.state_dtype == FKDA_DTYPE_BF16)
    for (float& x : p.initial_state) x = from_bf16(to_bf16(x));
  if (c.key_shift != 0.f) {
    const Problem directions = fkda_ref::random_problem(ProblemShape{1, 1, p.H, {}, false}, c.seed + 1000);
    for (size_t i = 0; i < p.k.size(); ++i) {
      const size_t d = i % size_t(p.K), h = (i / size_t(p.K)) % size_t(p.H);
      p.k[i] = to_bf16(from_bf16(p.k[i]) + c.key_shift * from_bf16(directions.k[h * size_t(p.K) + d]));
    }
  }
  if (c.beta_shift != 0.f)
    for (uint16_t& x : p.beta) x = to_bf16(from_bf16(x) + c.beta_shift);
  if (c.saturation != Saturation::kNone) {
    // Sequence starts in the packed token order: rows, or cu_seqlens.
    std::vector<int64_t> starts;
    if (p.cu_seqlens.empty()) {
      for (int64_t b = 0; b <= p.B; ++b) starts.push_back(b * p.T);
    } else {
      starts = p.cu_seqlens;
    }
    const size_t token_elems = size_t(p.H * p.K);
    for (size_t n = 0; n + 1 < starts.size(); ++n)
      for (int64_t t = starts[n]; t < starts[n + 1]; ++t) {
        if (c.saturation == Saturation::kEveryOtherChunk && ((t - starts[n]) / 16) % 2 == 1) continue;
        for (size_t i = size_t(t) * token_elems; i < size_t(t + 1) * token_elems; ++i)
          p.g[i] = to_bf16(from_bf16(p.g[i]) + 36.f);
      }
  }
  return p;
}

// ------------------------------------------------------------ arenas ---

Arenas::Arenas(const Problem& p, const Case& c)
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

namespace {

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

size_t gpu_workspace_bytes(const Problem& p, const Case& c) {
  Plan plan(plan_desc(p.H, p.lower_bound, c.state_dtype, c.state_layout));
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &bytes));
  return bytes;
}

}  // namespace

// ------------------------------------------------------------ one run ---

DeviceCase::DeviceCase(const Problem& problem, const Case& a_case, const Arenas& arenas)
    : p(problem), c(a_case), host(arenas),
      q(arenas.q.size() * 2), k(arenas.k.size() * 2), v(arenas.v.size() * 2), g(arenas.g.size() * 2),
      b(arenas.b.size() * 2), A_log(arenas.A_log.size() * 4), dt_bias(arenas.dt_bias.size() * 4),
      out(arenas.out.size() * 2), initial(arenas.initial.size()), final(arenas.final.size()),
      offsets(arenas.offsets.size()), workspace(gpu_workspace_bytes(problem, a_case)),
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
  const Pointers at{q.get(), k.get(), v.get(), g.get(), b.get(), A_log.get(), dt_bias.get(), out.get(),
                    arenas.initial.empty() ? nullptr : initial.get(), arenas.final.empty() ? nullptr : final.get(),
                    arenas.offsets.empty() ? nullptr : offsets.get()};
  args = make_case_args(problem, a_case, arenas, at);
}

void DeviceCase::poison() {
  out.upload(host.out.data());  // the host arena is still all poison
  if (final.bytes()) CUDA_REQUIRE(cudaMemset(final.get(), kPoisonByte, final.bytes()));
  CUDA_REQUIRE(cudaMemset(workspace.get(), kPoisonByte, workspace.bytes()));
}

void DeviceCase::run(cudaStream_t stream) {
  poison();
  CUDA_REQUIRE(cudaDeviceSynchronize());
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), workspace.bytes(), stream));
  CUDA_REQUIRE(cudaGetLastError());
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
}

fkda_launch_report check_graph_replays(const Case& c) {
  const Tuning tuning(c.vsplit, c.window_slots, c.chunk_parallel, c.segment_chunks);
  const Problem p = problem_of(c);
  const Arenas arenas(p, c);
  DeviceCase device(p, c, arenas);
  Stream owned;
  const cudaStream_t stream = owned.get();
  device.run(stream);
  const Result direct = device.fetch();
  const fkda_launch_report report = launch_report(device.plan.get());

  const fkda_ref::CapturedCall graph(stream, cudaStreamCaptureModeThreadLocal, [&] {
    return fkda_fwd(device.plan.get(), &device.args, device.workspace.get(), device.workspace.bytes(), stream);
  });
  for (int replay = 0; replay < 2; ++replay) {
    device.poison();
    CUDA_REQUIRE(cudaDeviceSynchronize());
    graph.replay(stream);
    CHECK(device.fetch() == direct);
  }
  return report;
}

Result DeviceCase::fetch() const {
  Result r;
  r.out.resize(host.out.size());
  out.download(r.out.data());
  r.final.resize(host.final.size());
  if (!r.final.empty()) final.download(r.final.data());
  return r;
}

Result run_cpu(const Problem& p, const Case& c, const Arenas& arenas) {
  Arenas copy = arenas;
  Plan plan(plan_desc(p.H, p.lower_bound, c.state_dtype, c.state_layout, FKDA_BACKEND_CPU));
  const Pointers at{copy.q.data(), copy.k.data(), copy.v.data(), copy.g.data(), copy.b.data(), copy.A_log.data(),
                    copy.dt_bias.data(), copy.out.data(), copy.initial.empty() ? nullptr : copy.initial.data(),
                    copy.final.empty() ? nullptr : copy.final.data(),
                    copy.offsets.empty() ? nullptr : copy.offsets.data()};
  const fkda_fwd_args args = make_case_args(p, c, copy, at);
  size_t workspace_bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &workspace_bytes));
  std::vector<std::max_align_t> workspace(workspace_bytes / sizeof(std::max_align_t) + 1);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.data(), workspace_bytes, nullptr));
  return Result{copy.out, copy.final};
}

Outputs run_gpu(const Problem& p, const Case& c) {
  const Tuning tuning(c.vsplit, c.window_slots, c.chunk_parallel, c.segment_chunks);
  const Arenas arenas(p, c);
  DeviceCase device(p, c, arenas);
  device.run(nullptr);
  const Result result = device.fetch();
  Outputs outputs;
  outputs.out = arenas.act.gather(result.out);
  if (c.with_final) outputs.state = decode_state(result.final, c.state_dtype, c.state_layout);
  outputs.launch = launch_report(device.plan.get());
  return outputs;
}

// ------------------------------------------------------------- checks ---

namespace {

std::vector<double> widen(const std::vector<float>& values) { return std::vector<double>(values.begin(), values.end()); }

size_t count_nan(const std::vector<float>& values) {
  return size_t(std::count_if(values.begin(), values.end(), [](float x) { return std::isnan(x); }));
}

}  // namespace

Checked check_case(const Case& c) {
  const Tuning tuning(c.vsplit, c.window_slots, c.chunk_parallel, c.segment_chunks);
  const Problem p = problem_of(c);
  const Arenas arenas(p, c);
  DeviceCase device(p, c, arenas);
  const int64_t N = p.num_seqs();
  INFO("case " << c.name << ": B=" << p.B << " T=" << p.T << " H=" << p.H << " N=" << N);

  Stream stream;
  device.run(stream.get());
  Checked checked;
  checked.result = device.fetch();
  checked.launch = launch_report(device.plan.get());
  device.run(nullptr);
  CHECK(checked.result == device.fetch());  // bitwise, across streams

  // The forced tuning is what ran.
  CHECK(checked.launch.vsplit >= 1);
  CHECK(checked.launch.windows >= 1);
  if (c.vsplit > 0) CHECK(checked.launch.vsplit == c.vsplit);
  if (c.window_slots > 0) CHECK(checked.launch.slots_per_window <= c.window_slots);
  if (c.chunk_parallel == FKDA_CHUNK_PARALLEL_OFF) CHECK(checked.launch.chunk_parallel == 0);
  if (c.chunk_parallel == FKDA_CHUNK_PARALLEL_ON) {
    CHECK(checked.launch.chunk_parallel == 1);
    if (c.segment_chunks > 0) CHECK(checked.launch.segment_chunks == c.segment_chunks);
  }

  // Every output element written, nothing outside the views touched.
  const std::vector<float> out = arenas.act.gather(checked.result.out);
  CHECK(count_nan(out) == 0);
  CHECK(arenas.act.touched_gaps(checked.result.out) == 0);
  std::vector<float> state;
  if (c.with_final) {
    state = decode_state(checked.result.final, c.state_dtype, c.state_layout);
    CHECK(count_nan(state) == 0);
  }

  const fkda_ref::Reference ref = fkda_ref::reference_recurrence(p);
  const Result cpu = run_cpu(p, c, arenas);
  const std::vector<float> cpu_out = arenas.act.gather(cpu.out);

  Figures& f = checked.figures;
  f.out_vs_ref = fkda_ref::rel_l2(out, ref.out);
  f.out_vs_cpu = fkda_ref::rel_l2(out, widen(cpu_out));
  if (c.with_final) {
    f.state_vs_ref = fkda_ref::rel_l2(state, ref.final_state);
    f.state_vs_cpu = fkda_ref::rel_l2(state, widen(decode_state(cpu.final, c.state_dtype, c.state_layout)));
  }
  const fkda_ref::AccuracyTargets targets = targets_of(c);
  std::printf("%-44s N=%-3lld H=%-3lld vsplit=%lld windows=%-3lld segment=%-3lld vs fp64: out %.3e state %.3e | "
              "vs CPU: out %.3e state %.3e\n",
              c.name.c_str(), (long long)N, (long long)p.H, (long long)checked.launch.vsplit,
              (long long)checked.launch.windows, (long long)checked.launch.segment_chunks, f.out_vs_ref,
              f.state_vs_ref, f.out_vs_cpu, f.state_vs_cpu);
  std::fflush(stdout);
  CHECK(f.out_vs_ref <= targets.out);
  CHECK(f.state_vs_ref <= targets.state);
  // Segments reach their states by another order of operations than one
  // chain (docs/NUMERICS.md, "Chunk-parallel prefill"), so they agree with
  // the serial CPU backend only as far as both agree with fp64.
  const double agreement = checked.launch.chunk_parallel ? kCpuAgreementSegments
                           : c.slow                      ? kCpuAgreementSlowDecay
                                                         : kCpuAgreement;
  CHECK(f.out_vs_cpu <= agreement);
  CHECK(f.state_vs_cpu <= agreement);
  return checked;
}

}  // namespace fkda_test
