// SPDX-License-Identifier: MIT
// Every bad call gets a status and a message naming the argument, before any
// work starts; nothing is written.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <string>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "status_checks.h"

namespace {

constexpr int64_t kB = 2, kT = 20, kH = 2, kD = 128;

// Host buffers for a valid CPU call with B = 2, T = 20, H = 2 and f32
// states, on a plan of the given gate and beta modes; varlen calls reuse them
// as one row of 40 tokens. g and beta also in f32, for the calls that pass them so.
struct Fixture {
  std::vector<uint16_t> q, k, v, g, beta, out;
  std::vector<float> A_log, dt_bias, initial_state, final_state, g_f32, beta_f32;
  std::vector<int64_t> cu_seqlens = {0, 10, 25, 40};
  std::vector<uint8_t> workspace;
  fkda_plan_t plan = nullptr;

  explicit Fixture(int32_t gate_mode = FKDA_GATE_BOUNDED, int32_t beta_mode = FKDA_BETA_LOGITS) {
    const size_t act = kB * kT * kH * kD;
    q.assign(act, fkda_ref::to_bf16(0.5f));
    k.assign(act, fkda_ref::to_bf16(-0.25f));
    v.assign(act, fkda_ref::to_bf16(1.5f));
    g.assign(act, fkda_ref::to_bf16(0.75f));
    out.assign(act, 0xFFFF);
    beta.assign(kB * kT * kH, fkda_ref::to_bf16(0.3f));
    A_log.assign(kH, 0.2f);
    dt_bias.assign(kH * kD, 0.1f);
    initial_state.assign(3 * kH * kD * kD, 0.01f);
    final_state.assign(3 * kH * kD * kD, -7.f);
    g_f32.assign(act, -0.25f);
    beta_f32.assign(kB * kT * kH, 0.4f);
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = kH;
    desc.backend = FKDA_BACKEND_CPU;
    desc.gate_mode = gate_mode;
    desc.beta_mode = beta_mode;
    REQUIRE(fkda_plan_create(&desc, &plan) == FKDA_SUCCESS);
    size_t bytes = 0;
    REQUIRE(fkda_plan_workspace_size(plan, kB * kT, 3, &bytes) == FKDA_SUCCESS);
    workspace.assign(bytes + 256, 0);
  }
  ~Fixture() { fkda_plan_destroy(plan); }

  fkda_fwd_args batched() {
    fkda_fwd_args a = FKDA_FWD_ARGS_INIT;
    a.q = fkda_ref::tensor(q.data(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    a.k = fkda_ref::tensor(k.data(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    a.v = fkda_ref::tensor(v.data(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    a.g = fkda_ref::tensor(g.data(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    a.beta = fkda_ref::tensor(beta.data(), FKDA_DTYPE_BF16, {kB, kT, kH});
    a.A_log = fkda_ref::tensor(A_log.data(), FKDA_DTYPE_F32, {kH});
    a.dt_bias = fkda_ref::tensor(dt_bias.data(), FKDA_DTYPE_F32, {kH, kD});
    a.out = fkda_ref::tensor(out.data(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    a.initial_state = fkda_ref::tensor(initial_state.data(), FKDA_DTYPE_F32, {kB, kH, kD, kD});
    a.final_state = fkda_ref::tensor(final_state.data(), FKDA_DTYPE_F32, {kB, kH, kD, kD});
    a.scale = 0.1f;
    return a;
  }

  fkda_fwd_args varlen() {
    fkda_fwd_args a = batched();
    for (fkda_tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.out}) {
      *t = fkda_ref::tensor(t->data, FKDA_DTYPE_BF16, {1, kB * kT, kH, kD});
    }
    a.beta = fkda_ref::tensor(beta.data(), FKDA_DTYPE_BF16, {1, kB * kT, kH});
    a.initial_state = fkda_ref::tensor(initial_state.data(), FKDA_DTYPE_F32, {3, kH, kD, kD});
    a.final_state = fkda_ref::tensor(final_state.data(), FKDA_DTYPE_F32, {3, kH, kD, kD});
    a.cu_seqlens = fkda_ref::tensor(cu_seqlens.data(), FKDA_DTYPE_I64, {4});
    return a;
  }

  fkda_status run(const fkda_fwd_args& a) { return fkda_fwd(plan, &a, workspace.data(), workspace.size(), nullptr); }

  fkda_tensor g_as_f32() { return fkda_ref::tensor(g_f32.data(), FKDA_DTYPE_F32, {kB, kT, kH, kD}); }
  fkda_tensor beta_as_f32() { return fkda_ref::tensor(beta_f32.data(), FKDA_DTYPE_F32, {kB, kT, kH}); }

  // A call that must fail with this message and write nothing.
  void check_rejected(const fkda_fwd_args& a, const std::string& message_start) {
    std::fill(out.begin(), out.end(), uint16_t(0xFFFF));
    std::fill(final_state.begin(), final_state.end(), -7.f);
    check_failure(run(a), FKDA_ERROR_INVALID_ARGUMENT, message_start);
    CHECK(std::all_of(out.begin(), out.end(), [](uint16_t o) { return o == 0xFFFF; }));
    CHECK(std::all_of(final_state.begin(), final_state.end(), [](float s) { return s == -7.f; }));
  }
};

struct BadCall {
  const char* what;
  std::function<void(fkda_fwd_args&, Fixture&)> break_it;
  fkda_status expected;
  const char* message_start;
  bool varlen = false;
};

void set_strides(fkda_tensor& t, std::initializer_list<int64_t> strides) {
  int i = 0;
  for (int64_t s : strides) t.strides[i++] = s;
}

constexpr int64_t kHuge = int64_t(1) << 62;
constexpr int64_t kMaxStride = std::numeric_limits<int64_t>::max();

void* off_by_one_byte(void* data) { return static_cast<char*>(data) + 1; }

// An aligned address 1 KiB below the end of the address space: any tensor
// longer than that would wrap around.
void* near_top_of_address_space() { return reinterpret_cast<void*>(~uintptr_t(0) - 1023); }

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

std::vector<BadCall> bad_fwd_calls() {
  const fkda_status BAD = FKDA_ERROR_INVALID_ARGUMENT;
  return {
      {"struct_size zero", [](fkda_fwd_args& a, Fixture&) { a.struct_size = 0; }, BAD, "args: struct_size is 0"},
      {"struct_size splitting a field", [](fkda_fwd_args& a, Fixture&) { a.struct_size -= 8; }, BAD, "args: struct_size is 3152, not a size fkda_fwd_args has had"},
      {"q missing", [](fkda_fwd_args& a, Fixture&) { a.q = FKDA_TENSOR_NONE; }, BAD, "q: required tensor is missing"},
      {"q data NULL", [](fkda_fwd_args& a, Fixture&) { a.q.data = nullptr; }, BAD, "q: data is NULL"},
      {"q f32", [](fkda_fwd_args& a, Fixture&) { a.q.dtype = FKDA_DTYPE_F32; }, BAD, "q: expected dtype bf16, got f32"},
      {"q unknown dtype", [](fkda_fwd_args& a, Fixture&) { a.q.dtype = 42; }, BAD, "q: expected dtype bf16, got invalid dtype (42)"},
      {"q rank 3", [](fkda_fwd_args& a, Fixture&) { a.q.rank = 3; }, BAD, "q: expected rank 4, got 3"},
      {"q heads differ from plan", [](fkda_fwd_args& a, Fixture&) { a.q.shape[2] = 3; }, BAD, "q: expected 2 heads"},
      {"q head dim 64", [](fkda_fwd_args& a, Fixture&) { a.q.shape[3] = 64; }, BAD, "q: expected head dim 128"},
      {"q negative extent", [](fkda_fwd_args& a, Fixture&) { a.q.shape[1] = -4; }, BAD, "q: negative extent"},
      {"q negative stride", [](fkda_fwd_args& a, Fixture&) { a.q.strides[1] = -256; }, BAD, "q: negative strides"},
      {"q last axis strided", [](fkda_fwd_args& a, Fixture&) { a.q.strides[3] = 2; }, BAD, "q: the last axis must be contiguous"},
      {"k missing", [](fkda_fwd_args& a, Fixture&) { a.k = FKDA_TENSOR_NONE; }, BAD, "k: required tensor is missing"},
      {"k f16", [](fkda_fwd_args& a, Fixture&) { a.k.dtype = FKDA_DTYPE_F16; }, BAD, "k: expected dtype bf16, got f16"},
      {"k T mismatch", [](fkda_fwd_args& a, Fixture&) { a.k.shape[1] = kT - 1; }, BAD, "k: expected shape [2, 20, 2, 128], got [2, 19, 2, 128]"},
      {"v head dim 64", [](fkda_fwd_args& a, Fixture&) { a.v.shape[3] = 64; }, BAD, "v: expected shape"},
      {"v data NULL", [](fkda_fwd_args& a, Fixture&) { a.v.data = nullptr; }, BAD, "v: data is NULL"},
      {"g batch mismatch", [](fkda_fwd_args& a, Fixture&) { a.g.shape[0] = 1; }, BAD, "g: expected shape"},
      {"g f32 with the bounded gate", [](fkda_fwd_args& a, Fixture& f) { a.g = f.g_as_f32(); }, BAD, "g: expected dtype bf16 (the plan's gate is bounded; f32 g is taken with the log-decay gate only), got f32"},
      {"beta rank 4", [](fkda_fwd_args& a, Fixture&) { a.beta.rank = 4; a.beta.shape[3] = 1; }, BAD, "beta: expected rank 3, got 4"},
      {"beta f16", [](fkda_fwd_args& a, Fixture&) { a.beta.dtype = FKDA_DTYPE_F16; }, BAD, "beta: expected dtype bf16 or f32, got f16"},
      {"beta missing", [](fkda_fwd_args& a, Fixture&) { a.beta = FKDA_TENSOR_NONE; }, BAD, "beta: required tensor is missing"},
      {"A_log too long", [](fkda_fwd_args& a, Fixture&) { a.A_log.shape[0] = 3; }, BAD, "A_log: expected shape [2], got [3]"},
      {"A_log bf16", [](fkda_fwd_args& a, Fixture&) { a.A_log.dtype = FKDA_DTYPE_BF16; }, BAD, "A_log: expected dtype f32, got bf16"},
      {"A_log strided", [](fkda_fwd_args& a, Fixture&) { a.A_log.strides[0] = 2; }, BAD, "A_log: the last axis must be contiguous"},
      {"dt_bias rank 1", [](fkda_fwd_args& a, Fixture&) { a.dt_bias.rank = 1; a.dt_bias.shape[0] = kH * kD; }, BAD, "dt_bias: expected rank 2, got 1"},
      {"dt_bias padded rows", [](fkda_fwd_args& a, Fixture&) { set_strides(a.dt_bias, {256, 1}); }, BAD, "dt_bias: expected contiguous strides [128, 1], got [256, 1]"},
      {"dt_bias data NULL", [](fkda_fwd_args& a, Fixture&) { a.dt_bias.data = nullptr; }, BAD, "dt_bias: data is NULL"},
      {"A_log data NULL", [](fkda_fwd_args& a, Fixture&) { a.A_log.data = nullptr; }, BAD, "A_log: data is NULL"},
      {"out f32", [](fkda_fwd_args& a, Fixture&) { a.out.dtype = FKDA_DTYPE_F32; }, BAD, "out: expected dtype bf16, got f32"},
      {"out shape", [](fkda_fwd_args& a, Fixture&) { a.out.shape[2] = 1; }, BAD, "out: expected shape"},
      {"out tokens overlap", [](fkda_fwd_args& a, Fixture&) { a.out.strides[1] = 0; }, BAD, "out: strides"},
      {"out heads overlap", [](fkda_fwd_args& a, Fixture&) { a.out.strides[2] = 64; }, BAD, "out: strides"},
      {"out missing", [](fkda_fwd_args& a, Fixture&) { a.out = FKDA_TENSOR_NONE; }, BAD, "out: required tensor is missing"},
      {"initial_state bf16 on an f32 plan", [](fkda_fwd_args& a, Fixture&) { a.initial_state.dtype = FKDA_DTYPE_BF16; }, BAD, "initial_state: expected dtype f32 (the plan's state_dtype), got bf16"},
      {"initial_state N mismatch", [](fkda_fwd_args& a, Fixture&) { a.initial_state.shape[0] = 3; }, BAD, "initial_state: expected shape [2, 2, 128, 128], got [3, 2, 128, 128]"},
      {"initial_state data NULL", [](fkda_fwd_args& a, Fixture&) { a.initial_state.data = nullptr; }, BAD, "initial_state: data is NULL"},
      {"final_state transposed", [](fkda_fwd_args& a, Fixture&) { std::swap(a.final_state.strides[2], a.final_state.strides[3]); }, BAD, "final_state: the last axis must be contiguous"},
      {"final_state padded", [](fkda_fwd_args& a, Fixture&) { a.final_state.strides[0] *= 2; }, BAD, "final_state: expected contiguous strides"},
      {"final_state rank 3", [](fkda_fwd_args& a, Fixture&) { a.final_state.rank = 3; }, BAD, "final_state: expected rank 4, got 3"},
      {"scale NaN", [](fkda_fwd_args& a, Fixture&) { a.scale = kNaN; }, BAD, "scale: must be finite"},
      {"scale infinite", [](fkda_fwd_args& a, Fixture&) { a.scale = -kInf; }, BAD, "scale: must be finite"},
      {"cu_seqlens with B = 2", [](fkda_fwd_args& a, Fixture& f) { a.cu_seqlens = fkda_ref::tensor(f.cu_seqlens.data(), FKDA_DTYPE_I64, {4}); }, BAD, "cu_seqlens: varlen input packs all sequences into one row, so q's batch size must be 1, got 2"},
      {"cu_seqlens f32", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.dtype = FKDA_DTYPE_F32; }, BAD, "cu_seqlens: expected dtype i64 or i32, got f32", true},
      {"cu_seqlens rank 2", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.rank = 2; a.cu_seqlens.shape[1] = 1; }, BAD, "cu_seqlens: expected rank 1, got 2", true},
      {"cu_seqlens one offset", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.shape[0] = 1; }, BAD, "cu_seqlens: needs N + 1 >= 2 offsets, got 1", true},
      {"cu_seqlens unsorted", [](fkda_fwd_args&, Fixture& f) { f.cu_seqlens = {0, 25, 10, 40}; }, BAD, "cu_seqlens: must be non-decreasing, but cu_seqlens[2] = 10 < cu_seqlens[1] = 25", true},
      {"cu_seqlens negative", [](fkda_fwd_args&, Fixture& f) { f.cu_seqlens = {0, -5, 25, 40}; }, BAD, "cu_seqlens: must be non-decreasing", true},
      {"cu_seqlens not from 0", [](fkda_fwd_args&, Fixture& f) { f.cu_seqlens = {3, 10, 25, 40}; }, BAD, "cu_seqlens: must start at 0, got cu_seqlens[0] = 3", true},
      {"cu_seqlens past T", [](fkda_fwd_args&, Fixture& f) { f.cu_seqlens = {0, 10, 25, 41}; }, BAD, "cu_seqlens: must end at T = 40", true},
      {"cu_seqlens short of T", [](fkda_fwd_args&, Fixture& f) { f.cu_seqlens = {0, 10, 25, 39}; }, BAD, "cu_seqlens: must end at T = 40", true},
      {"cu_seqlens data NULL", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.data = nullptr; }, BAD, "cu_seqlens: data is NULL", true},
      {"varlen state N mismatch", [](fkda_fwd_args& a, Fixture&) { a.final_state.shape[0] = 2; }, BAD, "final_state: expected shape [3, 2, 128, 128]", true},
      // Descriptors whose memory cannot exist: their offsets would wrap.
      {"q token stride 2^62", [](fkda_fwd_args& a, Fixture&) { a.q.strides[1] = kHuge; }, BAD, "q: shape [2, 20, 2, 128] with strides [5120, 4611686018427387904, 128, 1] spans more than 2^63"},
      {"k batch stride 2^62", [](fkda_fwd_args& a, Fixture&) { a.k.strides[0] = kHuge; }, BAD, "k: shape"},
      {"v head stride 2^62", [](fkda_fwd_args& a, Fixture&) { a.v.strides[2] = kHuge; }, BAD, "v: shape"},
      {"g token stride 2^62", [](fkda_fwd_args& a, Fixture&) { a.g.strides[1] = kHuge; }, BAD, "g: shape"},
      {"beta token stride 2^62", [](fkda_fwd_args& a, Fixture&) { a.beta.strides[1] = kHuge; }, BAD, "beta: shape"},
      {"out token stride 2^62", [](fkda_fwd_args& a, Fixture&) { a.out.strides[1] = kHuge; }, BAD, "out: shape"},
      {"out batch stride INT64_MAX", [](fkda_fwd_args& a, Fixture&) { a.out.strides[0] = kMaxStride; }, BAD, "out: shape"},
      {"cu_seqlens stride 2^62", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.strides[0] = kHuge; }, BAD, "cu_seqlens: shape [4] with strides [4611686018427387904] spans more than 2^63", true},
      {"cu_seqlens of 2^63 - 1 offsets", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.shape[0] = kMaxStride; }, BAD, "cu_seqlens: shape [9223372036854775807] with strides [1] spans more than 2^63 bytes", true},
      {"q ends past the address space", [](fkda_fwd_args& a, Fixture&) { a.q.data = near_top_of_address_space(); }, BAD, "q: shape [2, 20, 2, 128] with strides [5120, 256, 128, 1] runs past the end of the address space"},
      {"final_state ends past the address space", [](fkda_fwd_args& a, Fixture&) { a.final_state.data = near_top_of_address_space(); }, BAD, "final_state: shape"},
      // Every tensor's data must be aligned to its elements.
      {"q misaligned", [](fkda_fwd_args& a, Fixture&) { a.q.data = off_by_one_byte(a.q.data); }, BAD, "q: data 0x"},
      {"k misaligned", [](fkda_fwd_args& a, Fixture&) { a.k.data = off_by_one_byte(a.k.data); }, BAD, "k: data 0x"},
      {"v misaligned", [](fkda_fwd_args& a, Fixture&) { a.v.data = off_by_one_byte(a.v.data); }, BAD, "v: data 0x"},
      {"g misaligned", [](fkda_fwd_args& a, Fixture&) { a.g.data = off_by_one_byte(a.g.data); }, BAD, "g: data 0x"},
      {"beta misaligned", [](fkda_fwd_args& a, Fixture&) { a.beta.data = off_by_one_byte(a.beta.data); }, BAD, "beta: data 0x"},
      {"A_log misaligned", [](fkda_fwd_args& a, Fixture&) { a.A_log.data = off_by_one_byte(a.A_log.data); }, BAD, "A_log: data 0x"},
      {"dt_bias misaligned", [](fkda_fwd_args& a, Fixture&) { a.dt_bias.data = off_by_one_byte(a.dt_bias.data); }, BAD, "dt_bias: data 0x"},
      {"out misaligned", [](fkda_fwd_args& a, Fixture&) { a.out.data = off_by_one_byte(a.out.data); }, BAD, "out: data 0x"},
      {"initial_state misaligned", [](fkda_fwd_args& a, Fixture&) { a.initial_state.data = off_by_one_byte(a.initial_state.data); }, BAD, "initial_state: data 0x"},
      {"final_state misaligned", [](fkda_fwd_args& a, Fixture&) { a.final_state.data = off_by_one_byte(a.final_state.data); }, BAD, "final_state: data 0x"},
      {"cu_seqlens misaligned", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.data = off_by_one_byte(a.cu_seqlens.data); }, BAD, "cu_seqlens: data 0x", true},
      {"cu_seqlens i32 on 4 + 2 bytes", [](fkda_fwd_args& a, Fixture&) { a.cu_seqlens.dtype = FKDA_DTYPE_I32; a.cu_seqlens.data = static_cast<char*>(a.cu_seqlens.data) + 2; }, BAD, "cu_seqlens: data 0x", true},
  };
}

}  // namespace

TEST_CASE("bad fwd calls are rejected with a message naming the argument", "[validation]") {
  for (const BadCall& bad : bad_fwd_calls()) {
    SECTION(bad.what) {
      Fixture f;
      fkda_fwd_args args = bad.varlen ? f.varlen() : f.batched();
      REQUIRE(f.run(args) == FKDA_SUCCESS);  // the unbroken call is valid
      std::fill(f.out.begin(), f.out.end(), uint16_t(0xFFFF));
      std::fill(f.final_state.begin(), f.final_state.end(), -7.f);
      bad.break_it(args, f);
      check_failure(f.run(args), bad.expected, bad.message_start);
      // nothing written
      CHECK(std::all_of(f.out.begin(), f.out.end(), [](uint16_t o) { return o == 0xFFFF; }));
      CHECK(std::all_of(f.final_state.begin(), f.final_state.end(), [](float s) { return s == -7.f; }));
    }
  }
}

TEST_CASE("bad plan handles and arguments", "[validation]") {
  Fixture f;
  fkda_fwd_args args = f.batched();
  size_t bytes = 0;
  float lower = 0;

  check_failure(fkda_fwd(f.plan, nullptr, nullptr, 0, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "args: NULL");
  check_failure(fkda_fwd(nullptr, &args, nullptr, 0, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "plan: NULL");
  check_failure(fkda_plan_workspace_size(f.plan, -1, 1, &bytes), FKDA_ERROR_INVALID_ARGUMENT, "total_tokens: must be >= 0");
  check_failure(fkda_plan_workspace_size(f.plan, 16, -1, &bytes), FKDA_ERROR_INVALID_ARGUMENT, "num_seqs: must be >= 0");
  check_failure(fkda_plan_workspace_size(f.plan, 16, 1, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "bytes: NULL");
  check_failure(fkda_get_lower_bound(f.plan, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "lower_bound: NULL");
  check_failure(fkda_plan_get_backend(f.plan, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "backend: NULL");
  check_failure(fkda_plan_create(nullptr, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "plan: NULL");

  SECTION("a destroyed plan is detected, not dereferenced") {
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = kH;
    desc.backend = FKDA_BACKEND_CPU;
    fkda_plan_t dead = nullptr;
    REQUIRE(fkda_plan_create(&desc, &dead) == FKDA_SUCCESS);
    REQUIRE(fkda_plan_destroy(dead) == FKDA_SUCCESS);
    check_failure(fkda_fwd(dead, &args, nullptr, 0, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "plan: not a live plan");
    check_failure(fkda_set_lower_bound(dead, -1.f), FKDA_ERROR_INVALID_ARGUMENT, "plan: not a live plan");
    check_failure(fkda_get_lower_bound(dead, &lower), FKDA_ERROR_INVALID_ARGUMENT, "plan: not a live plan");
    check_failure(fkda_plan_workspace_size(dead, 1, 1, &bytes), FKDA_ERROR_INVALID_ARGUMENT, "plan: not a live plan");
    check_failure(fkda_plan_destroy(dead), FKDA_ERROR_INVALID_ARGUMENT, "plan: not a live plan");
    CHECK(fkda_plan_destroy(nullptr) == FKDA_SUCCESS);
  }

  SECTION("lower_bound outside [-5, 0], NaN or infinite") {
    for (float bad : {-5.0001f, -6.f, 0.001f, 1.f, kNaN, kInf, -kInf}) {
      INFO("lower_bound " << bad);
      CHECK(fkda_set_lower_bound(f.plan, bad) == FKDA_ERROR_INVALID_ARGUMENT);
      CHECK(std::string(fkda_last_error()).rfind("lower_bound: ", 0) == 0);
      REQUIRE(fkda_get_lower_bound(f.plan, &lower) == FKDA_SUCCESS);
      CHECK(lower == -5.f);  // unchanged
    }
    check_failure(fkda_set_lower_bound(f.plan, -5.6f), FKDA_ERROR_INVALID_ARGUMENT, "lower_bound: -5.6");
    CHECK(std::string(fkda_last_error()).find("overflows bf16") != std::string::npos);
    for (float good : {-5.f, -2.5f, -1e-8f, 0.f}) {
      REQUIRE(fkda_set_lower_bound(f.plan, good) == FKDA_SUCCESS);
      REQUIRE(fkda_get_lower_bound(f.plan, &lower) == FKDA_SUCCESS);
      CHECK(lower == good);
      CHECK(std::string(fkda_last_error()).empty());
    }
  }

  SECTION("workspace too small or missing") {
    size_t needed = 0;
    REQUIRE(fkda_plan_workspace_size(f.plan, kB * kT, kB, &needed) == FKDA_SUCCESS);
    REQUIRE(needed > 0);
    check_failure(fkda_fwd(f.plan, &args, f.workspace.data(), needed - 1, nullptr),
                  FKDA_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes: " + std::to_string(needed - 1) + " bytes given");
    check_failure(fkda_fwd(f.plan, &args, nullptr, needed, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "workspace: NULL");
    check_failure(fkda_fwd(f.plan, &args, f.workspace.data() + 8, needed, nullptr), FKDA_ERROR_INVALID_ARGUMENT,
                  "workspace: must be 16-byte aligned");
    CHECK(fkda_fwd(f.plan, &args, f.workspace.data(), needed, nullptr) == FKDA_SUCCESS);
  }
}

TEST_CASE("the workspace a call uses shares no memory with an argument", "[validation]") {
  Fixture f;
  const fkda_fwd_args args = f.batched();
  size_t needed = 0;
  REQUIRE(fkda_plan_workspace_size(f.plan, kB * kT, kB, &needed) == FKDA_SUCCESS);
  // A workspace that starts inside q's buffer (read) and one inside the
  // initial state (read): the CPU backend's scratch would overwrite inputs.
  std::vector<uint8_t> arena(needed + f.q.size() * 2 + 64);
  for (void* inside : {static_cast<void*>(f.q.data()), static_cast<void*>(f.initial_state.data())}) {
    std::fill(f.out.begin(), f.out.end(), uint16_t(0xFFFF));
    check_failure(fkda_fwd(f.plan, &args, inside, needed, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "workspace: overlaps ");
    CHECK(std::all_of(f.out.begin(), f.out.end(), [](uint16_t o) { return o == 0xFFFF; }));
  }
  // All workspace_bytes are lent to the call (the CPU backend takes more
  // workers when given more): an arena holding the workspace and then q is
  // refused when lent whole, accepted when lent up to q.
  fkda_fwd_args in_arena = args;
  const size_t q_offset = (needed + 15) / 16 * 16;
  REQUIRE(q_offset + f.q.size() * 2 <= arena.size());
  std::memcpy(arena.data() + q_offset, f.q.data(), f.q.size() * 2);
  in_arena.q.data = arena.data() + q_offset;
  void* workspace = arena.data();
  REQUIRE(reinterpret_cast<uintptr_t>(workspace) % 16 == 0);
  check_failure(fkda_fwd(f.plan, &in_arena, workspace, arena.size(), nullptr), FKDA_ERROR_INVALID_ARGUMENT,
                "workspace: overlaps q");
  CHECK(fkda_fwd(f.plan, &in_arena, workspace, q_offset, nullptr) == FKDA_SUCCESS);
}

TEST_CASE("launch reports: CPU plans report no launch; bad calls are rejected", "[validation]") {
  Fixture f;
  fkda_fwd_args args = f.batched();
  size_t needed = 0;
  REQUIRE(fkda_plan_workspace_size(f.plan, kB * kT, kB, &needed) == FKDA_SUCCESS);
  REQUIRE(fkda_fwd(f.plan, &args, f.workspace.data(), needed, nullptr) == FKDA_SUCCESS);
  fkda_launch_report report = FKDA_LAUNCH_REPORT_INIT;
  report.vsplit = report.windows = report.slots_per_window = -1;
  REQUIRE(fkda_plan_get_launch_report(f.plan, &report) == FKDA_SUCCESS);
  CHECK(report.struct_size == sizeof(fkda_launch_report));
  CHECK(report.vsplit == 0);
  CHECK(report.windows == 0);
  CHECK(report.slots_per_window == 0);

  check_failure(fkda_plan_get_launch_report(f.plan, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "report: NULL");
  check_failure(fkda_plan_get_launch_report(nullptr, &report), FKDA_ERROR_INVALID_ARGUMENT, "plan: NULL");
  fkda_launch_report wrong_size = FKDA_LAUNCH_REPORT_INIT;
  wrong_size.struct_size = sizeof(fkda_launch_report) - 8;
  check_failure(fkda_plan_get_launch_report(f.plan, &wrong_size), FKDA_ERROR_INVALID_ARGUMENT,
                "report: struct_size is");
}

TEST_CASE("workspace sizes of any magnitude are answered without overflow", "[validation]") {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = 3;
  desc.backend = FKDA_BACKEND_CPU;
  fkda_plan_t plan = nullptr;
  REQUIRE(fkda_plan_create(&desc, &plan) == FKDA_SUCCESS);
  // Far more work than there are cores: one scratch region per core.
  size_t most = 0;
  REQUIRE(fkda_plan_workspace_size(plan, int64_t(1) << 40, int64_t(1) << 30, &most) == FKDA_SUCCESS);
  const int64_t sizes[] = {0, 1, 16, int64_t(1) << 31, kHuge, kMaxStride - 1, kMaxStride};
  for (int64_t tokens : sizes) {
    for (int64_t seqs : sizes) {
      INFO("total_tokens " << tokens << ", num_seqs " << seqs);
      size_t bytes = 0;
      REQUIRE(fkda_plan_workspace_size(plan, tokens, seqs, &bytes) == FKDA_SUCCESS);
      CHECK(bytes > 0);
      if (seqs >= int64_t(1) << 31) CHECK(bytes == most);
      else CHECK(bytes <= most);
    }
  }
  fkda_plan_destroy(plan);
}

TEST_CASE("empty tensors: their data, strides and alignment are not looked at", "[validation]") {
  Fixture f;
  fkda_fwd_args a = f.batched();
  for (fkda_tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.out}) *t = fkda_ref::tensor(t->data, FKDA_DTYPE_BF16, {kB, 0, kH, kD});
  a.beta = fkda_ref::tensor(f.beta.data(), FKDA_DTYPE_BF16, {kB, 0, kH});
  REQUIRE(a.out.strides[0] == 0);  // what row-major strides of an empty array look like
  a.out.strides[2] = 0;            // and a broadcast axis of extent 2
  a.q.strides[3] = 0;              // a last axis that is not contiguous
  a.k.data = nullptr;
  a.v.data = off_by_one_byte(a.v.data);
  set_strides(a.g, {-1, -1, -1, -1});
  REQUIRE(f.run(a) == FKDA_SUCCESS);
  CHECK(std::string(fkda_last_error()).empty());
  // Sequences without tokens carry their initial state over.
  CHECK(std::equal(f.initial_state.begin(), f.initial_state.begin() + kB * kH * kD * kD, f.final_state.begin()));
  CHECK(std::all_of(f.out.begin(), f.out.end(), [](uint16_t o) { return o == 0xFFFF; }));
}

TEST_CASE("an empty state pool: its strides are not looked at either", "[validation]") {
  Fixture f;
  fkda_fwd_args a = f.batched();
  for (fkda_tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.out}) *t = fkda_ref::tensor(t->data, FKDA_DTYPE_BF16, {0, kT, kH, kD});
  a.beta = fkda_ref::tensor(f.beta.data(), FKDA_DTYPE_BF16, {0, kT, kH});
  a.initial_state = a.final_state = FKDA_TENSOR_NONE;
  a.state_pool = fkda_ref::tensor(f.final_state.data(), FKDA_DTYPE_F32, {0, kH, kD, kD});
  set_strides(a.state_pool, {-kHuge, 0, -kHuge, 0});
  int64_t no_index = 0;
  a.state_indices = fkda_ref::tensor(&no_index, FKDA_DTYPE_I64, {0});
  const fkda_status status = f.run(a);
  INFO(fkda_last_error());
  CHECK(status == FKDA_SUCCESS);
}

TEST_CASE("strides of axes of extent 1 are not looked at", "[validation]") {
  Fixture f;
  fkda_fwd_args a = f.varlen();  // batch axis of extent 1
  REQUIRE(f.run(a) == FKDA_SUCCESS);
  const std::vector<uint16_t> expected = f.out;
  std::fill(f.out.begin(), f.out.end(), uint16_t(0xFFFF));
  a.q.strides[0] = -7;
  a.out.strides[0] = kHuge;
  a.beta.strides[0] = kMaxStride;
  REQUIRE(f.run(a) == FKDA_SUCCESS);
  CHECK(f.out == expected);
}

TEST_CASE("bad plan descriptions", "[validation]") {
  auto expect = [](std::function<void(fkda_plan_desc&)> change, fkda_status status, const std::string& start) {
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = 4;
    desc.backend = FKDA_BACKEND_CPU;
    change(desc);
    fkda_plan_t plan = reinterpret_cast<fkda_plan_t>(uintptr_t(1));
    check_failure(fkda_plan_create(&desc, &plan), status, start);
    CHECK(plan == nullptr);
  };
  const fkda_status BAD = FKDA_ERROR_INVALID_ARGUMENT;
  expect([](fkda_plan_desc& d) { d.struct_size = 0; }, BAD, "desc: struct_size is 0");
  // Far past any header's struct: refused without reading a byte of it.
  expect([](fkda_plan_desc& d) { d.struct_size = size_t(1) << 20; }, BAD, "desc: struct_size is 1048576, not a size");
  expect([](fkda_plan_desc& d) { d.num_heads = 0; }, BAD, "desc.num_heads: must be > 0, got 0");
  expect([](fkda_plan_desc& d) { d.num_heads = -3; }, BAD, "desc.num_heads: must be > 0, got -3");
  expect([](fkda_plan_desc& d) { d.head_dim_k = 64; }, FKDA_ERROR_UNSUPPORTED, "desc.head_dim_k: only 128 is supported, got 64");
  expect([](fkda_plan_desc& d) { d.head_dim_v = 256; }, FKDA_ERROR_UNSUPPORTED, "desc.head_dim_v: only 128 is supported, got 256");
  expect([](fkda_plan_desc& d) { d.state_dtype = FKDA_DTYPE_F16; }, BAD, "desc.state_dtype: expected bf16 or f32, got f16");
  expect([](fkda_plan_desc& d) { d.state_layout = 7; }, BAD, "desc.state_layout:");
  expect([](fkda_plan_desc& d) { d.backend = 9; }, BAD, "desc.backend: expected FKDA_BACKEND_AUTO, _CPU or _GPU, got 9");
  expect([](fkda_plan_desc& d) { d.lower_bound = -6.f; }, BAD, "desc.lower_bound: -6");
  expect([](fkda_plan_desc& d) { d.lower_bound = kNaN; }, BAD, "desc.lower_bound: must be a finite number");
  const std::string gate_modes = "desc.gate_mode: expected FKDA_GATE_BOUNDED (0), _SOFTPLUS (1) or _LOG_DECAY (2), got ";
  expect([](fkda_plan_desc& d) { d.gate_mode = 3; }, BAD, gate_modes + "3");
  expect([](fkda_plan_desc& d) { d.gate_mode = -1; }, BAD, gate_modes + "-1");
  const std::string beta_modes = "desc.beta_mode: expected FKDA_BETA_LOGITS (0) or FKDA_BETA_PROBABILITIES (1), got ";
  expect([](fkda_plan_desc& d) { d.beta_mode = 2; }, BAD, beta_modes + "2");
  expect([](fkda_plan_desc& d) { d.beta_mode = int32_t(0x80000000u); }, BAD, beta_modes + "-2147483648");
  // lower_bound belongs to the bounded gate: the others need its _INIT value.
  expect([](fkda_plan_desc& d) { d.gate_mode = FKDA_GATE_SOFTPLUS; d.lower_bound = -4.f; }, BAD,
         "desc.lower_bound: set to -4.000000, but the softplus gate has no floor");
  expect([](fkda_plan_desc& d) { d.gate_mode = FKDA_GATE_LOG_DECAY; d.lower_bound = 0.f; }, BAD,
         "desc.lower_bound: set to 0.000000, but the log-decay gate has no floor");
  expect([](fkda_plan_desc& d) { d.gate_mode = FKDA_GATE_SOFTPLUS; d.lower_bound = kNaN; }, BAD, "desc.lower_bound: set to");
}

TEST_CASE("gate and beta modes: the inputs each plan takes, and the combinations it rejects by name", "[validation][gate]") {
  SECTION("bounded: A_log and dt_bias optional, g bf16 only") {
    Fixture f;
    fkda_fwd_args a = f.batched();
    a.A_log = FKDA_TENSOR_NONE;
    FKDA_REQUIRE(f.run(a));
    a.dt_bias = FKDA_TENSOR_NONE;
    FKDA_REQUIRE(f.run(a));
    a.beta = f.beta_as_f32();
    FKDA_REQUIRE(f.run(a));
    a.g = f.g_as_f32();
    f.check_rejected(a, "g: expected dtype bf16 (the plan's gate is bounded; f32 g is taken with the log-decay gate only), got f32");
  }
  SECTION("softplus: A_log required, dt_bias optional, g bf16 only") {
    Fixture f(FKDA_GATE_SOFTPLUS);
    fkda_fwd_args a = f.batched();
    FKDA_REQUIRE(f.run(a));
    a.dt_bias = FKDA_TENSOR_NONE;
    FKDA_REQUIRE(f.run(a));
    a.A_log = FKDA_TENSOR_NONE;
    f.check_rejected(a, "A_log: required tensor is missing (data NULL, rank 0): the plan's gate is softplus");
    a = f.batched();
    a.g = f.g_as_f32();
    f.check_rejected(a, "g: expected dtype bf16 (the plan's gate is softplus; f32 g is taken with the log-decay gate only), got f32");
    a = f.batched();
    a.A_log.dtype = FKDA_DTYPE_BF16;
    f.check_rejected(a, "A_log: expected dtype f32, got bf16");
  }
  SECTION("log-decay: g bf16 or f32, A_log and dt_bias absent") {
    Fixture f(FKDA_GATE_LOG_DECAY);
    fkda_fwd_args a = f.batched();
    a.A_log = a.dt_bias = FKDA_TENSOR_NONE;
    FKDA_REQUIRE(f.run(a));
    a.g = f.g_as_f32();
    FKDA_REQUIRE(f.run(a));
    a.g.dtype = FKDA_DTYPE_F16;
    f.check_rejected(a, "g: expected dtype bf16 or f32, got f16");
    a = f.batched();
    a.dt_bias = FKDA_TENSOR_NONE;
    f.check_rejected(a, "A_log: must be absent: the plan's gate is log-decay, g is the log-decay itself");
    a = f.batched();
    a.A_log = FKDA_TENSOR_NONE;
    f.check_rejected(a, "dt_bias: must be absent: the plan's gate is log-decay, g is the log-decay itself");
  }
  SECTION("probabilities: beta bf16 or f32") {
    Fixture f(FKDA_GATE_BOUNDED, FKDA_BETA_PROBABILITIES);
    fkda_fwd_args a = f.batched();
    FKDA_REQUIRE(f.run(a));
    a.beta = f.beta_as_f32();
    FKDA_REQUIRE(f.run(a));
    a.beta.dtype = FKDA_DTYPE_I32;
    f.check_rejected(a, "beta: expected dtype bf16 or f32, got i32");
  }
  SECTION("the gate floor calls refuse plans without a floor") {
    for (int32_t gate_mode : {FKDA_GATE_SOFTPLUS, FKDA_GATE_LOG_DECAY}) {
      Fixture f(gate_mode);
      float lower = 1.f;
      const std::string why = "plan: lower_bound belongs to the bounded gate; this plan's gate is ";
      const std::string name = gate_mode == FKDA_GATE_SOFTPLUS ? "softplus" : "log-decay";
      check_failure(fkda_set_lower_bound(f.plan, -1.f), FKDA_ERROR_INVALID_ARGUMENT, why + name + ", which has no floor");
      check_failure(fkda_get_lower_bound(f.plan, &lower), FKDA_ERROR_INVALID_ARGUMENT, why + name);
      CHECK(lower == 1.f);
    }
  }
}

TEST_CASE("bad device queries", "[validation]") {
  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  check_failure(fkda_query_device(-1, nullptr), FKDA_ERROR_INVALID_ARGUMENT, "info: NULL");
  info.struct_size = 8;
  check_failure(fkda_query_device(-1, &info), FKDA_ERROR_INVALID_ARGUMENT, "info: struct_size is 8");
  info.struct_size = sizeof info;
  check_failure(fkda_query_device(-2, &info), FKDA_ERROR_INVALID_ARGUMENT, "device: expected an ordinal >= 0 or -1");
}

TEST_CASE("the last error is per thread and cleared by a successful call", "[validation]") {
  REQUIRE(fkda_set_lower_bound(nullptr, -1.f) == FKDA_ERROR_INVALID_ARGUMENT);
  std::string here = fkda_last_error();
  CHECK(here == "plan: NULL");
  std::string there = "untouched";
  std::thread([&] { there = fkda_last_error(); }).join();
  CHECK(there.empty());
  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  REQUIRE(fkda_query_device(-1, &info) == FKDA_SUCCESS);
  CHECK(std::string(fkda_last_error()).empty());
}
