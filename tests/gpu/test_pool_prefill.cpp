// SPDX-License-Identifier: MIT
// The GPU prefill with states in a pool (state_pool, state_indices,
// has_initial_state) and checkpoints, through fkda_fwd, on slow-decay inputs
// with slots scattered over the pool:
//  - bit for bit the prefill with the same states passed contiguously;
//  - each checkpoint bit for bit the final state of a prefill of the
//    sequences cut at its offset (rounded to the checkpoint's dtype);
//  - close to the fp64 recurrence;
//  - padding (null slots under both rules, zero-length sequences) and
//    untrusted device values (indices outside the pool, bad checkpoint
//    offsets and slots) touch nothing: every output row and every pool and
//    checkpoint byte is checked.
// Tagged [window] so that gpu_check.sh also runs them with small forced
// windows, where sequences and their checkpoints cross window boundaries.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"
#include "prefill_harness.h"
#include "serving_support.h"

namespace {

using namespace fkda_ref;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // a NaN
constexpr unsigned char kPoisonByte = 0xFF;
// Relative L2 error against the fp64 recurrence (the serving targets of the prefill paths).
constexpr double kOutTolerance = 3.0e-3;
constexpr double kF32StateTolerance = 1.0e-3;
constexpr double kBf16StateTolerance = 2.0e-3;

double state_tolerance(fkda_dtype dtype) { return dtype == FKDA_DTYPE_BF16 ? kBf16StateTolerance : kF32StateTolerance; }

enum class CheckpointsTo { kNone, kTensor, kSlots };

struct PoolCase {
  std::string name;
  int64_t B = 1, T = 0, H = 2;   // batched unless lengths is set
  std::vector<int64_t> lengths;  // varlen
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  fkda_state_layout layout = FKDA_STATE_LAYOUT_VK;
  fkda_null_slot_rule rule = FKDA_NULL_SLOT_NONPOSITIVE;
  int32_t gate_mode = FKDA_GATE_BOUNDED;  // fkda_gate_mode of the problem and the plans
  fkda_dtype index_dtype = FKDA_DTYPE_I32;
  std::vector<int64_t> padded;   // sequences with a null index
  bool with_flags = false;       // has_initial_state present
  fkda_dtype flag_dtype = FKDA_DTYPE_BOOL;
  std::vector<int64_t> fresh;    // has_initial_state 0
  std::vector<std::vector<int64_t>> checkpoint_offsets;  // [N][C], negative: none
  CheckpointsTo checkpoints_to = CheckpointsTo::kNone;
  fkda_dtype checkpoint_dtype = FKDA_DTYPE_F32;
  uint64_t seed = 1;
};

// Checkpoints [N, C, H, V, K] (or KV) with free N and C strides (gaps that
// must stay untouched), poisoned.
struct CheckpointTensor {
  int64_t N = 0, C = 0, H = 0;
  fkda_dtype dtype = FKDA_DTYPE_F32;
  fkda_state_layout layout = FKDA_STATE_LAYOUT_VK;
  std::vector<unsigned char> bytes;

  CheckpointTensor(int64_t n, int64_t c, int64_t h, fkda_dtype d, fkda_state_layout l)
      : N(n), C(c), H(h), dtype(d), layout(l), bytes(size_t(n * stride_n()) * dtype_bytes(d), kPoisonByte) {}
  int64_t stride_c() const { return H * kMatrixElements + 8; }
  int64_t stride_n() const { return C * stride_c() + 16; }
  size_t first_element(int64_t n, int64_t c) const { return size_t(n * stride_n() + c * stride_c()); }
  std::vector<float> get(int64_t n, int64_t c) const {
    std::vector<float> vk(size_t(H * kMatrixElements));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < 128; ++e)
        for (int64_t k = 0; k < 128; ++k) {
          const int64_t inner = layout == FKDA_STATE_LAYOUT_VK ? e * 128 + k : k * 128 + e;
          vk[size_t((h * 128 + e) * 128 + k)] =
              load_state_element(bytes, dtype, first_element(n, c) + size_t(h * kMatrixElements + inner));
        }
    return vk;
  }
  // Bytes outside the blocks of the listed (n, c) pairs that are not poison.
  size_t touched_outside(const std::vector<std::pair<int64_t, int64_t>>& written) const {
    std::vector<char> allowed(bytes.size(), 0);
    const size_t width = dtype_bytes(dtype);
    for (const auto& [n, c] : written) {
      std::fill_n(allowed.begin() + std::ptrdiff_t(first_element(n, c) * width), size_t(H * kMatrixElements) * width, 1);
    }
    size_t touched = 0;
    for (size_t i = 0; i < bytes.size(); ++i) touched += !allowed[i] && bytes[i] != kPoisonByte;
    return touched;
  }
  fkda_tensor view(void* data) const {
    fkda_tensor t = tensor(data, dtype, {N, C, H, 128, 128});
    t.strides[0] = stride_n();
    t.strides[1] = stride_c();
    return t;
  }
};

struct PoolSetup {
  PoolCase c;
  Problem p;
  int64_t C = 0;
  HostPool pool;
  std::vector<int64_t> indices;           // [N]
  std::vector<int64_t> flags;             // [N], or empty
  std::vector<int64_t> offsets;           // [N, C] row-major, or empty
  std::vector<int64_t> checkpoint_slots;  // [N, C], with CheckpointsTo::kSlots

  int64_t N() const { return p.num_seqs(); }
  int64_t length(int64_t n) const { return tokens_of(p, n).length; }
  bool padded(int64_t n) const {
    return indices[size_t(n)] < first_real_slot(c.rule) || indices[size_t(n)] >= pool.slots;
  }
  bool fresh(int64_t n) const { return !flags.empty() && flags[size_t(n)] == 0; }
  // The state sequence n starts from: its slot's, or zeros.
  std::vector<float> initial(int64_t n) const {
    if (fresh(n) || padded(n)) return std::vector<float>(size_t(p.H * kMatrixElements), 0.f);
    return pool.get(indices[size_t(n)]);
  }
};

PoolSetup make_setup(const PoolCase& c) {
  Problem p = pool_problem(c.B, c.T, c.H, c.lengths, c.seed, c.gate_mode);
  const int64_t N = p.num_seqs();
  const int64_t C = c.checkpoint_offsets.empty() ? 0 : int64_t(c.checkpoint_offsets[0].size());
  const int64_t slots = 2 * (N + N * C) + 3;
  PoolSetup s{c, p, C, HostPool(slots, p.H, c.state_dtype, c.layout, c.seed + 7), {}, {}, {}, {}};
  const std::vector<int64_t> chosen = scattered_slots(N + N * C, first_real_slot(c.rule), slots, c.seed + 11);
  s.indices.assign(chosen.begin(), chosen.begin() + N);
  for (int64_t n : c.padded) s.indices[size_t(n)] = null_index(c.rule, n);
  if (c.with_flags) {
    s.flags.assign(size_t(N), 1);
    for (int64_t n : c.fresh) s.flags[size_t(n)] = 0;
  }
  for (const std::vector<int64_t>& row : c.checkpoint_offsets) s.offsets.insert(s.offsets.end(), row.begin(), row.end());
  if (c.checkpoints_to == CheckpointsTo::kSlots) s.checkpoint_slots.assign(chosen.begin() + N, chosen.end());
  return s;
}

// The checkpoints a sequence takes, as the rules of include/flashkda.h and
// the kernel's cursor have it: in column order, each offset a multiple of 16
// in [16, length] beyond the last one taken; the others are skipped.
std::vector<std::pair<int64_t, int64_t>> taken_checkpoints(const PoolSetup& s, int64_t n) {  // (column, offset)
  std::vector<std::pair<int64_t, int64_t>> taken;
  if (s.padded(n)) return taken;
  int64_t last = 0;
  for (int64_t c = 0; c < s.C; ++c) {
    const int64_t offset = s.offsets[size_t(n * s.C + c)];
    if (offset > last && offset <= s.length(n) && offset % 16 == 0) {
      taken.emplace_back(c, offset);
      last = offset;
    }
  }
  return taken;
}

// ------------------------------------------------------------- the runs ---

struct PoolRun {
  std::vector<uint16_t> out;
  HostPool pool;
  CheckpointTensor checkpoints;
};

// The call with states in the pool.
PoolRun run_pool(const PoolSetup& s, cudaStream_t stream = nullptr) {
  const Problem& p = s.p;
  const int64_t N = s.N();
  DeviceProblem device(p);
  DeviceBuffer pool(s.pool.bytes), indices(integer_bytes(s.indices, s.c.index_dtype)),
      flags(integer_bytes(s.flags, s.c.flag_dtype)), offsets(integer_bytes(s.offsets, s.c.index_dtype)),
      slots(integer_bytes(s.checkpoint_slots, s.c.index_dtype));
  PoolRun run{{}, s.pool, CheckpointTensor(N, std::max<int64_t>(s.C, 1), p.H, s.c.checkpoint_dtype, s.c.layout)};
  DeviceBuffer checkpoints(run.checkpoints.bytes);
  fkda_fwd_args args = make_args(p, device.buffers(), s.c.state_dtype);
  args.state_pool = s.pool.view(pool.get());
  args.state_indices = tensor(indices.get(), s.c.index_dtype, {N});
  if (!s.flags.empty()) args.has_initial_state = tensor(flags.get(), s.c.flag_dtype, {N});
  if (s.C > 0) {
    args.checkpoint_offsets = tensor(offsets.get(), s.c.index_dtype, {N, s.C});
    if (s.c.checkpoints_to == CheckpointsTo::kTensor) args.checkpoints = run.checkpoints.view(checkpoints.get());
    if (s.c.checkpoints_to == CheckpointsTo::kSlots) {
      args.checkpoint_slots = tensor(slots.get(), s.c.index_dtype, {N, s.C});
    }
  }
  Plan plan(serving_desc(p, s.c.state_dtype, s.c.layout, FKDA_BACKEND_GPU, s.c.rule));
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, N, &bytes));
  DeviceBuffer workspace(bytes);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), bytes, stream));
  CUDA_REQUIRE(cudaGetLastError());
  CUDA_REQUIRE(cudaStreamSynchronize(stream));
  run.out = device.out.read<uint16_t>();
  pool.download(run.pool.bytes.data());
  checkpoints.download(run.checkpoints.bytes.data());
  return run;
}

struct ContiguousRun {
  std::vector<uint16_t> out;
  std::vector<unsigned char> final_state;
};

// The call with the same states passed as initial_state / final_state
// ([N, H, V, K] in the dtype and layout given), has_initial_state alike.
ContiguousRun run_contiguous(const Problem& p, fkda_dtype dtype, fkda_state_layout layout,
                             const std::vector<unsigned char>& initial, const std::vector<int64_t>& flags,
                             fkda_dtype flag_dtype) {
  const int64_t N = p.num_seqs();
  DeviceProblem device(p);
  DeviceBuffer initial_device(initial), final_device(initial.size()), flags_device(integer_bytes(flags, flag_dtype));
  CUDA_REQUIRE(cudaMemset(final_device.get(), kPoisonByte, initial.size()));
  Buffers buffers = device.buffers();
  buffers.initial_state = initial_device.get();
  buffers.final_state = final_device.get();
  fkda_fwd_args args = make_args(p, buffers, dtype);
  if (!flags.empty()) args.has_initial_state = tensor(flags_device.get(), flag_dtype, {N});
  Plan plan(serving_desc(p, dtype, layout));
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, N, &bytes));
  DeviceBuffer workspace(bytes);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), bytes, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return ContiguousRun{device.out.read<uint16_t>(), final_device.read<unsigned char>()};
}

// The pool's starting states gathered into [N, H, V, K] bytes (zeros for padded sequences).
std::vector<unsigned char> gathered_states(const PoolSetup& s) {
  std::vector<unsigned char> bytes;
  for (int64_t n = 0; n < s.N(); ++n) {
    if (s.padded(n)) {
      bytes.insert(bytes.end(), s.pool.slot_bytes(), 0);
      continue;
    }
    const auto first = s.pool.bytes.begin() + std::ptrdiff_t(s.pool.slot_first_byte(s.indices[size_t(n)]));
    bytes.insert(bytes.end(), first, first + std::ptrdiff_t(s.pool.slot_bytes()));
  }
  return bytes;
}

// The first `lengths[n]` tokens of each sequence of p, as a varlen problem.
Problem cut(const Problem& p, const std::vector<int64_t>& lengths) {
  Problem q = p;
  q.B = 1;
  q.cu_seqlens = {0};
  q.q.clear();
  q.k.clear();
  q.v.clear();
  q.g.clear();
  q.beta.clear();
  const size_t row = size_t(p.H * 128), beta_row = size_t(p.H);
  for (int64_t n = 0; n < p.num_seqs(); ++n) {
    const SequenceTokens t = tokens_of(p, n);
    const size_t first = size_t(t.row * p.T + t.begin);
    auto append = [&](std::vector<uint16_t>& to, const std::vector<uint16_t>& from, size_t width) {
      to.insert(to.end(), from.begin() + std::ptrdiff_t(first * width),
                from.begin() + std::ptrdiff_t((first + size_t(lengths[size_t(n)])) * width));
    };
    append(q.q, p.q, row);
    append(q.k, p.k, row);
    append(q.v, p.v, row);
    append(q.g, p.g, row);
    append(q.beta, p.beta, beta_row);
    q.cu_seqlens.push_back(q.cu_seqlens.back() + lengths[size_t(n)]);
  }
  q.T = q.cu_seqlens.back();
  return q;
}

// The expected checkpoint of every taken (sequence, column), in f32 as its
// dtype holds it: the f32 final state of a prefill cut at the offset, from
// the sequence's starting state widened exactly to f32.
struct ExpectedCheckpoint {
  int64_t n, column, offset;
  std::vector<float> state;  // [H, V, K]
};
std::vector<ExpectedCheckpoint> expected_checkpoints(const PoolSetup& s, fkda_dtype destination_dtype) {
  std::vector<ExpectedCheckpoint> all;
  for (int64_t c = 0; c < s.C; ++c) {
    std::vector<int64_t> lengths(size_t(s.N()), 0);
    std::vector<ExpectedCheckpoint> column;
    for (int64_t n = 0; n < s.N(); ++n) {
      for (const auto& [col, offset] : taken_checkpoints(s, n)) {
        if (col != c) continue;
        lengths[size_t(n)] = offset;
        column.push_back({n, c, offset, {}});
      }
    }
    if (column.empty()) continue;
    std::vector<float> initial;
    for (int64_t n = 0; n < s.N(); ++n) {
      const std::vector<float> one = s.initial(n);
      initial.insert(initial.end(), one.begin(), one.end());
    }
    std::vector<unsigned char> initial_bytes(initial.size() * 4);
    std::memcpy(initial_bytes.data(), initial.data(), initial_bytes.size());
    const ContiguousRun r = run_contiguous(cut(s.p, lengths), FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, initial_bytes, {},
                                           FKDA_DTYPE_I32);
    for (ExpectedCheckpoint& e : column) {
      std::vector<float> state(size_t(s.p.H * kMatrixElements));
      std::memcpy(state.data(), r.final_state.data() + size_t(e.n) * state.size() * 4, state.size() * 4);
      e.state = rounded_to(state, destination_dtype);
      all.push_back(std::move(e));
    }
  }
  return all;
}

// --------------------------------------------------------- the checks ---

struct Findings {
  size_t out_differing = 0, padding_nonzero = 0, states_differing = 0, checkpoints_differing = 0,
         pool_touched = 0, checkpoint_bytes_touched = 0, checkpoints_taken = 0;
  double out_error = 0, state_error = 0, checkpoint_error = 0;
};

Findings examine(const PoolSetup& s, const PoolRun& run) {
  Findings f;
  const Problem& p = s.p;
  const int64_t N = s.N();
  const std::vector<unsigned char> initial = gathered_states(s);
  const ContiguousRun contiguous = run_contiguous(p, s.c.state_dtype, s.c.layout, initial, s.flags, s.c.flag_dtype);

  // Outputs: bits of the contiguous run, zeros for padding.
  std::vector<float> out;
  std::vector<double> out_ref;
  std::vector<float> initial_f32;
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<float> one = s.initial(n);
    initial_f32.insert(initial_f32.end(), one.begin(), one.end());
  }
  Problem with_states = p;
  with_states.initial_state = initial_f32;
  const Reference reference = reference_recurrence(with_states);
  const size_t row = size_t(p.H * 128);
  for (int64_t n = 0; n < N; ++n) {
    const SequenceTokens t = tokens_of(p, n);
    for (size_t i = size_t(t.row * p.T + t.begin) * row; i < size_t(t.row * p.T + t.begin + t.length) * row; ++i) {
      if (s.padded(n)) {
        f.padding_nonzero += run.out[i] != 0;
      } else {
        f.out_differing += run.out[i] != contiguous.out[i];
        out.push_back(from_bf16(run.out[i]));
        out_ref.push_back(reference.out[i]);
      }
    }
  }
  f.out_error = out.empty() ? 0.0 : rel_l2(out, out_ref);

  // States: each slot the bits of the contiguous final state.
  std::vector<int64_t> written;
  std::vector<float> states;
  std::vector<double> states_ref;
  const size_t block = s.pool.slot_bytes(), elements = size_t(p.H * kMatrixElements);
  for (int64_t n = 0; n < N; ++n) {
    if (s.padded(n)) continue;
    const int64_t slot = s.indices[size_t(n)];
    written.push_back(slot);
    f.states_differing += std::memcmp(run.pool.bytes.data() + run.pool.slot_first_byte(slot),
                                      contiguous.final_state.data() + size_t(n) * block, block) != 0;
    const std::vector<float> got = run.pool.get(slot);
    states.insert(states.end(), got.begin(), got.end());
    states_ref.insert(states_ref.end(), reference.final_state.begin() + std::ptrdiff_t(size_t(n) * elements),
                      reference.final_state.begin() + std::ptrdiff_t(size_t(n + 1) * elements));
  }
  f.state_error = states.empty() ? 0.0 : rel_l2(states, states_ref);

  // Checkpoints: the bits of the cut prefills, close to fp64 too.
  const fkda_dtype destination =
      s.c.checkpoints_to == CheckpointsTo::kSlots ? s.c.state_dtype : s.c.checkpoint_dtype;
  std::vector<std::pair<int64_t, int64_t>> tensor_written;
  std::vector<float> checkpoints;
  std::vector<double> checkpoints_ref;
  for (const ExpectedCheckpoint& e : expected_checkpoints(s, destination)) {
    std::vector<float> got;
    if (s.c.checkpoints_to == CheckpointsTo::kTensor) {
      tensor_written.emplace_back(e.n, e.column);
      got = run.checkpoints.get(e.n, e.column);
    } else {
      const int64_t slot = s.checkpoint_slots[size_t(e.n * s.C + e.column)];
      if (slot < first_real_slot(s.c.rule) || slot >= s.pool.slots) continue;  // skipped
      written.push_back(slot);
      got = run.pool.get(slot);
    }
    ++f.checkpoints_taken;
    f.checkpoints_differing += std::memcmp(got.data(), e.state.data(), got.size() * 4) != 0;
    const Reference at = sequence_reference(p, tokens_of(p, e.n), e.offset, s.initial(e.n));
    checkpoints.insert(checkpoints.end(), got.begin(), got.end());
    checkpoints_ref.insert(checkpoints_ref.end(), at.final_state.begin(), at.final_state.end());
  }
  f.checkpoint_error = checkpoints.empty() ? 0.0 : rel_l2(checkpoints, checkpoints_ref);
  f.pool_touched = touched_outside(s.pool, s.pool.bytes, run.pool.bytes, written);
  f.checkpoint_bytes_touched = run.checkpoints.touched_outside(tensor_written);
  return f;
}

void check(const PoolSetup& s, const Findings& f) {
  const fkda_dtype checkpoint_dtype =
      s.c.checkpoints_to == CheckpointsTo::kSlots ? s.c.state_dtype : s.c.checkpoint_dtype;
  report(s.c.name, {{"out", f.out_error, kOutTolerance},
                    {"state", f.state_error, state_tolerance(s.c.state_dtype)},
                    {"checkpoints", f.checkpoint_error, state_tolerance(checkpoint_dtype)}});
  std::printf("%-44s  vs contiguous: %zu output values, %zu states differ; %zu of %zu checkpoints differ from "
              "cut prefills; %zu nonzero padded values; %zu pool, %zu checkpoint bytes touched\n",
              s.c.name.c_str(), f.out_differing, f.states_differing, f.checkpoints_differing, f.checkpoints_taken,
              f.padding_nonzero, f.pool_touched, f.checkpoint_bytes_touched);
  std::fflush(stdout);
  CHECK(f.out_error <= kOutTolerance);
  CHECK(f.state_error <= state_tolerance(s.c.state_dtype));
  CHECK(f.checkpoint_error <= state_tolerance(checkpoint_dtype));
  CHECK(f.out_differing == 0);
  CHECK(f.states_differing == 0);
  CHECK(f.checkpoints_differing == 0);
  CHECK(f.padding_nonzero == 0);
  CHECK(f.pool_touched == 0);
  CHECK(f.checkpoint_bytes_touched == 0);
}

void run_and_check(const PoolSetup& s) {
  INFO(s.c.name);
  check(s, examine(s, run_pool(s)));
}

PoolCase varlen(std::string name, std::vector<int64_t> lengths, int64_t H, uint64_t seed) {
  return packed_case<PoolCase>(std::move(name), std::move(lengths), H, seed);
}

}  // namespace

TEST_CASE("pool prefill: bit for bit the contiguous-state prefill", "[gpu][pool][window]") {
  PoolCase a = varlen("pool f32 VK varlen, padding, fresh", {40, 0, 17, 1, 100, 33}, 3, 1);
  a.padded = {3};
  a.with_flags = true;
  a.fresh = {1, 4};
  run_and_check(make_setup(a));

  PoolCase b;
  b.name = "pool bf16 KV batched, slot 0 real";
  b.B = 3;
  b.T = 50;
  b.H = 2;
  b.state_dtype = FKDA_DTYPE_BF16;
  b.layout = FKDA_STATE_LAYOUT_KV;
  b.rule = FKDA_NULL_SLOT_NEGATIVE;
  b.seed = 2;
  run_and_check(make_setup(b));

  PoolCase c = varlen("pool f32 i64 indices, i32 flags", {300, 64, 5}, 4, 3);
  c.index_dtype = FKDA_DTYPE_I64;
  c.with_flags = true;
  c.flag_dtype = FKDA_DTYPE_I32;
  c.fresh = {2};
  c.padded = {1};
  run_and_check(make_setup(c));

  SECTION("mutation: one ulp of one starting state shows in the bitwise comparison") {
    const PoolSetup s = make_setup(varlen("mutation: one ulp", {33, 20}, 2, 4));
    const PoolRun run = run_pool(s);
    std::vector<unsigned char> initial = gathered_states(s);
    initial[4 * 1000] ^= 1;  // the lowest mantissa bit of one f32 element of sequence 0
    const ContiguousRun other = run_contiguous(s.p, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, initial, {}, FKDA_DTYPE_I32);
    size_t differing = 0;
    for (size_t i = 0; i < s.pool.slot_bytes(); ++i) {
      differing += run.pool.bytes[run.pool.slot_first_byte(s.indices[0]) + i] != other.final_state[i];
    }
    std::printf("%-44s  mutation: %zu state bytes differ\n", s.c.name.c_str(), differing);
    CHECK(differing > 0);
  }
  SECTION("mutation: a kernel that ignored the pool's state would fail the fp64 check") {
    PoolSetup s = make_setup(varlen("mutation: zero starting states", {40, 17}, 2, 5));
    const PoolRun run = run_pool(s);
    Problem zero_start = s.p;
    zero_start.initial_state.assign(size_t(s.p.state_elems()), 0.f);
    const Reference wrong = reference_recurrence(zero_start);
    std::vector<float> states;
    for (int64_t n = 0; n < s.N(); ++n) {
      const std::vector<float> one = run.pool.get(s.indices[size_t(n)]);
      states.insert(states.end(), one.begin(), one.end());
    }
    require_detected(s.c.name, "out", rel_l2(bf16_to_float(run.out), wrong.out), kOutTolerance);
    require_detected(s.c.name, "state", rel_l2(states, wrong.final_state), kF32StateTolerance);
  }
}

TEST_CASE("pool prefill: checkpoints equal prefills cut at their offsets", "[gpu][pool][window]") {
  const std::vector<int64_t> lengths = {64, 48, 300, 15, 0, 257};
  const std::vector<std::vector<int64_t>> offsets = {
      {16, 64, -1}, {32, -1, -1}, {16, 256, 288}, {-1, -1, -1}, {-1, -1, -1}, {256, -1, -1}};
  PoolCase t = varlen("checkpoints to an f32 tensor", lengths, 3, 10);
  t.checkpoint_offsets = offsets;
  t.checkpoints_to = CheckpointsTo::kTensor;
  run_and_check(make_setup(t));

  PoolCase b = t;
  b.name = "bf16 checkpoints of an f32 pool, KV";
  b.checkpoint_dtype = FKDA_DTYPE_BF16;
  b.layout = FKDA_STATE_LAYOUT_KV;
  b.seed = 11;
  run_and_check(make_setup(b));

  PoolCase slots = t;
  slots.name = "checkpoints to pool slots, bf16 pool";
  slots.state_dtype = FKDA_DTYPE_BF16;
  slots.checkpoints_to = CheckpointsTo::kSlots;
  slots.padded = {1};
  slots.with_flags = true;
  slots.fresh = {2};
  slots.seed = 12;
  PoolSetup s = make_setup(slots);
  s.checkpoint_slots[size_t(0 * 3 + 1)] = null_index(slots.rule, 0);  // a null slot: skipped
  run_and_check(s);

  SECTION("mutation: a checkpoint one chunk early would fail the comparison") {
    PoolCase m = t;
    m.name = "mutation: checkpoint one chunk early";
    const PoolSetup ms = make_setup(m);
    const PoolRun run = run_pool(ms);
    PoolSetup early = ms;
    early.offsets[size_t(2 * 3 + 1)] -= 16;  // sequence 2: 240 in place of 256
    double error = 0;
    for (const ExpectedCheckpoint& e : expected_checkpoints(early, FKDA_DTYPE_F32)) {
      if (e.n != 2 || e.column != 1) continue;
      error = rel_l2(run.checkpoints.get(2, 1), widen(e.state));
    }
    require_detected(m.name, "checkpoint", error, kF32StateTolerance);
  }
}

TEST_CASE("pool prefill: chunk-parallel, checkpoints across segment boundaries", "[gpu][pool][segments]") {
  // Segments of 3 chunks (48 tokens): checkpoints at 16, 48, 64, 256 and 288
  // tokens fall inside segments and at their ends. The pool run and the
  // contiguous run it is compared with are cut the same way, so they agree
  // bit for bit; the checkpoints are held to fp64 only, since the prefills
  // cut at their offsets have other segments.
  const fkda_test::Tuning segments(-1, -1, FKDA_CHUNK_PARALLEL_ON, 3);
  const std::vector<int64_t> lengths = {64, 48, 300, 15, 0, 257};
  const std::vector<std::vector<int64_t>> offsets = {
      {16, 48, 64}, {32, 48, -1}, {16, 256, 288}, {-1, -1, -1}, {-1, -1, -1}, {48, 96, 256}};
  for (CheckpointsTo to : {CheckpointsTo::kTensor, CheckpointsTo::kSlots}) {
    PoolCase c = varlen(to == CheckpointsTo::kTensor ? "segments: checkpoints to a tensor, fresh, padding"
                                                     : "segments: checkpoints to slots, bf16 pool, KV",
                        lengths, 3, to == CheckpointsTo::kTensor ? 30 : 31);
    c.checkpoint_offsets = offsets;
    c.checkpoints_to = to;
    c.with_flags = true;
    c.fresh = {2};
    c.padded = {1};
    if (to == CheckpointsTo::kSlots) {
      c.state_dtype = FKDA_DTYPE_BF16;
      c.layout = FKDA_STATE_LAYOUT_KV;
    }
    const PoolSetup s = make_setup(c);
    INFO(s.c.name);
    const Findings f = examine(s, run_pool(s));
    const fkda_dtype checkpoint_dtype = to == CheckpointsTo::kSlots ? c.state_dtype : c.checkpoint_dtype;
    std::printf("%-44s  out %.3e state %.3e checkpoints %.3e (%zu taken); %zu output values, %zu states differ "
                "from the contiguous run\n",
                s.c.name.c_str(), f.out_error, f.state_error, f.checkpoint_error, f.checkpoints_taken,
                f.out_differing, f.states_differing);
    std::fflush(stdout);
    CHECK(f.out_error <= kOutTolerance);
    CHECK(f.state_error <= state_tolerance(c.state_dtype));
    CHECK(f.checkpoint_error <= state_tolerance(checkpoint_dtype));
    CHECK(f.checkpoints_taken > 0);
    CHECK(f.out_differing == 0);
    CHECK(f.states_differing == 0);
    CHECK(f.padding_nonzero == 0);
    CHECK(f.pool_touched == 0);
    CHECK(f.checkpoint_bytes_touched == 0);
  }
}

TEST_CASE("pool prefill: pools, padding and checkpoints under the softplus and log-decay gates",
          "[gpu][pool][window]") {
  // make_setup's expected results follow the case's gate (serving_support.h).
  for (int32_t gate : {FKDA_GATE_SOFTPLUS, FKDA_GATE_LOG_DECAY}) {
    const std::string name = gate == FKDA_GATE_SOFTPLUS ? "softplus: " : "log-decay: ";
    PoolCase a = varlen(name + "pool f32 VK varlen, padding, fresh", {40, 0, 17, 1, 100, 33}, 3, 21);
    a.gate_mode = gate;
    a.padded = {3};
    a.with_flags = true;
    a.fresh = {1, 4};
    run_and_check(make_setup(a));

    PoolCase t = varlen(name + "checkpoints to bf16 KV pool slots", {64, 48, 300, 15}, 2, 22);
    t.gate_mode = gate;
    t.state_dtype = FKDA_DTYPE_BF16;
    t.layout = FKDA_STATE_LAYOUT_KV;
    t.checkpoint_offsets = {{16, 64, -1}, {32, -1, -1}, {16, 256, 288}, {-1, -1, -1}};
    t.checkpoints_to = CheckpointsTo::kSlots;
    run_and_check(make_setup(t));
  }
}

TEST_CASE("pool prefill: padding and out-of-range device values touch nothing", "[gpu][pool][window][sanitize]") {
  for (fkda_null_slot_rule rule : {FKDA_NULL_SLOT_NEGATIVE, FKDA_NULL_SLOT_NONPOSITIVE}) {
    PoolCase c = varlen(std::string("padding, rule ") + (rule == FKDA_NULL_SLOT_NEGATIVE ? "negative" : "nonpositive"),
                        {20, 0, 0, 33, 16, 1}, 2, 20 + uint64_t(rule));
    c.rule = rule;
    c.padded = {0, 2, 4};
    c.checkpoint_offsets = {{16, -1}, {-1, -1}, {-1, -1}, {16, 32}, {16, -1}, {-1, -1}};
    c.checkpoints_to = CheckpointsTo::kTensor;
    run_and_check(make_setup(c));
  }
  PoolCase bad = varlen("bad device indices and offsets", {40, 33, 64, 20, 0}, 2, 30);
  bad.index_dtype = FKDA_DTYPE_I64;
  bad.checkpoint_offsets = {{17, 32, 16}, {0, -16, 48}, {32, 16, 1LL << 40}, {16, 16, 16}, {16, -1, -1}};
  bad.checkpoints_to = CheckpointsTo::kSlots;
  PoolSetup s = make_setup(bad);
  s.indices[1] = s.pool.slots;          // one past the pool: padding
  s.indices[3] = int64_t(1) << 40;      // far outside: padding
  s.checkpoint_slots[size_t(2 * 3 + 0)] = s.pool.slots + 5;  // outside: skipped
  run_and_check(s);
}

TEST_CASE("pool prefill: a captured CUDA graph replays the eager run", "[gpu][pool]") {
  PoolCase c = varlen("graph pool + checkpoint slots", {48, 0, 20}, 2, 40);
  c.checkpoint_offsets = {{16, 32}, {-1, -1}, {16, -1}};
  c.checkpoints_to = CheckpointsTo::kSlots;
  c.with_flags = true;
  c.fresh = {2};
  const PoolSetup s = make_setup(c);
  const PoolRun eager = run_pool(s);

  const Problem& p = s.p;
  const int64_t N = s.N();
  DeviceProblem device(p);
  DeviceBuffer pool(s.pool.bytes), indices(integer_bytes(s.indices, c.index_dtype)),
      flags(integer_bytes(s.flags, c.flag_dtype)), offsets(integer_bytes(s.offsets, c.index_dtype)),
      slots(integer_bytes(s.checkpoint_slots, c.index_dtype));
  fkda_fwd_args args = make_args(p, device.buffers(), c.state_dtype);
  args.state_pool = s.pool.view(pool.get());
  args.state_indices = tensor(indices.get(), c.index_dtype, {N});
  args.has_initial_state = tensor(flags.get(), c.flag_dtype, {N});
  args.checkpoint_offsets = tensor(offsets.get(), c.index_dtype, {N, s.C});
  args.checkpoint_slots = tensor(slots.get(), c.index_dtype, {N, s.C});
  Plan plan(serving_desc(p, c.state_dtype, c.layout, FKDA_BACKEND_GPU, c.rule));
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, N, &bytes));
  DeviceBuffer workspace(bytes);
  const Stream stream;
  const CapturedCall graph(stream.get(), cudaStreamCaptureModeGlobal,
                           [&] { return fkda_fwd(plan.get(), &args, workspace.get(), bytes, stream.get()); });
  for (int replay = 0; replay < 2; ++replay) {
    pool.upload(s.pool.bytes.data());
    device.out.upload(std::vector<uint16_t>(p.v.size(), kPoisonBf16).data());
    graph.replay(stream.get());
    CHECK(device.out.read<uint16_t>() == eager.out);
    CHECK(pool.read<unsigned char>() == eager.pool.bytes);
  }
}

TEST_CASE("pool prefill: small cases for compute-sanitizer", "[gpu][pool][sanitize]") {
  PoolCase a = varlen("sanitize pool f32 VK, checkpoint tensor", {33, 0, 16, 5}, 2, 50);
  a.padded = {3};
  a.checkpoint_offsets = {{16, 32}, {-1, -1}, {16, -1}, {16, -1}};
  a.checkpoints_to = CheckpointsTo::kTensor;
  a.checkpoint_dtype = FKDA_DTYPE_BF16;
  run_and_check(make_setup(a));
  PoolCase b = varlen("sanitize pool bf16 KV, checkpoint slots", {20, 40}, 2, 51);
  b.state_dtype = FKDA_DTYPE_BF16;
  b.layout = FKDA_STATE_LAYOUT_KV;
  b.checkpoint_offsets = {{16}, {32}};
  b.checkpoints_to = CheckpointsTo::kSlots;
  b.with_flags = true;
  b.fresh = {0};
  run_and_check(make_setup(b));
}
