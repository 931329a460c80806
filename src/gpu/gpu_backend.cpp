// The CUDA backend's host side: the embedded fatbin is loaded once per
// process through the driver (no cudart), kernels are fetched by name for the
// current context and launched on the caller's stream. The launch path
// allocates nothing, never synchronises and never changes the current
// context, so a call can be captured in a CUDA graph.
#include "gpu/gpu_backend.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>

#include "gpu/cuda_driver.h"
#include "error.h"
#include "prefill_params.h"

extern "C" {
// The fatbin's bytes, placed in .rodata by cmake/embed_fatbin.S.in.
extern const unsigned char flashkda_embedded_fatbin[];
extern const unsigned char flashkda_embedded_fatbin_end[];
}

namespace fkda::gpu {
namespace {

constexpr const char* kPrepareKernel = "fkda_prefill_prepare_chunks";
// One recurrence kernel per V split (1, 2, 4, 8), indexed by log2(vsplit).
constexpr int kVsplitCount = 4;
constexpr int kMaxVsplit = 8;
constexpr const char* kRecurrenceKernels[kVsplitCount] = {
    "fkda_prefill_chunk_recurrence_v1", "fkda_prefill_chunk_recurrence_v2", "fkda_prefill_chunk_recurrence_v4",
    "fkda_prefill_chunk_recurrence_v8"};

int vsplit_index(int vsplit) { return vsplit == 1 ? 0 : vsplit == 2 ? 1 : vsplit == 4 ? 2 : 3; }

struct Kernels {
  CUkernel prepare = nullptr;
  CUkernel recurrence[kVsplitCount] = {};
};

Kernels load_kernels(const cuda::Driver& d) {
  CUlibrary library = nullptr;
  // Never unloaded: launches may still be in flight on any stream at exit.
  CUresult result = d.cuLibraryLoadData(&library, flashkda_embedded_fatbin, nullptr, nullptr, 0, nullptr,
                                        nullptr, 0);
  if (result != CUDA_SUCCESS) {
    fail(FKDA_ERROR_DRIVER, "cuLibraryLoadData (the embedded kernels) failed: " + cuda::describe(result));
  }
  Kernels kernels;
  auto get = [&](CUkernel* slot, const char* name) {
    CUresult found = d.cuLibraryGetKernel(slot, library, name);
    if (found != CUDA_SUCCESS) {
      fail(FKDA_ERROR_DRIVER, std::string("cuLibraryGetKernel(") + name + ") failed: " + cuda::describe(found));
    }
  };
  get(&kernels.prepare, kPrepareKernel);
  for (int i = 0; i < kVsplitCount; ++i) get(&kernels.recurrence[i], kRecurrenceKernels[i]);
  return kernels;
}

// Loaded on first use; a failed load throws and is tried again next call.
const Kernels& kernels(const cuda::Driver& d) {
  static const Kernels loaded = load_kernels(d);
  return loaded;
}

// What the launch code needs to know about a device, read once per device.
struct DeviceFacts {
  int cc_major = 0;
  int cc_minor = 0;
  int sm_count = 0;
  int max_dynamic_smem = 0;  // opt-in limit per block
};

int attribute(const cuda::Driver& d, CUdevice device, CUdevice_attribute which) {
  int value = 0;
  cuda::check(d.cuDeviceGetAttribute(&value, which, device), "cuDeviceGetAttribute");
  return value;
}

const DeviceFacts& device_facts(const cuda::Driver& d, CUdevice device, const Kernels& k) {
  static std::mutex mutex;
  // A deque: growing it leaves references to earlier entries valid.
  static std::deque<std::pair<CUdevice, DeviceFacts>> known;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& entry : known) {
    if (entry.first == device) return entry.second;
  }
  DeviceFacts facts;
  facts.cc_major = attribute(d, device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  facts.cc_minor = attribute(d, device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  if (!has_kernels_for(facts.cc_major, facts.cc_minor)) {
    fail(FKDA_ERROR_UNSUPPORTED_ARCH, unsupported_arch_message(facts.cc_major, facts.cc_minor));
  }
  facts.sm_count = attribute(d, device, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  facts.max_dynamic_smem = attribute(d, device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  // The recurrence kernels need more than the default 48 KB of shared
  // memory; raise the limit, once, for each one this device can hold.
  if (fkda_recurrence_smem_bytes(kMaxVsplit) > facts.max_dynamic_smem) {
    fail(FKDA_ERROR_UNSUPPORTED_ARCH, "device allows " + std::to_string(facts.max_dynamic_smem) +
                                          " bytes of shared memory per block; the recurrence kernel needs " +
                                          std::to_string(fkda_recurrence_smem_bytes(kMaxVsplit)));
  }
  for (int vsplit = 1; vsplit <= kMaxVsplit; vsplit *= 2) {
    const int bytes = fkda_recurrence_smem_bytes(vsplit);
    if (bytes > facts.max_dynamic_smem) continue;
    CUresult result = d.cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes,
                                             k.recurrence[vsplit_index(vsplit)], device);
    if (result != CUDA_SUCCESS) {
      fail(FKDA_ERROR_DRIVER, std::string("cuKernelSetAttribute(") + kRecurrenceKernels[vsplit_index(vsplit)] +
                                  ", max dynamic shared memory) failed: " + cuda::describe(result));
    }
  }
  known.emplace_back(device, facts);
  return known.back().second;
}

// FKDA_VSPLIT=1|2|4|8 forces the V split of the recurrence. A testing
// override, read once per process; anything else is ignored.
int forced_vsplit() {
  static const int forced = [] {
    const char* text = std::getenv("FKDA_VSPLIT");
    if (text == nullptr) return 0;
    const int value = std::atoi(text);
    return (value == 1 || value == 2 || value == 4 || value == 8) ? value : 0;
  }();
  return forced;
}

// FKDA_WINDOW_SLOTS=<positive integer> forces the slots per window (so that
// tests can put window boundaries anywhere). A testing override, read once
// per process; anything else is ignored.
int64_t forced_window_slots() {
  static const int64_t forced = [] {
    const char* text = std::getenv("FKDA_WINDOW_SLOTS");
    if (text == nullptr) return int64_t(0);
    const long long value = std::atoll(text);
    return value > 0 ? int64_t(value) : int64_t(0);
  }();
  return forced;
}

// The records of one window take at most kWindowBudgetBytes, unless the
// window must be larger to hold kWindowSlotsPerSequence slots for each
// sequence of the call. A quarter of a GB keeps docs/BENCHMARKS.md's P1 (8192
// tokens, 96 heads: 682 MB in one window) within its 340 MB workspace target
// in three windows, and smaller problems keep one window and their two
// launches. The floor per sequence is there because a window's recurrence
// runs only the sequences whose slots the window holds: with many sequences
// the recurrence has more blocks than the GPU runs at once and packs them
// into rounds, and cutting it into windows of few chunks per sequence breaks
// that packing (docs/BENCHMARKS.md's P7 and P8, 6 and 8 sequences of 96 heads, would
// lose 10-30% of their recurrence time), while with windows of 160 slots
// (2560 tokens) per sequence or more only calls whose sequences average more
// than that are cut, into windows that each keep many chunks per block.
constexpr int64_t kWindowBudgetBytes = int64_t(256) << 20;
constexpr int64_t kWindowSlotsPerSequence = 160;

struct Windows {
  int64_t total_slots = 0;
  int64_t slots = 0;  // per window; the last one may have fewer
  int64_t count = 0;
};

// The windows of a call, from its sizes alone (the host never reads the
// offsets): as few windows as the budget allows, then equal slot counts, so
// that each launch pair has the same amount of work.
Windows windows_for(int64_t total_tokens, int64_t num_seqs, int32_t num_heads) {
  Windows w;
  w.total_slots = fkda_num_chunk_slots(total_tokens, num_seqs);
  int64_t slots = forced_window_slots();
  if (slots == 0) {
    const int64_t most = std::max(kWindowSlotsPerSequence * std::max<int64_t>(num_seqs, 1),
                                  kWindowBudgetBytes / (int64_t(num_heads) * FKDA_WS_RECORD_BYTES));
    const int64_t count = (w.total_slots + most - 1) / most;
    slots = (w.total_slots + count - 1) / count;
  }
  w.slots = std::min(slots, w.total_slots);
  w.count = (w.total_slots + w.slots - 1) / w.slots;
  return w;
}

// Enough blocks to fill the GPU: the largest power of two <= 8 with
// N * H * vsplit <= 2 * SMs, at least 1, and within the shared memory limit.
int choose_vsplit(int64_t seqs_times_heads, const DeviceFacts& facts) {
  int vsplit = forced_vsplit();
  if (vsplit == 0) {
    vsplit = kMaxVsplit;
    while (vsplit > 1 && seqs_times_heads * vsplit > 2 * int64_t(facts.sm_count)) vsplit /= 2;
  }
  while (vsplit < kMaxVsplit && fkda_recurrence_smem_bytes(vsplit) > facts.max_dynamic_smem) vsplit *= 2;
  return vsplit;
}

CUfunction function_for_context(const cuda::Driver& d, CUkernel kernel, const char* name,
                                const DeviceFacts& facts) {
  CUfunction function = nullptr;
  CUresult result = d.cuKernelGetFunction(&function, kernel);
  if (result == CUDA_ERROR_NO_BINARY_FOR_GPU || result == CUDA_ERROR_INVALID_PTX ||
      result == CUDA_ERROR_UNSUPPORTED_PTX_VERSION) {
    fail(FKDA_ERROR_UNSUPPORTED_ARCH, unsupported_arch_message(facts.cc_major, facts.cc_minor) + " (" +
                                          name + ": " + cuda::describe(result) + ")");
  }
  if (result != CUDA_SUCCESS) {
    fail(FKDA_ERROR_DRIVER, std::string("cuKernelGetFunction(") + name + ") failed: " + cuda::describe(result));
  }
  return function;
}

void launch(const cuda::Driver& d, CUfunction function, const char* name, unsigned grid_x, unsigned grid_y,
            unsigned grid_z, unsigned threads, unsigned smem, CUstream stream, FkdaPrefillParams& params) {
  void* args[] = {&params};
  CUresult result = d.cuLaunchKernel(function, grid_x, grid_y, grid_z, threads, 1, 1, smem, stream, args, nullptr);
  if (result != CUDA_SUCCESS) {
    fail(FKDA_ERROR_LAUNCH_FAILED, std::string("launch of ") + name + " failed: " + cuda::describe(result));
  }
}

FkdaActivation kernel_view(const ActView& view) {
  return FkdaActivation{view.data, view.stride_b, view.stride_t, view.stride_h};
}

}  // namespace

// The workspace: one window's records, then a carry matrix per head for
// each boundary between windows (prefill_params.h).
size_t workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads) {
  if (total_tokens < 0 || num_seqs < 0 || num_heads <= 0) return 0;
  // Each term below at most half the range, so neither they nor their sum overflow.
  const int64_t limit = std::numeric_limits<int64_t>::max() / 2;
  const int64_t per_slot = int64_t(num_heads) * FKDA_WS_RECORD_BYTES;
  const int64_t per_boundary = int64_t(num_heads) * FKDA_CARRY_BYTES_PER_HEAD;
  const Windows w =
      num_seqs < limit ? windows_for(total_tokens, num_seqs, num_heads) : Windows{limit, limit, limit};
  if (w.slots > limit / per_slot || w.count - 1 > limit / per_boundary) {
    fail(FKDA_ERROR_UNSUPPORTED, "workspace for " + std::to_string(total_tokens) + " tokens and " +
                                     std::to_string(num_heads) + " heads exceeds the address space");
  }
  return size_t(w.slots * per_slot + (w.count - 1) * per_boundary);
}

// sm_80 machine code runs on every 8.x device, sm_90a on 9.0, and the
// compute_90 PTX is compiled by the driver for anything newer.
bool has_kernels_for(int cc_major, int /*cc_minor*/) { return cc_major >= 8; }

std::string unsupported_arch_message(int cc_major, int cc_minor) {
  return "compute capability " + std::to_string(cc_major) + "." + std::to_string(cc_minor) +
         ": this build has kernels for the sm_80 family and sm_90 (and later, through PTX)";
}

void fwd(const PrefillProblem& problem, void* workspace, size_t /*workspace_bytes*/, CUstream stream) {
  const CUdevice device = cuda::current_device();  // throws FKDA_ERROR_NO_DEVICE without a context
  const cuda::Driver& d = *cuda::driver();
  const Kernels& k = kernels(d);
  const DeviceFacts& facts = device_facts(d, device, k);

  const int64_t total_tokens = problem.batch * problem.seq_len;
  const Windows windows = windows_for(total_tokens, problem.num_seqs, problem.num_heads);
  const int64_t max_grid_x = std::numeric_limits<int32_t>::max();
  if (problem.num_heads > 65535 || windows.slots > max_grid_x || problem.num_seqs > max_grid_x) {
    fail(FKDA_ERROR_UNSUPPORTED, "problem too large for one launch: " + std::to_string(problem.num_seqs) +
                                     " sequences, " + std::to_string(total_tokens) + " tokens, " +
                                     std::to_string(problem.num_heads) + " heads");
  }

  FkdaPrefillParams params;
  std::memset(&params, 0, sizeof(params));
  params.q = kernel_view(problem.q);
  params.k = kernel_view(problem.k);
  params.v = kernel_view(problem.v);
  params.g = kernel_view(problem.g);
  params.beta = kernel_view(problem.beta);
  params.out = FkdaOutput{const_cast<void*>(problem.out.data), problem.out.stride_b, problem.out.stride_t,
                          problem.out.stride_h};
  params.A_log = problem.A_log;
  params.dt_bias = problem.dt_bias;
  params.initial_state = problem.initial_state;
  params.final_state = problem.final_state;
  params.state_is_bf16 = problem.state_dtype == FKDA_DTYPE_BF16;
  params.state_is_kv = problem.state_layout == FKDA_STATE_LAYOUT_KV;
  params.cu_seqlens = problem.cu_seqlens.data;
  params.cu_seqlens_stride = problem.cu_seqlens.stride;
  params.cu_seqlens_is_i64 = problem.cu_seqlens.dtype == FKDA_DTYPE_I64;
  params.num_heads = problem.num_heads;
  params.seq_len = problem.seq_len;
  params.num_seqs = problem.num_seqs;
  params.workspace = static_cast<unsigned char*>(workspace);
  params.num_slots = windows.total_slots;
  params.scale = problem.scale;
  params.gate_scale = problem.lower_bound * FKDA_LOG2E;  // NUMERICS step 1, in f32
  params.vsplit = choose_vsplit(problem.num_seqs * problem.num_heads, facts);

  const unsigned heads = unsigned(problem.num_heads);
  CUfunction prepare = function_for_context(d, k.prepare, kPrepareKernel, facts);
  const char* recurrence_name = kRecurrenceKernels[vsplit_index(params.vsplit)];
  CUfunction recurrence =
      function_for_context(d, k.recurrence[vsplit_index(params.vsplit)], recurrence_name, facts);
  // The carries follow the window's records (a multiple of 16 bytes).
  float* carry = reinterpret_cast<float*>(params.workspace + windows.slots * int64_t(problem.num_heads) *
                                                                 FKDA_WS_RECORD_BYTES);
  const int64_t carry_step = int64_t(problem.num_heads) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM);
  // Each window's preparation overwrites the records the previous window's
  // recurrence read: the stream orders them.
  for (int64_t w = 0; w < windows.count; ++w) {
    params.window_first = w * windows.slots;
    params.window_end = std::min(params.window_first + windows.slots, windows.total_slots);
    params.carry_in = w > 0 ? carry + (w - 1) * carry_step : nullptr;
    params.carry_out = w + 1 < windows.count ? carry + w * carry_step : nullptr;
    if (total_tokens > 0) {
      launch(d, prepare, kPrepareKernel, unsigned(params.window_end - params.window_first), heads, 1,
             FKDA_PREPARE_THREADS, 0, stream, params);
    }
    // Launched even without tokens: zero-length sequences still copy their
    // initial state (or zeros) to the final state.
    launch(d, recurrence, recurrence_name, unsigned(problem.num_seqs), heads, unsigned(params.vsplit),
           unsigned(32 * fkda_recurrence_warps(params.vsplit)),
           unsigned(fkda_recurrence_smem_bytes(params.vsplit)), stream, params);
  }
}

}  // namespace fkda::gpu
