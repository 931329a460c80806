/* SPDX-License-Identifier: MIT */
// Timing of one prefill case on the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "bench_support.h"
#include "cases.h"

namespace fkda_bench {

struct TimingOptions {
  fkda_dtype state_dtype = FKDA_DTYPE_BF16;
  int warmup = 10;
  int iters = 100;
  float lower_bound = -5.f;  // bounded gate only
  int32_t gate_mode = FKDA_GATE_BOUNDED;
  uint64_t seed = 1;
};

struct CallTimes {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  // (last stop - first start) / iters. Above the median when the host cannot
  // queue calls as fast as the GPU runs them.
  double back_to_back_mean_ms = 0;
  // The timed calls captured into one CUDA graph, a replay's time / iters
  // (median of a few replays): the GPU's time per call without the host's
  // launch gaps, as a runtime that replays its decode step from a graph
  // sees it. NaN where the calls could not be captured.
  double graph_mean_ms = 0;
  // The host's time to issue one call (the calls alone, queued without
  // events, then one synchronisation): where it exceeds the GPU's time, the
  // events above time the host, not the kernels.
  double host_us_per_call = 0;
};

// Runs call(0 ... warmup - 1) untimed, then call(warmup ... warmup + iters - 1)
// each bracketed by CUDA events on `stream`, synchronising once at the end,
// then the same calls again as replays of a graph captured from `stream`,
// and once more timed on the host.
CallTimes time_calls(const std::function<void(int)>& call, const TimingOptions& options,
                     cudaStream_t stream);

// How many input sets of `set_bytes` to rotate over: enough to exceed the L2
// cache many times, as many as fit beside `fixed_bytes` in free device memory
// (at least one; a warning when fewer than wanted fit).
int choose_input_sets(size_t set_bytes, size_t fixed_bytes, const DeviceContext& device,
                      const std::string& id);

struct TimingResult : CallTimes {
  double bytes_moved = 0;
  double gbps = 0;  // bytes_moved / median
  size_t workspace_bytes = 0;
  int input_sets = 0;
  size_t input_set_bytes = 0;
  double setup_seconds = 0;  // host fill and upload of every input set
};

// Runs `c` with random inputs (never zeros) in several input sets whose total
// size is many times the L2 cache, rotating among them so that no call finds
// its inputs cached by the previous one. Each call is bracketed by CUDA
// events after the warm-up. Outputs are poisoned with NaN before the first
// call and checked afterwards, so a kernel that skips elements fails here.
TimingResult time_case(const BenchCase& c, const TimingOptions& options,
                       const DeviceContext& device);

}  // namespace fkda_bench
