// SPDX-License-Identifier: MIT
// The GPU decode (fkda_decode) through the public API, on slow-decay inputs
// with states in a pool at scattered slots: against the fp64 recurrence,
// chained against the prefill, the speculative verify against single-token
// steps, padding under both null-slot rules, untrusted device values, graph
// capture. Every run poisons the output first; the expectation of each call
// (which rows are written or zero, which slots hold which state, which bytes
// stay as they were) comes from expected_outcome, a host model of the rules
// in include/flashkda.h, and every byte of the output and the pool is checked
// against it.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"
#include "serving_support.h"

namespace {

using namespace fkda_ref;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // a NaN
// Relative L2 error against the fp64 recurrence (the serving targets).
constexpr double kOutTolerance = 2.0e-3;
constexpr double kF32StateTolerance = 1.0e-6;  // after up to 5 tokens
constexpr double kF32StateToleranceLong = 4.0e-6;  // after up to 16 tokens in one call
constexpr double kBf16StateTolerance = 2.0e-3;
// Decode chained against the prefill: each is held to its own target
// against fp64 (the prefill's: out 3e-3, f32 state 1e-3), so the two may
// differ by the sum.
constexpr double kVsPrefillOut = kOutTolerance + 3.0e-3;
constexpr double kVsPrefillState = kF32StateToleranceLong + 1.0e-3;

struct DecodeCase {
  std::string name;
  int64_t N = 4, T = 1, H = 2;   // batched [N, T, H, *] unless lengths is set
  std::vector<int64_t> lengths;  // packed [1, sum, H, *] with cu_seqlens
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  fkda_state_layout layout = FKDA_STATE_LAYOUT_VK;
  fkda_null_slot_rule rule = FKDA_NULL_SLOT_NONPOSITIVE;
  int32_t gate_mode = FKDA_GATE_BOUNDED;  // fkda_gate_mode of the problem and the plans
  fkda_dtype index_dtype = FKDA_DTYPE_I32;
  fkda_dtype offsets_dtype = FKDA_DTYPE_I32;
  int64_t table_cols = 0;         // W > 0: an [N, W] table, else [N] indices
  bool with_accepted = true;      // with a table: num_accepted_tokens random in [1, W]
  std::vector<int64_t> padded;    // sequences whose starting index is null
  uint64_t seed = 1;
};

bool is_table(const DecodeCase& c) { return c.table_cols > 0; }

// A case's inputs on the host; the device values of indices, counts and
// offsets may be edited before the run (they are what the model reads).
struct Setup {
  DecodeCase c;
  Problem p;
  int64_t W = 1;
  HostPool pool;
  std::vector<int64_t> indices;   // [N, W], row-major
  std::vector<int64_t> accepted;  // [N], or empty
  std::vector<int64_t> offsets;   // [N + 1], or empty (batched)

  int64_t N() const { return p.num_seqs(); }
};

Setup make_setup(const DecodeCase& c) {
  Problem p = pool_problem(c.N, c.T, c.H, c.lengths, c.seed, c.gate_mode);
  const int64_t N = p.num_seqs();
  const int64_t W = is_table(c) ? c.table_cols : 1;
  const int64_t slots = 2 * N * W + 3;
  Setup s{c, p, W, HostPool(slots, p.H, c.state_dtype, c.layout, c.seed + 7), {}, {}, p.cu_seqlens};
  s.indices = scattered_slots(N * W, first_real_slot(c.rule), slots, c.seed + 11);
  std::mt19937_64 rng(c.seed + 13);
  if (is_table(c) && c.with_accepted) {
    for (int64_t n = 0; n < N; ++n) s.accepted.push_back(1 + int64_t(rng() % uint64_t(W)));
  }
  for (int64_t n = 0; n < N; ++n) {
    const int64_t start = s.accepted.empty() ? 0 : s.accepted[size_t(n)] - 1;
    const bool padded = std::find(c.padded.begin(), c.padded.end(), n) != c.padded.end();
    if (padded) s.indices[size_t(n * W + start)] = null_index(c.rule, n);
    // Some columns of a table that are not the start are null: their states are not written.
    for (int64_t t = 0; is_table(c) && t < W; ++t) {
      if (t != start && (n + t) % 3 == 1) s.indices[size_t(n * W + t)] = null_index(c.rule, n + t);
    }
  }
  return s;
}

// ------------------------------------------------------------ the model ---

// What a decode call must leave, from the rules of include/flashkda.h for
// GPU plans: untrusted offsets clamped into [0, T]; a sequence is padding when
// its start column's index is null or outside the pool, its count of accepted
// tokens lies outside [1, W], or it is longer than the kernel serves
// (16, the row's tokens, W).
struct Expected {
  std::vector<char> row_state;              // per (row, token, head): 0 untouched, 1 computed, 2 zero
  std::vector<double> out;                  // [B, T, H, V]: the fp64 output of computed rows
  std::vector<int64_t> written_slots;       // in the order of written_states
  std::vector<std::vector<double>> written_states;  // [H, V, K] each
};

SequenceTokens clamped_tokens(const Setup& s, int64_t n) {
  if (s.offsets.empty()) return {n, 0, s.p.T};
  auto clamp = [&](int64_t x, int64_t lo) { return std::min(std::max(x, lo), s.p.T); };
  const int64_t begin = clamp(s.offsets[size_t(n)], 0);
  return {0, begin, clamp(s.offsets[size_t(n) + 1], begin) - begin};
}

bool usable(const Setup& s, int64_t index) { return index >= first_real_slot(s.c.rule) && index < s.pool.slots; }

Expected expected_outcome(const Setup& s) {
  const Problem& p = s.p;
  Expected x;
  x.row_state.assign(size_t(p.B * p.T * p.H), 0);
  x.out.assign(p.v.size(), 0.0);
  const int64_t longest = std::min<int64_t>({16, p.T, is_table(s.c) ? s.W : 16});
  for (int64_t n = 0; n < s.N(); ++n) {
    const SequenceTokens tokens = clamped_tokens(s, n);
    if (tokens.length == 0) continue;
    int64_t start_column = s.accepted.empty() ? 0 : s.accepted[size_t(n)] - 1;
    bool padding = tokens.length > longest || start_column < 0 || start_column >= s.W;
    const int64_t start = padding ? -1 : s.indices[size_t(n * s.W + start_column)];
    padding = padding || !usable(s, start);
    for (int64_t t = 0; t < tokens.length; ++t)
      for (int64_t h = 0; h < p.H; ++h)
        x.row_state[size_t(((tokens.row * p.T) + tokens.begin + t) * p.H + h)] = padding ? 2 : 1;
    if (padding) continue;
    const std::vector<float> initial = s.pool.get(start);
    auto keep_state = [&](int64_t slot, const Reference& r) {
      x.written_slots.push_back(slot);
      x.written_states.push_back(r.final_state);
    };
    const Reference whole = sequence_reference(p, tokens, tokens.length, initial);
    for (int64_t t = 0; t < tokens.length; ++t) {
      const size_t from = size_t(t * p.H * 128), to = size_t(((tokens.row * p.T) + tokens.begin + t) * p.H * 128);
      std::copy_n(whole.out.begin() + std::ptrdiff_t(from), p.H * 128, x.out.begin() + std::ptrdiff_t(to));
    }
    if (!is_table(s.c)) {
      keep_state(start, whole);
      continue;
    }
    for (int64_t t = 0; t < tokens.length; ++t) {
      const int64_t slot = s.indices[size_t(n * s.W + t)];
      if (!usable(s, slot)) continue;
      keep_state(slot, t + 1 == tokens.length ? whole : sequence_reference(p, tokens, t + 1, initial));
    }
  }
  return x;
}

// ------------------------------------------------------------ the call ---

// Where a call's tensors are: device buffers, or host copies for the CPU backend.
struct DecodePointers {
  void *q, *k, *v, *g, *beta, *A_log, *dt_bias, *out, *pool, *indices, *accepted, *offsets;
};

// An activation over tokens [first, first + count) of every batch row.
fkda_tensor activation(const Problem& p, void* data, int64_t width, int64_t first, int64_t count) {
  const int64_t row = std::max<int64_t>(width, 1);
  std::vector<int64_t> shape = {p.B, count, p.H};
  if (width > 0) shape.push_back(width);
  fkda_tensor t = tensor(static_cast<uint16_t*>(data) + first * p.H * row, FKDA_DTYPE_BF16, shape);
  t.strides[0] = p.T * p.H * row;
  return t;
}

// The call over tokens [first, first + count) of a batched problem, or over
// everything (count < 0).
fkda_decode_args decode_args(const Setup& s, const DecodePointers& at, int64_t first = 0, int64_t count = -1) {
  const Problem& p = s.p;
  if (count < 0) count = p.T;
  fkda_decode_args a = FKDA_DECODE_ARGS_INIT;
  a.q = activation(p, at.q, 128, first, count);
  a.k = activation(p, at.k, 128, first, count);
  a.v = activation(p, at.v, 128, first, count);
  a.g = activation(p, at.g, 128, first, count);
  a.beta = activation(p, at.beta, 0, first, count);
  a.out = activation(p, at.out, 128, first, count);
  if (!p.A_log.empty()) a.A_log = tensor(at.A_log, FKDA_DTYPE_F32, {p.H});
  if (!p.dt_bias.empty()) a.dt_bias = tensor(at.dt_bias, FKDA_DTYPE_F32, {p.H, 128});
  a.state_pool = s.pool.view(at.pool);
  const int64_t N = s.N();
  a.state_indices = is_table(s.c) ? tensor(at.indices, s.c.index_dtype, {N, s.W})
                                  : tensor(at.indices, s.c.index_dtype, {N});
  if (!s.accepted.empty()) a.num_accepted_tokens = tensor(at.accepted, s.c.index_dtype, {N});
  if (!s.offsets.empty()) a.cu_seqlens = tensor(at.offsets, s.c.offsets_dtype, {N + 1});
  a.scale = p.scale;
  return a;
}

// The same call on the CPU backend, on host copies: its output and pool.
std::pair<std::vector<uint16_t>, HostPool> run_cpu(const Setup& s) {
  Problem p = s.p;
  std::vector<uint16_t> out(p.v.size(), kPoisonBf16);
  HostPool pool = s.pool;
  std::vector<unsigned char> indices = integer_bytes(s.indices, s.c.index_dtype),
                             accepted = integer_bytes(s.accepted, s.c.index_dtype),
                             offsets = integer_bytes(s.offsets, s.c.offsets_dtype);
  const DecodePointers at{p.q.data(),   p.k.data(),         p.v.data(),     p.g.data(),
                          p.beta.data(), p.A_log.data(),    p.dt_bias.data(), out.data(),
                          pool.bytes.data(), indices.data(), accepted.data(), offsets.data()};
  const fkda_decode_args a = decode_args(s, at);
  Plan plan(serving_desc(p, s.c.state_dtype, s.c.layout, FKDA_BACKEND_CPU, s.c.rule));
  FKDA_REQUIRE(fkda_decode(plan.get(), &a, nullptr, 0, nullptr));
  return {out, pool};
}

// ---------------------------------------------------------- the device ---

struct DeviceDecode {
  const Setup& s;
  DeviceBuffer q, k, v, g, beta, A_log, dt_bias, out, pool, indices, accepted, offsets;
  Plan plan;

  explicit DeviceDecode(const Setup& setup)
      : s(setup), q(setup.p.q), k(setup.p.k), v(setup.p.v), g(setup.p.g), beta(setup.p.beta),
        A_log(setup.p.A_log), dt_bias(setup.p.dt_bias), out(std::vector<uint16_t>(setup.p.v.size(), kPoisonBf16)),
        pool(setup.pool.bytes), indices(integer_bytes(setup.indices, setup.c.index_dtype)),
        accepted(integer_bytes(setup.accepted, setup.c.index_dtype)),
        offsets(integer_bytes(setup.offsets, setup.c.offsets_dtype)),
        plan(serving_desc(setup.p, setup.c.state_dtype, setup.c.layout, FKDA_BACKEND_GPU,
                       setup.c.rule)) {}

  fkda_decode_args args(int64_t first = 0, int64_t count = -1) const {
    const DecodePointers at{q.get(),    k.get(),    v.get(),    g.get(),     beta.get(),     A_log.get(),
                            dt_bias.get(), out.get(), pool.get(), indices.get(), accepted.get(), offsets.get()};
    return decode_args(s, at, first, count);
  }

  // Output poisoned, pool back to the setup's bytes.
  void reset() {
    out.upload(std::vector<uint16_t>(s.p.v.size(), kPoisonBf16).data());
    pool.upload(s.pool.bytes.data());
    CUDA_REQUIRE(cudaDeviceSynchronize());
  }

  void run(cudaStream_t stream = nullptr, int64_t first = 0, int64_t count = -1) {
    const fkda_decode_args a = args(first, count);
    size_t bytes = 0;
    FKDA_REQUIRE(fkda_plan_decode_workspace_size(plan.get(), s.p.B * (count < 0 ? s.p.T : count), s.N(), &bytes));
    DeviceBuffer workspace(bytes);
    FKDA_REQUIRE(fkda_decode(plan.get(), &a, bytes > 0 ? workspace.get() : nullptr, bytes, stream));
    CUDA_REQUIRE(cudaGetLastError());
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
  }

  std::vector<uint16_t> out_bits() const { return out.read<uint16_t>(); }
  HostPool pool_now() const {
    HostPool now = s.pool;
    pool.download(now.bytes.data());
    return now;
  }
};

// ------------------------------------------------------------ checking ---

struct Outcome {
  double out_error = 0, state_error = 0;
  size_t unwritten = 0, nonzero_padding = 0, touched_rows = 0, touched_pool = 0;
};

// Everything the call left, against the model: computed rows finite and
// close to fp64, padded rows exactly zero, other rows still poison, written
// slots close to fp64, every other pool byte unchanged.
Outcome compare(const Setup& s, const Expected& x, const std::vector<uint16_t>& out, const HostPool& pool) {
  Outcome o;
  std::vector<float> got;
  std::vector<double> want;
  for (size_t row = 0; row < x.row_state.size(); ++row) {
    for (size_t e = 0; e < 128; ++e) {
      const uint16_t bits = out[row * 128 + e];
      switch (x.row_state[row]) {
        case 0: o.touched_rows += bits != kPoisonBf16; break;
        case 2: o.nonzero_padding += bits != 0; break;
        default:
          o.unwritten += bits == kPoisonBf16;
          got.push_back(from_bf16(bits));
          want.push_back(x.out[row * 128 + e]);
      }
    }
  }
  o.out_error = got.empty() ? 0.0 : rel_l2(got, want);
  std::vector<float> states;
  std::vector<double> wanted_states;
  for (size_t i = 0; i < x.written_slots.size(); ++i) {
    const std::vector<float> slot = pool.get(x.written_slots[i]);
    states.insert(states.end(), slot.begin(), slot.end());
    wanted_states.insert(wanted_states.end(), x.written_states[i].begin(), x.written_states[i].end());
  }
  o.state_error = states.empty() ? 0.0 : rel_l2(states, wanted_states);
  o.touched_pool = touched_outside(s.pool, s.pool.bytes, pool.bytes, x.written_slots);
  return o;
}

double state_tolerance(const Setup& s) {
  if (s.c.state_dtype == FKDA_DTYPE_BF16) return kBf16StateTolerance;
  return std::min<int64_t>(s.p.T, 16) <= 5 ? kF32StateTolerance : kF32StateToleranceLong;
}

void check_outcome(const Setup& s, const Outcome& o) {
  report(s.c.name, {{"out", o.out_error, kOutTolerance}, {"state", o.state_error, state_tolerance(s)}});
  if (o.unwritten || o.nonzero_padding || o.touched_rows || o.touched_pool) {
    std::printf("%-44s  unwritten %zu, nonzero padding %zu, touched rows %zu, touched pool bytes %zu\n",
                s.c.name.c_str(), o.unwritten, o.nonzero_padding, o.touched_rows, o.touched_pool);
  }
  CHECK(o.out_error <= kOutTolerance);
  CHECK(o.state_error <= state_tolerance(s));
  CHECK(o.unwritten == 0);
  CHECK(o.nonzero_padding == 0);
  CHECK(o.touched_rows == 0);
  CHECK(o.touched_pool == 0);
}

// The GPU and the CPU backend compute the same f32 recurrence
// (docs/NUMERICS.md, decode) with sums in other orders, so only a few bf16
// outputs may round the other way and the f32 states differ by a few ulps.
constexpr double kCpuOutAgreement = 1.0e-3;
constexpr double kCpuF32StateAgreement = 1.0e-6;

// Runs a setup once on the GPU and checks everything; with valid device
// values (the CPU backend rejects bad ones) also against the CPU backend.
void run_and_check(const Setup& s, bool against_cpu = true) {
  INFO(s.c.name);
  DeviceDecode device(s);
  device.run();
  const std::vector<uint16_t> out = device.out_bits();
  const HostPool pool = device.pool_now();
  const Expected x = expected_outcome(s);
  check_outcome(s, compare(s, x, out, pool));
  if (!against_cpu) return;
  const auto [cpu_out, cpu_pool] = run_cpu(s);
  const double out_gap = rel_l2(bf16_to_float(out), widen(bf16_to_float(cpu_out)));
  std::vector<float> gpu_states, cpu_states;
  for (int64_t slot : x.written_slots) {
    const std::vector<float> a = pool.get(slot), b = cpu_pool.get(slot);
    gpu_states.insert(gpu_states.end(), a.begin(), a.end());
    cpu_states.insert(cpu_states.end(), b.begin(), b.end());
  }
  const double state_gap = gpu_states.empty() ? 0.0 : rel_l2(gpu_states, widen(cpu_states));
  const double state_agreement =
      s.c.state_dtype == FKDA_DTYPE_BF16 ? kBf16StateTolerance : kCpuF32StateAgreement;
  report(s.c.name + " vs CPU", {{"out", out_gap, kCpuOutAgreement}, {"state", state_gap, state_agreement}});
  CHECK(out_gap <= kCpuOutAgreement);
  CHECK(state_gap <= state_agreement);
}

DecodeCase batched(std::string name, int64_t N, int64_t T, int64_t H, uint64_t seed) {
  DecodeCase c;
  c.name = std::move(name);
  c.N = N;
  c.T = T;
  c.H = H;
  c.seed = seed;
  return c;
}

DecodeCase packed(std::string name, std::vector<int64_t> lengths, int64_t H, uint64_t seed) {
  return packed_case<DecodeCase>(std::move(name), std::move(lengths), H, seed);
}

// The warps per block the library picks (src/gpu/gpu_decode.cpp), for the report.
int expected_warps(int64_t seqs_times_heads) {
  int warps = 4;
  while (warps > 1 && seqs_times_heads * (16 / warps) < 2 * multiprocessors()) warps /= 2;
  return warps;
}

}  // namespace

TEST_CASE("decode: against the fp64 recurrence", "[gpu][decode]") {
  std::vector<DecodeCase> cases = {
      batched("N=1 H=4 T=1", 1, 1, 4, 1),
      batched("N=5 H=8 T=1", 5, 1, 8, 2),
      batched("N=40 H=4 T=1", 40, 1, 4, 3),
      batched("N=6 H=3 T=3", 6, 3, 3, 4),
      batched("N=3 H=2 T=16", 3, 16, 2, 5),
      packed("packed 1,0,5,16,2,0", {1, 0, 5, 16, 2, 0}, 3, 6),
  };
  DecodeCase c = batched("bf16 pool N=6 H=3 T=2", 6, 2, 3, 7);
  c.state_dtype = FKDA_DTYPE_BF16;
  cases.push_back(c);
  c = batched("f32 KV pool N=6 H=3 T=2", 6, 2, 3, 8);
  c.layout = FKDA_STATE_LAYOUT_KV;
  cases.push_back(c);
  c = packed("bf16 KV pool packed 2,1,3", {2, 1, 3}, 2, 9);
  c.state_dtype = FKDA_DTYPE_BF16;
  c.layout = FKDA_STATE_LAYOUT_KV;
  cases.push_back(c);
  c = packed("i64 indices and offsets, slot 0 real", {1, 2, 1, 1}, 2, 10);
  c.index_dtype = FKDA_DTYPE_I64;
  c.offsets_dtype = FKDA_DTYPE_I64;
  c.rule = FKDA_NULL_SLOT_NEGATIVE;
  cases.push_back(c);
  for (const DecodeCase& one : cases) {
    const Setup s = make_setup(one);
    std::printf("%-44s  %d warps a block\n", one.name.c_str(), expected_warps(s.N() * s.p.H));
    run_and_check(s);
  }

  SECTION("mutation: a kernel that ignored the pool's state would fail the check") {
    const Setup s = make_setup(batched("mutation: zero initial state", 5, 2, 3, 11));
    DeviceDecode device(s);
    device.run();
    Setup zeroed = s;
    std::vector<float> zeros(size_t(s.p.H * kMatrixElements), 0.f);
    for (int64_t n = 0; n < s.N(); ++n) zeroed.pool.put(s.indices[size_t(n)], zeros.data());
    const Outcome o = compare(s, expected_outcome(zeroed), device.out_bits(), device.pool_now());
    require_detected(s.c.name, "out", o.out_error, kOutTolerance);
    require_detected(s.c.name, "state", o.state_error, kF32StateTolerance);
    // The CPU agreement check against a CPU run from other starting states.
    const auto [cpu_out, cpu_pool] = run_cpu(zeroed);
    require_detected(s.c.name, "CPU agreement", rel_l2(bf16_to_float(device.out_bits()), widen(bf16_to_float(cpu_out))),
                     kCpuOutAgreement);
  }
}

TEST_CASE("decode: against the fp64 recurrence under the softplus and log-decay gates", "[gpu][decode]") {
  // make_setup's expected results follow the case's gate (serving_support.h).
  for (int32_t gate : {FKDA_GATE_SOFTPLUS, FKDA_GATE_LOG_DECAY}) {
    const std::string name = gate == FKDA_GATE_SOFTPLUS ? "softplus: " : "log-decay: ";
    std::vector<DecodeCase> cases = {batched(name + "N=5 H=8 T=1", 5, 1, 8, 31),
                                     batched(name + "N=3 H=2 T=16", 3, 16, 2, 32),
                                     packed(name + "packed 1,0,5,16,2,0", {1, 0, 5, 16, 2, 0}, 3, 33)};
    DecodeCase c = batched(name + "bf16 KV pool N=6 H=3 T=2", 6, 2, 3, 34);
    c.state_dtype = FKDA_DTYPE_BF16;
    c.layout = FKDA_STATE_LAYOUT_KV;
    cases.push_back(c);
    for (DecodeCase& one : cases) {
      one.gate_mode = gate;
      run_and_check(make_setup(one));
    }
  }
}

TEST_CASE("decode: five chained steps keep an f32 pool within 1e-6 and equal one prefill", "[gpu][decode]") {
  for (int64_t steps : {5, 16}) {
    DecodeCase c = batched("chained " + std::to_string(steps) + " steps N=3 H=4", 3, steps, 4, 20 + uint64_t(steps));
    const Setup s = make_setup(c);
    DeviceDecode device(s);
    for (int64_t t = 0; t < steps; ++t) device.run(nullptr, t, 1);
    const HostPool after = device.pool_now();
    const std::vector<uint16_t> out = device.out_bits();

    // Against the fp64 recurrence over all the steps: the model of one call
    // of `steps` tokens is the state after the last, and every row's output.
    const Expected x = expected_outcome(s);
    const Outcome o = compare(s, x, out, after);
    const double state_target = steps <= 5 ? kF32StateTolerance : kF32StateToleranceLong;
    report(c.name + " vs fp64", {{"out", o.out_error, kOutTolerance}, {"state", o.state_error, state_target}});
    CHECK(o.out_error <= kOutTolerance);
    CHECK(o.state_error <= state_target);
    CHECK(o.unwritten == 0);
    CHECK(o.touched_pool == 0);

    // One prefill of the same tokens from the same states, contiguous.
    const int64_t N = s.N();
    std::vector<float> initial, decoded;
    for (int64_t n = 0; n < N; ++n) {
      const std::vector<float> from = s.pool.get(s.indices[size_t(n)]);
      const std::vector<float> to = after.get(s.indices[size_t(n)]);
      initial.insert(initial.end(), from.begin(), from.end());
      decoded.insert(decoded.end(), to.begin(), to.end());
    }
    DeviceProblem prefill(s.p);
    DeviceBuffer initial_device(initial), final_device(initial.size() * 4);
    Buffers buffers = prefill.buffers();
    buffers.initial_state = initial_device.get();
    buffers.final_state = final_device.get();
    const fkda_fwd_args args = make_args(s.p, buffers, FKDA_DTYPE_F32);
    const Plan plan(serving_desc(s.p, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, FKDA_BACKEND_GPU, c.rule));
    size_t bytes = 0;
    FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), s.p.B * s.p.T, N, &bytes));
    DeviceBuffer workspace(bytes);
    FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), bytes, nullptr));
    CUDA_REQUIRE(cudaDeviceSynchronize());
    const std::vector<float> prefill_state = final_device.read<float>();
    const std::vector<float> prefill_out = bf16_to_float(prefill.out.read<uint16_t>());
    const std::vector<float> decode_out = bf16_to_float(out);
    const double out_gap = rel_l2(decode_out, widen(prefill_out));
    const double state_gap = rel_l2(decoded, widen(prefill_state));
    report(c.name + " vs prefill",
           {{"out", out_gap, kVsPrefillOut}, {"state", state_gap, kVsPrefillState}});
    CHECK(out_gap <= kVsPrefillOut);
    CHECK(state_gap <= kVsPrefillState);

    if (steps == 5) {
      // Mutation: a chain that lost its last step is far outside both checks.
      DeviceDecode short_chain(s);
      for (int64_t t = 0; t + 1 < steps; ++t) short_chain.run(nullptr, t, 1);
      const HostPool short_pool = short_chain.pool_now();
      const Outcome lost = compare(s, x, short_chain.out_bits(), short_pool);
      require_detected(c.name, "state, last step lost", lost.state_error, kF32StateTolerance);
      std::vector<float> short_state;
      for (int64_t n = 0; n < N; ++n) {
        const std::vector<float> one = short_pool.get(s.indices[size_t(n)]);
        short_state.insert(short_state.end(), one.begin(), one.end());
      }
      require_detected(c.name, "state vs prefill, last step lost",
                       rel_l2(short_state, widen(prefill_state)),
                       kVsPrefillState);
    }
  }
}

TEST_CASE("decode: a speculative verify equals single-token steps, column by column", "[gpu][decode]") {
  DecodeCase c = batched("verify N=6 H=3 T=4 W=4", 6, 4, 3, 30);
  c.table_cols = 4;
  Setup s = make_setup(c);
  // Every column real here, so that each token's state can be compared.
  s.indices = scattered_slots(s.N() * s.W, first_real_slot(c.rule), s.pool.slots, c.seed + 99);
  DeviceDecode verify(s);
  verify.run();
  const HostPool verified = verify.pool_now();
  const std::vector<uint16_t> verify_out = verify.out_bits();
  run_and_check(s);

  // The same tokens as single-token steps with [N] indices, from each
  // sequence's start column: the f32 state after step t must be the bits of
  // column t, and the outputs the same bits.
  Setup single = s;
  single.c.table_cols = 0;
  single.c.name = "single steps";
  single.W = 1;
  single.accepted.clear();
  single.indices.clear();
  for (int64_t n = 0; n < s.N(); ++n) {
    single.indices.push_back(s.indices[size_t(n * s.W + s.accepted[size_t(n)] - 1)]);
  }
  DeviceDecode steps(single);
  size_t differing_states = 0, differing_outputs = 0;
  double off_by_one = 0;
  for (int64_t t = 0; t < s.p.T; ++t) {
    steps.run(nullptr, t, 1);
    const HostPool now = steps.pool_now();
    std::vector<float> stepped, column_before;
    for (int64_t n = 0; n < s.N(); ++n) {
      const std::vector<float> a = now.get(single.indices[size_t(n)]);
      const std::vector<float> b = verified.get(s.indices[size_t(n * s.W + t)]);
      differing_states += std::memcmp(a.data(), b.data(), a.size() * 4) != 0;
      stepped.insert(stepped.end(), a.begin(), a.end());
      if (t > 0) {
        const std::vector<float> before = verified.get(s.indices[size_t(n * s.W + t - 1)]);
        column_before.insert(column_before.end(), before.begin(), before.end());
      }
    }
    // Mutation: column t - 1 in place of column t.
    if (t > 0) {
      off_by_one = std::max(off_by_one, rel_l2(column_before, widen(stepped)));
    }
  }
  const std::vector<uint16_t> step_out = steps.out_bits();
  for (size_t i = 0; i < step_out.size(); ++i) differing_outputs += step_out[i] != verify_out[i];
  std::printf("%-44s  columns differing from single steps %zu, output values differing %zu\n", c.name.c_str(),
              differing_states, differing_outputs);
  CHECK(differing_states == 0);
  CHECK(differing_outputs == 0);
  // Mutation: the comparison can tell neighbouring columns apart by far.
  require_detected(c.name, "column t vs step t - 1", off_by_one, kF32StateTolerance, 1000.0);

  DecodeCase bf16 = c;
  bf16.name = "verify bf16 pool, accepted random, null columns";
  bf16.state_dtype = FKDA_DTYPE_BF16;
  bf16.seed = 31;
  run_and_check(make_setup(bf16));
  DecodeCase no_counts = c;
  no_counts.name = "verify without num_accepted_tokens (column 0)";
  no_counts.with_accepted = false;
  no_counts.seed = 32;
  run_and_check(make_setup(no_counts));
  DecodeCase packed_table = packed("verify packed 3,0,1,4 W=5", {3, 0, 1, 4}, 2, 33);
  packed_table.table_cols = 5;
  run_and_check(make_setup(packed_table));
}

TEST_CASE("decode: padding under both null-slot rules and zero-length sequences", "[gpu][decode]") {
  for (fkda_null_slot_rule rule : {FKDA_NULL_SLOT_NEGATIVE, FKDA_NULL_SLOT_NONPOSITIVE}) {
    const std::string rule_name = rule == FKDA_NULL_SLOT_NEGATIVE ? "negative" : "nonpositive";
    DecodeCase c = packed("padding " + rule_name + ", packed with empties", {2, 0, 1, 0, 0, 3, 1}, 3, 40);
    c.rule = rule;
    c.padded = {0, 4, 6};  // 4 is also empty: nothing at all
    run_and_check(make_setup(c));
    DecodeCase b = batched("padding " + rule_name + ", batched", 5, 2, 2, 41);
    b.rule = rule;
    b.padded = {1, 2};
    run_and_check(make_setup(b));
    DecodeCase t = batched("padding " + rule_name + ", table", 4, 3, 2, 42);
    t.rule = rule;
    t.table_cols = 3;
    t.padded = {3};
    run_and_check(make_setup(t));
  }
  SECTION("mutation: the padding checks see computed rows and slots where padding belongs") {
    DecodeCase c = batched("mutation: padding expected, computed", 3, 1, 2, 43);
    const Setup s = make_setup(c);
    DeviceDecode device(s);
    device.run();
    Setup padded = s;
    padded.indices[1] = null_index(c.rule, 1);  // the model now expects zeros and an untouched slot
    const Outcome o = compare(s, expected_outcome(padded), device.out_bits(), device.pool_now());
    std::printf("%-44s  mutation: %zu nonzero padded values, %zu pool bytes touched\n", c.name.c_str(),
                o.nonzero_padding, o.touched_pool);
    CHECK(o.nonzero_padding > 0);
    CHECK(o.touched_pool > 0);
  }
}

TEST_CASE("decode: out-of-range device values behave as padding", "[gpu][decode][sanitize]") {
  DecodeCase c = packed("bad device values", {1, 2, 17, 1, 3, 2, 1}, 2, 50);
  Setup s = make_setup(c);
  s.indices[0] = s.pool.slots;                   // one past the pool
  s.indices[1] = int64_t(1) << 30;               // far outside
  // sequence 2 is longer than 16 tokens
  s.indices[4] = std::numeric_limits<int32_t>::min();
  run_and_check(s, false);

  DecodeCase t = batched("bad device values, table", 5, 2, 2, 51);
  t.table_cols = 3;
  t.index_dtype = FKDA_DTYPE_I64;
  Setup st = make_setup(t);
  st.accepted[0] = 0;             // below [1, W]
  st.accepted[1] = 4;             // above
  st.accepted[2] = -7;
  st.indices[size_t(3 * 3 + 1)] = int64_t(1) << 40;  // a write column outside the pool: skipped
  run_and_check(st, false);

  DecodeCase o = packed("offsets past the end are clamped", {2, 1, 2}, 2, 52);
  Setup so = make_setup(o);
  so.offsets[2] = 1000;  // sequence 1 runs to the end (3 tokens), sequence 2 is empty
  so.offsets[3] = -5;
  run_and_check(so, false);
}

TEST_CASE("decode: a captured CUDA graph replays the eager run", "[gpu][decode]") {
  DecodeCase c = packed("graph packed table", {3, 1, 0, 4}, 3, 60);
  c.table_cols = 4;
  const Setup s = make_setup(c);
  DeviceDecode device(s);
  device.run();
  const std::vector<uint16_t> eager_out = device.out_bits();
  const std::vector<unsigned char> eager_pool = device.pool_now().bytes;

  device.reset();
  const Stream stream;
  const fkda_decode_args args = device.args();
  const CapturedCall graph(stream.get(), cudaStreamCaptureModeGlobal,
                           [&] { return fkda_decode(device.plan.get(), &args, nullptr, 0, stream.get()); });
  for (int replay = 0; replay < 2; ++replay) {
    device.reset();
    graph.replay(stream.get());
    CHECK(device.out_bits() == eager_out);
    CHECK(device.pool_now().bytes == eager_pool);
  }
}

TEST_CASE("decode: small cases for compute-sanitizer", "[gpu][decode][sanitize]") {
  DecodeCase a = packed("sanitize f32 VK table", {2, 0, 3, 1}, 2, 70);
  a.table_cols = 3;
  a.padded = {3};
  run_and_check(make_setup(a));
  DecodeCase b = batched("sanitize bf16 KV", 3, 2, 2, 71);
  b.state_dtype = FKDA_DTYPE_BF16;
  b.layout = FKDA_STATE_LAYOUT_KV;
  b.rule = FKDA_NULL_SLOT_NEGATIVE;
  b.padded = {0};
  run_and_check(make_setup(b));
  run_and_check(make_setup(batched("sanitize 4 warps a block", 70, 1, 2, 72)));
}

namespace {

// The batches the streamed kernel takes (src/gpu/gpu_decode.cpp: [N]
// indices, V x K pools, at least two 64-row items for each of the two
// blocks a multiprocessor): the fewest sequences of H heads that make it.
int64_t streamed_sequences(int64_t H) {
  const int64_t items = 4 * multiprocessors();
  return (items + 2 * H - 1) / (2 * H);
}

// Sequences of 0 to 16 tokens: one and two tokens come whole with their
// stage, longer ones read the rest from global memory.
std::vector<int64_t> streamed_lengths(int64_t N) {
  const int64_t pattern[] = {1, 3, 0, 1, 16, 2, 1, 4, 5, 1, 2, 1};
  std::vector<int64_t> lengths;
  for (int64_t n = 0; n < N; ++n) lengths.push_back(pattern[n % 12]);
  return lengths;
}

}  // namespace

TEST_CASE("decode: large batches (the streamed kernel) against the fp64 recurrence", "[gpu][decode][streamed]") {
  const int64_t H = 12, N = streamed_sequences(H) + 5;
  DecodeCase c = packed("streamed f32 packed 0-16 tokens", streamed_lengths(N), H, 80);
  c.padded = {4, 9, 30};
  std::vector<DecodeCase> cases = {c};
  c = batched("streamed bf16 pool batched T=1", N, 1, H, 81);
  c.state_dtype = FKDA_DTYPE_BF16;
  c.rule = FKDA_NULL_SLOT_NEGATIVE;
  c.index_dtype = FKDA_DTYPE_I64;
  c.padded = {0, 7};
  cases.push_back(c);
  c = packed("streamed bf16 pool packed 0-16 tokens", streamed_lengths(N), H, 82);
  c.state_dtype = FKDA_DTYPE_BF16;
  cases.push_back(c);
  c = batched("streamed log-decay gate T=2", N, 2, H, 83);
  c.gate_mode = FKDA_GATE_LOG_DECAY;
  cases.push_back(c);
  c = packed("streamed softplus gate packed", streamed_lengths(N), H, 84);
  c.gate_mode = FKDA_GATE_SOFTPLUS;
  cases.push_back(c);
  for (const DecodeCase& one : cases) {
    std::printf("%-44s  %lld sequences x %lld heads, streamed\n", one.name.c_str(), (long long)(N), (long long)(H));
    run_and_check(make_setup(one));
  }
}

TEST_CASE("decode: the streamed kernel under bad device values, for compute-sanitizer",
          "[gpu][decode][sanitize][streamed]") {
  const int64_t H = 12, N = streamed_sequences(H) + 1;
  std::vector<int64_t> lengths = streamed_lengths(N);
  lengths[7] = 17;  // longer than a decode call serves: padding
  Setup s = make_setup(packed("streamed bad device values", lengths, H, 90));
  s.indices[0] = s.pool.slots;      // one past the pool
  s.indices[5] = int64_t(1) << 30;  // far outside
  s.indices[6] = std::numeric_limits<int32_t>::min();
  run_and_check(s, false);
  DecodeCase b = batched("streamed bf16 pool with padding", N, 1, H, 91);
  b.state_dtype = FKDA_DTYPE_BF16;
  b.padded = {1, 2, 3};
  run_and_check(make_setup(b));
}
