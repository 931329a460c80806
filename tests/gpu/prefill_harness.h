/* SPDX-License-Identifier: MIT */
// The harness of the GPU prefill tests: a case (shape, state dtype and
// layout, memory arrangement, offsets, launch tuning), its tensors placed in
// poisoned arenas, one GPU run through the public API, and check_case, which
// runs a case on the GPU (twice, on two streams) and on the CPU backend and
// checks everything against the fp64 recurrence and the promised agreement.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"

namespace fkda_test {

using fkda_ref::DeviceBuffer;
using fkda_ref::launch_report;
using fkda_ref::Plan;
using fkda_ref::plan_desc;
using fkda_ref::Stream;
using fkda_ref::Problem;
using fkda_ref::ProblemShape;

constexpr uint16_t kPoisonBf16 = 0xFFFF;     // a NaN
constexpr unsigned char kPoisonByte = 0xFF;  // 0xFFFFFFFF is an f32 NaN, 0xFFFF a bf16 NaN

// GPU against the CPU backend, docs/NUMERICS.md: the same rounding contract,
// so only ulp-level differences (hardware exp2, summation order inside the
// mma) remain. With slow decays the state remembers those differences over
// the whole sequence instead of forgetting them within a few tokens, so
// they add up to more.
constexpr double kCpuAgreement = 6.0e-4;
constexpr double kCpuAgreementSlowDecay = 1.5e-3;
constexpr double kCpuAgreementSegments = 2.0e-3;
// How far a run from a damaged state must miss its target, so that the
// check it fails could not mistake the damage for rounding.
constexpr double kWideMargin = 10.0;

// Sets (value > 0) or clears (value == 0) an environment variable for the
// life of the object, or leaves it alone (value < 0), then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, int64_t value);
  // Sets the variable to `text`, or leaves it alone when text is NULL.
  ScopedEnv(const char* name, const char* text);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool touched_ = false;
  bool was_set_ = false;
  std::string old_value_;
};

// The launch tuning variables of flashkda.h for the life of the object:
// each < 0 leaves the environment's setting, 0 the automatic choice, > 0 forces.
// chunk_parallel: an fkda_chunk_parallel value, or < 0 to leave the environment's.
const char* chunk_parallel_text(int64_t chunk_parallel);
struct Tuning {
  ScopedEnv vsplit, window_slots, chunk_parallel, segment_chunks;
  Tuning(int64_t forced_vsplit, int64_t forced_window_slots, int64_t forced_chunk_parallel = -1,
         int64_t forced_segment_chunks = -1)
      : vsplit("FKDA_VSPLIT", forced_vsplit),
        window_slots("FKDA_WINDOW_SLOTS", forced_window_slots),
        chunk_parallel("FKDA_CHUNK_PARALLEL", chunk_parallel_text(forced_chunk_parallel)),
        segment_chunks("FKDA_SEGMENT_CHUNKS", forced_segment_chunks) {}
};

// How the activations sit in memory: packed; padded rows (gaps between
// heads, tokens and batch rows); or head-major ([B, H, T, D] memory viewed
// as [B, T, H, D]). Gaps stay poisoned: a read of one shows in the output,
// a write to one is caught by touched_gaps.
enum class Arrangement { kContiguous, kPadded, kHeadMajor };

struct Placement {
  int64_t B, T, H, D;  // D == 0: beta, [B, T, H] with no packed axis
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
  size_t elements = 0;

  Placement(Arrangement arrangement, int64_t b, int64_t t, int64_t h, int64_t d);
  size_t at(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return size_t(b * stride_b + t * stride_t + h * stride_h + d);
  }
  fkda_tensor view(void* data) const;
  // Contiguous [B, T, H, D] values into a poisoned arena of this placement.
  std::vector<uint16_t> place(const std::vector<uint16_t>& packed) const;
  std::vector<float> gather(const std::vector<uint16_t>& arena) const;
  // Elements outside the view that differ from the poison: writes out of bounds.
  size_t touched_gaps(const std::vector<uint16_t>& arena) const;
};

// States: f32 [N, H, V, K] (V-first) values to and from the plan's dtype and layout.
size_t state_bytes(int64_t elements, fkda_dtype dtype);
std::vector<unsigned char> encode_state(const std::vector<float>& vk, fkda_dtype dtype, fkda_state_layout layout);
std::vector<float> decode_state(const std::vector<unsigned char>& bytes, fkda_dtype dtype, fkda_state_layout layout);

// Gate logits raised far above 0 drive the sigmoid to exactly 1: every token
// decays by the full floor, so a chunk's key factors reach 2^±115
// (docs/NUMERICS.md step 3), near the end of bf16's range.
enum class Saturation { kNone, kEveryChunk, kEveryOtherChunk };

struct Case {
  std::string name;
  ProblemShape shape;
  bool slow = false;  // shape went through slow_decay(): the slow-decay targets apply
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
  Saturation saturation = Saturation::kNone;
  // Launch tuning (Tuning): < 0 the environment's, 0 automatic, > 0 forced.
  int64_t vsplit = -1;
  int64_t window_slots = -1;
  int64_t chunk_parallel = -1;  // an fkda_chunk_parallel value; < 0 the environment's
  int64_t segment_chunks = -1;
};

// The case cut into segments of `chunks` chunks (chunk-parallel, forced on).
Case in_segments(Case c, int64_t chunks);

Case batched(std::string name, int64_t B, int64_t T, int64_t H, uint64_t seed);
Case varlen(std::string name, std::vector<int64_t> lengths, int64_t H, uint64_t seed);
Case with_state(Case c, fkda_dtype dtype, fkda_state_layout layout, bool initial, bool final);
// The same case on slow-decay inputs.
Case slowly_decaying(Case c);
// The accuracy targets of a case's state dtype and inputs.
fkda_ref::AccuracyTargets targets_of(const Case& c);

// The problem of a case, with the initial state rounded to the state dtype
// so that the reference starts from exactly what the kernels read.
Problem problem_of(const Case& c);

// A problem's tensors as host arenas in the case's layouts. The same bytes
// go to the device for the GPU run and stay on the host for the CPU run.
struct Arenas {
  Placement act, beta;
  std::vector<uint16_t> q, k, v, g, b, out;
  std::vector<float> A_log, dt_bias;
  std::vector<unsigned char> initial, final, offsets;

  Arenas(const Problem& p, const Case& c);
};

struct Result {
  std::vector<uint16_t> out;
  std::vector<unsigned char> final;
  bool operator==(const Result& o) const { return out == o.out && final == o.final; }
};

// The device copies of a case's arenas, plus workspace, and one GPU run.
// Construct and run it under the case's Tuning: the workspace size follows it.
struct DeviceCase {
  const Problem& p;
  const Case& c;
  const Arenas& host;
  DeviceBuffer q, k, v, g, b, A_log, dt_bias, out, initial, final, offsets, workspace;
  Plan plan;
  fkda_fwd_args args;

  DeviceCase(const Problem& problem, const Case& a_case, const Arenas& arenas);
  // Outputs and workspace full of NaNs, so anything left unwritten shows.
  void poison();
  void run(cudaStream_t stream);
  Result fetch() const;
};

// Runs the case once directly, under its tuning, then captures one fkda_fwd
// in a CUDA graph and checks that each of two replays, outputs poisoned
// first, gives the direct run's bits. Returns the direct run's launch.
fkda_launch_report check_graph_replays(const Case& c);

// The CPU backend on the host arenas.
Result run_cpu(const Problem& p, const Case& c, const Arenas& arenas);

// Outputs of one GPU run as f32: out [B, T, H, V] packed, final state V-first.
struct Outputs {
  std::vector<float> out, state;
  fkda_launch_report launch;
};
Outputs run_gpu(const Problem& p, const Case& c);

struct Figures {
  double out_vs_ref = 0, state_vs_ref = 0, out_vs_cpu = 0, state_vs_cpu = 0;
};
struct Checked {
  Figures figures;
  Result result;  // of the GPU, in the case's arenas
  fkda_launch_report launch;
};

// Runs one case on the GPU (twice: a non-blocking stream, then the legacy
// default stream) and on the CPU backend, and checks everything: bitwise
// repeatable, every output written, nothing outside the views touched, the
// forced launch tuning reported back, the targets against the fp64
// recurrence and the agreement with the CPU backend.
Checked check_case(const Case& c);

}  // namespace fkda_test
