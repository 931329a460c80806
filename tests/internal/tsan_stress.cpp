// SPDX-License-Identifier: MIT
// Eight threads on the CPU backend for a bounded time, built with the
// library's sources under ThreadSanitizer: each creates, uses and destroys
// plans of its own and shares a few with the others, which replace and
// destroy them while calls on them run. Every call must succeed, or fail
// on a destroyed shared plan with the message that says so; every output
// must equal the single-threaded one. Then the contract of destroying a plan
// during a call (flashkda.h, "Plans"): destroy returns at once, the call
// finishes with its result, later calls on the handle fail.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flashkda.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kThreads = 8;
constexpr int kShared = 3;
constexpr int64_t kHeads = 2, kDim = 128;

std::mutex report_mutex;
std::atomic<int> failures{0};

void fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(report_mutex);
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  ++failures;
}

fkda_tensor packed(void* data, int32_t dtype, std::vector<int64_t> shape) {
  fkda_tensor t = FKDA_TENSOR_NONE;
  t.data = data;
  t.dtype = dtype;
  t.rank = int32_t(shape.size());
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[size_t(i)];
    t.strides[i] = stride;
    stride *= shape[size_t(i)];
  }
  return t;
}

uint16_t bf16(float x) {
  uint32_t bits = 0;
  std::memcpy(&bits, &x, 4);
  return uint16_t(bits >> 16);
}

// One thread's inputs and outputs for a forward call of T tokens and a
// decode step of one token on a pool of two slots.
struct Buffers {
  int64_t T;
  std::vector<uint16_t> q, k, v, g, out, beta, decode_out;
  std::vector<float> final_state, pool, workspace;
  int32_t index = 1;

  Buffers(int64_t tokens, uint32_t seed) : T(tokens) {
    std::mt19937 random(seed);
    std::normal_distribution<float> normal;
    const size_t act = size_t(T * kHeads * kDim);
    for (auto* x : {&q, &k, &v, &g}) {
      x->resize(act);
      for (uint16_t& e : *x) e = bf16(normal(random));
    }
    out.assign(act, 0);
    beta.resize(size_t(T * kHeads));
    for (uint16_t& e : beta) e = bf16(normal(random));
    decode_out.assign(size_t(kHeads * kDim), 0);
    final_state.assign(size_t(kHeads * kDim * kDim), 0.f);
    pool.assign(size_t(2 * kHeads * kDim * kDim), 0.25f);
  }

  fkda_fwd_args fwd_args() {
    fkda_fwd_args a = FKDA_FWD_ARGS_INIT;
    a.q = packed(q.data(), FKDA_DTYPE_BF16, {1, T, kHeads, kDim});
    a.k = packed(k.data(), FKDA_DTYPE_BF16, {1, T, kHeads, kDim});
    a.v = packed(v.data(), FKDA_DTYPE_BF16, {1, T, kHeads, kDim});
    a.g = packed(g.data(), FKDA_DTYPE_BF16, {1, T, kHeads, kDim});
    a.out = packed(out.data(), FKDA_DTYPE_BF16, {1, T, kHeads, kDim});
    a.beta = packed(beta.data(), FKDA_DTYPE_BF16, {1, T, kHeads});
    a.final_state = packed(final_state.data(), FKDA_DTYPE_F32, {1, kHeads, kDim, kDim});
    return a;
  }

  fkda_decode_args decode_args() {
    fkda_decode_args a = FKDA_DECODE_ARGS_INIT;
    a.q = packed(q.data(), FKDA_DTYPE_BF16, {1, 1, kHeads, kDim});
    a.k = packed(k.data(), FKDA_DTYPE_BF16, {1, 1, kHeads, kDim});
    a.v = packed(v.data(), FKDA_DTYPE_BF16, {1, 1, kHeads, kDim});
    a.g = packed(g.data(), FKDA_DTYPE_BF16, {1, 1, kHeads, kDim});
    a.beta = packed(beta.data(), FKDA_DTYPE_BF16, {1, 1, kHeads});
    a.out = packed(decode_out.data(), FKDA_DTYPE_BF16, {1, 1, kHeads, kDim});
    a.state_pool = packed(pool.data(), FKDA_DTYPE_F32, {2, kHeads, kDim, kDim});
    a.state_indices = packed(&index, FKDA_DTYPE_I32, {1});
    return a;
  }

  fkda_status fwd(fkda_plan_t plan) {
    size_t bytes = 0;
    fkda_status status = fkda_plan_workspace_size(plan, T, 1, &bytes);
    if (status != FKDA_SUCCESS) return status;
    if (workspace.size() < bytes / sizeof(float) + 4) workspace.resize(bytes / sizeof(float) + 4);
    const fkda_fwd_args args = fwd_args();
    return fkda_fwd(plan, &args, workspace.data(), bytes, nullptr);
  }

  fkda_status decode(fkda_plan_t plan) {
    size_t bytes = 0;
    fkda_status status = fkda_plan_decode_workspace_size(plan, 1, 1, &bytes);
    if (status != FKDA_SUCCESS) return status;
    const fkda_decode_args args = decode_args();
    return fkda_decode(plan, &args, nullptr, 0, nullptr);
  }
};

fkda_plan_t create_plan() {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(kHeads);
  desc.backend = FKDA_BACKEND_CPU;
  fkda_plan_t plan = nullptr;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) fail(std::string("fkda_plan_create: ") + fkda_last_error());
  return plan;
}

// A call on a shared plan that another thread may have destroyed.
void expect_live_or_destroyed(fkda_status status, const char* call) {
  if (status == FKDA_SUCCESS) return;
  const std::string message = fkda_last_error();
  if (status == FKDA_ERROR_INVALID_ARGUMENT && message.rfind("plan: not a live plan", 0) == 0) return;
  fail(std::string(call) + " on a shared plan: status " + std::to_string(status) + ", \"" + message + "\"");
}

void expect_success(fkda_status status, const char* call) {
  if (status != FKDA_SUCCESS) fail(std::string(call) + ": " + fkda_last_error());
}

std::atomic<fkda_plan_t> shared_plans[kShared];

void worker(int id, Clock::time_point end, const std::vector<uint16_t>& expected_out) {
  std::mt19937 random(uint32_t(1000 + id));
  Buffers mine(16, 7);  // the inputs expected_out was computed from
  uint64_t calls = 0;
  while (Clock::now() < end) {
    // Computing calls are slow under the sanitizer: one draw in 16 each, so
    // that the cheap calls around them come by the hundred.
    const unsigned action = random() % 16;
    ++calls;
    if (action == 0) {  // a plan of its own, start to end
      fkda_plan_t plan = create_plan();
      std::fill(mine.out.begin(), mine.out.end(), 0);
      expect_success(mine.fwd(plan), "fkda_fwd on an own plan");
      if (mine.out != expected_out) fail("fkda_fwd on an own plan: output differs from the single-threaded run");
      expect_success(mine.decode(plan), "fkda_decode on an own plan");
      expect_success(fkda_set_lower_bound(plan, -1.0f - float(id) / 8.0f), "fkda_set_lower_bound");
      expect_success(fkda_plan_destroy(plan), "fkda_plan_destroy");
    } else if (action == 1) {  // replace a shared plan, destroying the old one under the others' calls
      fkda_plan_t old = shared_plans[random() % kShared].exchange(create_plan());
      expect_success(fkda_plan_destroy(old), "fkda_plan_destroy of a replaced shared plan");
    } else {
      fkda_plan_t plan = shared_plans[random() % kShared].load();
      switch (action) {
        case 2: {
          std::fill(mine.out.begin(), mine.out.end(), 0);
          const fkda_status status = mine.fwd(plan);
          expect_live_or_destroyed(status, "fkda_fwd");
          if (status == FKDA_SUCCESS && mine.out != expected_out) fail("fkda_fwd on a shared plan: output differs");
          break;
        }
        case 3: expect_live_or_destroyed(mine.decode(plan), "fkda_decode"); break;
        case 4:
        case 9:
        case 10:
        case 11: {
          size_t bytes = 0;
          expect_live_or_destroyed(fkda_plan_workspace_size(plan, 1 + id, 1, &bytes), "fkda_plan_workspace_size");
          fkda_backend backend = FKDA_BACKEND_AUTO;
          expect_live_or_destroyed(fkda_plan_get_backend(plan, &backend), "fkda_plan_get_backend");
          break;
        }
        case 5:
        case 6:
        case 7:
        case 8: {
          // The floor changes under the other threads' calls; -5 keeps their outputs.
          expect_live_or_destroyed(fkda_set_lower_bound(plan, -5.0f), "fkda_set_lower_bound");
          float bound = 0.f;
          expect_live_or_destroyed(fkda_get_lower_bound(plan, &bound), "fkda_get_lower_bound");
          fkda_launch_report report = FKDA_LAUNCH_REPORT_INIT;
          expect_live_or_destroyed(fkda_plan_get_launch_report(plan, &report), "fkda_plan_get_launch_report");
          break;
        }
        default: {
          // A failing call's message is this thread's alone.
          fkda_fwd_args args = mine.fwd_args();
          args.scale = 1.0f / 0.0f;
          const fkda_status status = fkda_fwd(plan, &args, nullptr, 0, nullptr);
          const std::string message = fkda_last_error();
          if (status == FKDA_SUCCESS || (message.rfind("scale: ", 0) != 0 &&
                                         message.rfind("plan: not a live plan", 0) != 0 &&
                                         message.rfind("workspace_bytes: ", 0) != 0)) {
            fail("a bad scale: status " + std::to_string(status) + ", \"" + message + "\"");
          }
          break;
        }
      }
    }
  }
  std::lock_guard<std::mutex> lock(report_mutex);
  std::printf("thread %d: %llu calls\n", id, static_cast<unsigned long long>(calls));
}

// Destroying a plan while a long fkda_fwd runs on it: tried until the
// destroy lands inside the call (timestamps say so).
void destroy_during_call() {
  Buffers long_call(512, 11);
  fkda_plan_t plan = create_plan();
  expect_success(long_call.fwd(plan), "fkda_fwd, reference run");
  const std::vector<uint16_t> expected = long_call.out;
  bool landed = false;
  int attempt = 0;
  for (; attempt < 20 && !landed; ++attempt) {
    if (attempt > 0) plan = create_plan();
    std::fill(long_call.out.begin(), long_call.out.end(), 0);
    std::atomic<bool> started{false};
    Clock::time_point call_end;
    fkda_status status = FKDA_ERROR_INTERNAL;
    std::thread call([&] {
      started = true;
      status = long_call.fwd(plan);
      call_end = Clock::now();
    });
    while (!started) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(1 + attempt));
    const Clock::time_point destroy_start = Clock::now();
    expect_success(fkda_plan_destroy(plan), "fkda_plan_destroy during a call");
    const Clock::time_point destroy_end = Clock::now();
    call.join();
    if (status != FKDA_SUCCESS) {
      // The destroy came first: the call found no plan, which is allowed.
      expect_live_or_destroyed(status, "fkda_fwd racing fkda_plan_destroy");
      continue;
    }
    if (long_call.out != expected) fail("fkda_fwd whose plan was destroyed during it: output differs");
    if (destroy_end < call_end) landed = true;  // destroy returned before the call did
    fkda_backend backend = FKDA_BACKEND_AUTO;
    if (fkda_plan_get_backend(plan, &backend) != FKDA_ERROR_INVALID_ARGUMENT ||
        std::string(fkda_last_error()).rfind("plan: not a live plan", 0) != 0) {
      fail("a call on a destroyed plan's handle must fail naming the plan");
    }
    (void)destroy_start;
  }
  if (!landed) fail("no destroy landed inside a running fkda_fwd in 20 attempts");
  std::printf("destroy during a call: landed at attempt %d\n", attempt);
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 3.0;
  for (auto& slot : shared_plans) slot = create_plan();
  // The single-threaded output every thread's fwd must reproduce.
  std::vector<uint16_t> expected_out;
  {
    Buffers reference(16, 7);
    fkda_plan_t plan = create_plan();
    expect_success(reference.fwd(plan), "fkda_fwd, reference run");
    fkda_plan_destroy(plan);
    expected_out = reference.out;
  }
  const Clock::time_point end =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  std::vector<std::thread> threads;
  for (int id = 0; id < kThreads; ++id) threads.emplace_back(worker, id, end, std::cref(expected_out));
  for (std::thread& t : threads) t.join();
  for (auto& slot : shared_plans) expect_success(fkda_plan_destroy(slot.load()), "fkda_plan_destroy at the end");
  destroy_during_call();
  if (failures != 0) {
    std::fprintf(stderr, "%d failure(s)\n", failures.load());
    return 1;
  }
  std::printf("tsan_stress: all checks passed\n");
  return 0;
}
