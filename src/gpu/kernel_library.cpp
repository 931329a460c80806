// SPDX-License-Identifier: MIT
// Loading of the embedded fatbin through the driver (no cudart), the device
// facts the launch code needs, and the launch call itself.
#include "gpu/kernel_library.h"

#include <algorithm>
#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "decode_params.h"
#include "error.h"
#include "gpu/gpu_backend.h"
#include "prefill_params.h"

extern "C" {
// The fatbin's bytes, placed in .rodata by cmake/embed_fatbin.S.in.
extern const unsigned char flashkda_embedded_fatbin[];
extern const unsigned char flashkda_embedded_fatbin_end[];
}

namespace fkda::gpu {
namespace {

// The driver refused the kernels' image: say which driver it is and what the
// image needs, since a driver error code alone tells users nothing.
[[noreturn]] void image_refused(const cuda::Driver& d, const std::string& what, CUresult result) {
  fail(result == CUDA_ERROR_NO_BINARY_FOR_GPU ? FKDA_ERROR_UNSUPPORTED_ARCH : FKDA_ERROR_DRIVER,
       what + " failed: " + cuda::describe(result) + "; the CUDA driver supports " +
           cuda::cuda_version_text(d.version) + " and " + cuda::kernels_need());
}

Kernels load_kernels(const cuda::Driver& d) {
  CUlibrary library = nullptr;
  // Never unloaded: launches may still be in flight on any stream at exit.
  CUresult result = d.cuLibraryLoadData(&library, flashkda_embedded_fatbin, nullptr, nullptr, 0, nullptr,
                                        nullptr, 0);
  if (result != CUDA_SUCCESS) image_refused(d, "cuLibraryLoadData (the embedded kernels)", result);
  Kernels kernels;
  auto get = [&](NamedKernel* slot, const char* name) {
    slot->name = name;
    CUresult found = d.cuLibraryGetKernel(&slot->kernel, library, name);
    if (found != CUDA_SUCCESS) {
      fail(FKDA_ERROR_DRIVER, std::string("cuLibraryGetKernel(") + name + ") failed: " + cuda::describe(found));
    }
  };
  get(&kernels.prepare[0], "fkda_prefill_prepare_chunks");
  get(&kernels.prepare[1], "fkda_prefill_prepare_chunks_conv");
  get(&kernels.prepare_softplus[0], "fkda_prefill_prepare_chunks_softplus");
  get(&kernels.prepare_softplus[1], "fkda_prefill_prepare_chunks_softplus_conv");
  get(&kernels.prepare_log_decay[0][0], "fkda_prefill_prepare_chunks_log_decay");
  get(&kernels.prepare_log_decay[0][1], "fkda_prefill_prepare_chunks_log_decay_conv");
  get(&kernels.prepare_log_decay[1][0], "fkda_prefill_prepare_chunks_log_decay_f32_gate");
  get(&kernels.prepare_log_decay[1][1], "fkda_prefill_prepare_chunks_log_decay_f32_gate_conv");
  const char* recurrence[kVsplitCount] = {"fkda_prefill_chunk_recurrence_v1", "fkda_prefill_chunk_recurrence_v2",
                                          "fkda_prefill_chunk_recurrence_v4", "fkda_prefill_chunk_recurrence_v8"};
  const char* recurrence_serving[kVsplitCount] = {
      "fkda_prefill_chunk_recurrence_serving_v1", "fkda_prefill_chunk_recurrence_serving_v2",
      "fkda_prefill_chunk_recurrence_serving_v4", "fkda_prefill_chunk_recurrence_serving_v8"};
  for (int i = 0; i < kVsplitCount; ++i) {
    get(&kernels.recurrence[i], recurrence[i]);
    get(&kernels.recurrence_serving[i], recurrence_serving[i]);
  }
  const char* segment_transitions[kSegmentVsplitCount] = {"fkda_prefill_segment_transitions_v1",
                                                          "fkda_prefill_segment_transitions_v2"};
  const char* segment_recurrence[kSegmentVsplitCount] = {"fkda_prefill_segment_recurrence_v1",
                                                         "fkda_prefill_segment_recurrence_v2"};
  for (int i = 0; i < kSegmentVsplitCount; ++i) {
    get(&kernels.segment_transitions[i], segment_transitions[i]);
    get(&kernels.segment_recurrence[i], segment_recurrence[i]);
  }
  get(&kernels.segment_scan, "fkda_prefill_segment_scan");
  get(&kernels.apply_transitions, "fkda_apply_transitions");
  get(&kernels.decode[decode_kernel_index(false, false)], "fkda_decode_f32_vk");
  get(&kernels.decode[decode_kernel_index(false, true)], "fkda_decode_f32_kv");
  get(&kernels.decode[decode_kernel_index(true, false)], "fkda_decode_bf16_vk");
  get(&kernels.decode[decode_kernel_index(true, true)], "fkda_decode_bf16_kv");
  get(&kernels.decode_layer[decode_kernel_index(false, false)], "fkda_decode_f32_vk_layer");
  get(&kernels.decode_layer[decode_kernel_index(false, true)], "fkda_decode_f32_kv_layer");
  get(&kernels.decode_layer[decode_kernel_index(true, false)], "fkda_decode_bf16_vk_layer");
  get(&kernels.decode_layer[decode_kernel_index(true, true)], "fkda_decode_bf16_kv_layer");
  get(&kernels.decode_streamed[0][0], "fkda_decode_streamed_f32");
  get(&kernels.decode_streamed[0][1], "fkda_decode_streamed_bf16");
  get(&kernels.decode_streamed[1][0], "fkda_decode_streamed_f32_layer");
  get(&kernels.decode_streamed[1][1], "fkda_decode_streamed_bf16_layer");
  get(&kernels.layer_pack_conv_weights, "fkda_layer_pack_conv_weights");
  get(&kernels.layer_convolve, "fkda_layer_convolve");
  get(&kernels.layer_conv_store, "fkda_layer_conv_store");
  get(&kernels.layer_gate, "fkda_layer_gate");
  return kernels;
}

// Loaded on first use; a failed load throws and is tried again next call.
const Kernels& kernels(const cuda::Driver& d) {
  static const Kernels loaded = load_kernels(d);
  return loaded;
}

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
  auto set_attribute = [&](const NamedKernel& kernel, CUfunction_attribute attribute, int value, const char* what) {
    CUresult result = d.cuKernelSetAttribute(attribute, value, kernel.kernel, device);
    if (result != CUDA_SUCCESS) {
      fail(FKDA_ERROR_DRIVER, std::string("cuKernelSetAttribute(") + kernel.name + ", " + what +
                                  ") failed: " + cuda::describe(result));
    }
  };
  auto allow_smem = [&](const NamedKernel& kernel, int bytes) {
    set_attribute(kernel, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes, "max dynamic shared memory");
  };
  // For kernels that stage streamed bytes in shared memory: left to choose,
  // the driver may split the multiprocessor's memory in favour of L1, which
  // their streaming accesses do not use.
  auto prefer_smem = [&](const NamedKernel& kernel) {
    set_attribute(kernel, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, CU_SHAREDMEM_CARVEOUT_MAX_SHARED,
                  "shared memory carveout");
  };
  for (int vsplit = 1; vsplit <= kMaxVsplit; vsplit *= 2) {
    const int bytes = fkda_recurrence_smem_bytes(vsplit);
    if (bytes > facts.max_dynamic_smem) continue;
    const int at = vsplit_index(vsplit);
    allow_smem(k.recurrence[at], bytes);
    allow_smem(k.recurrence_serving[at], bytes);
    if (vsplit <= kSegmentVsplitCount) {
      allow_smem(k.segment_transitions[vsplit - 1], bytes);
      allow_smem(k.segment_recurrence[vsplit - 1], bytes);
    }
  }
  // The virtual architecture the device's code was compiled for (80, 90,
  // ...), what the kernels' source could use whatever the device; every
  // kernel comes from the one embedded image, so one answers for all.
  int code_arch = 0;
  const CUresult arch_result = d.cuKernelGetAttribute(&code_arch, CU_FUNC_ATTRIBUTE_PTX_VERSION,
                                                      k.decode_layer[0].kernel, device);
  if (arch_result != CUDA_SUCCESS) {
    fail(FKDA_ERROR_DRIVER, std::string("cuKernelGetAttribute(") + k.decode_layer[0].name +
                                ", PTX version) failed: " + cuda::describe(arch_result));
  }
  facts.runs_sm90_code = code_arch >= 90;
  // The decode's layer kernels, at their most (16 tokens): above the default
  // 48 KB. In clusters, blocks of FKDA_DECODE_MAX_WARPS warps that also
  // stage an f32 pool's state; else a block of FKDA_DECODE_LAYER_WARPS per
  // head, its rows in registers.
  const int decode_layer_bytes =
      facts.runs_sm90_code
          ? fkda_decode_layer_smem_bytes(FKDA_DECODE_MAX_TOKENS, FKDA_DECODE_MAX_WARPS) +
                fkda_decode_staged_state_bytes(FKDA_DECODE_MAX_WARPS, 0)
          : fkda_decode_layer_smem_bytes(FKDA_DECODE_MAX_TOKENS, FKDA_DECODE_LAYER_WARPS);
  if (decode_layer_bytes > facts.max_dynamic_smem) {
    fail(FKDA_ERROR_UNSUPPORTED_ARCH, "device allows " + std::to_string(facts.max_dynamic_smem) +
                                          " bytes of shared memory per block; the decode's layer step needs " +
                                          std::to_string(decode_layer_bytes));
  }
  // In clusters the layer kernels stage their state in shared memory to
  // keep more blocks, and their bytes, in flight.
  for (const NamedKernel& kernel : k.decode_layer) {
    allow_smem(kernel, decode_layer_bytes);
    if (facts.runs_sm90_code) prefer_smem(kernel);
  }
  // The streamed decode: as many stages as fit (gpu_decode.cpp).
  facts.smem_per_multiprocessor = attribute(d, device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
  if (facts.runs_sm90_code) {
    for (const auto& form : k.decode_streamed) {
      for (const NamedKernel& kernel : form) {
        allow_smem(kernel, facts.max_dynamic_smem);
        prefer_smem(kernel);
      }
    }
  }
  // Devices with less shared memory than the scan needs run prefill serially
  // (chunk_parallel_possible below).
  facts.segment_scan_fits = FKDA_SCAN_SMEM_BYTES <= facts.max_dynamic_smem &&
                            fkda_recurrence_smem_bytes(kSegmentVsplitCount) <= facts.max_dynamic_smem;
  if (facts.segment_scan_fits) {
    allow_smem(k.segment_scan, FKDA_SCAN_SMEM_BYTES);
    allow_smem(k.apply_transitions, FKDA_APPLY_SMEM_BYTES);
  }
  known.emplace_back(device, facts);
  return known.back().second;
}

}  // namespace

LaunchContext launch_context() {
  const CUdevice device = cuda::current_device();  // throws FKDA_ERROR_NO_DEVICE without a context
  const cuda::Driver& d = *cuda::driver();
  const Kernels& k = kernels(d);
  return LaunchContext{d, k, device_facts(d, device, k)};
}

CUfunction function_for_context(const LaunchContext& context, const NamedKernel& kernel) {
  CUfunction function = nullptr;
  CUresult result = context.driver.cuKernelGetFunction(&function, kernel.kernel);
  if (result == CUDA_ERROR_NO_BINARY_FOR_GPU || result == CUDA_ERROR_INVALID_PTX ||
      result == CUDA_ERROR_UNSUPPORTED_PTX_VERSION || result == CUDA_ERROR_INVALID_IMAGE) {
    image_refused(context.driver,
                  std::string("cuKernelGetFunction(") + kernel.name + ") on compute capability " +
                      std::to_string(context.facts.cc_major) + "." + std::to_string(context.facts.cc_minor),
                  result);
  }
  if (result != CUDA_SUCCESS) {
    fail(FKDA_ERROR_DRIVER,
         std::string("cuKernelGetFunction(") + kernel.name + ") failed: " + cuda::describe(result));
  }
  return function;
}

ResolvedKernel resolve(const LaunchContext& context, const NamedKernel& kernel) {
  return ResolvedKernel{function_for_context(context, kernel), kernel.name};
}

void launch(const LaunchContext& context, const ResolvedKernel& kernel, unsigned grid_x, unsigned grid_y,
            unsigned grid_z, unsigned threads, unsigned smem, CUstream stream, void* params) {
  void* args[] = {params};
  CUresult result = context.driver.cuLaunchKernel(kernel.function, grid_x, grid_y, grid_z, threads, 1, 1, smem,
                                                  stream, args, nullptr);
  if (result != CUDA_SUCCESS) {
    fail(FKDA_ERROR_LAUNCH_FAILED, std::string("launch of ") + kernel.name + " failed: " + cuda::describe(result));
  }
}

void launch(const LaunchContext& context, const NamedKernel& kernel, unsigned grid_x, unsigned grid_y,
            unsigned grid_z, unsigned threads, unsigned smem, CUstream stream, void* params) {
  launch(context, resolve(context, kernel), grid_x, grid_y, grid_z, threads, smem, stream, params);
}

namespace {

// One launch through cuLaunchKernelEx with one attribute; `how` names it in
// the message of a refused launch.
void launch_with(const LaunchContext& context, const ResolvedKernel& kernel, const CUlaunchAttribute& attribute,
                 unsigned grid_x, unsigned grid_y, unsigned threads, unsigned smem, CUstream stream, void* params,
                 const std::string& how) {
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof(config));
  config.gridDimX = grid_x;
  config.gridDimY = grid_y;
  config.gridDimZ = 1;
  config.blockDimX = threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = smem;
  config.hStream = stream;
  CUlaunchAttribute attributes[] = {attribute};
  config.attrs = attributes;
  config.numAttrs = 1;
  void* args[] = {params};
  CUresult result = context.driver.cuLaunchKernelEx(&config, kernel.function, args, nullptr);
  if (result != CUDA_SUCCESS) {
    fail(FKDA_ERROR_LAUNCH_FAILED,
         std::string("launch of ") + kernel.name + how + " failed: " + cuda::describe(result));
  }
}

}  // namespace

void launch_dependent(const LaunchContext& context, const ResolvedKernel& kernel, unsigned grid_x, unsigned grid_y,
                      unsigned threads, unsigned smem, CUstream stream, void* params) {
  if (context.facts.cc_major < 9) {
    launch(context, kernel, grid_x, grid_y, 1, threads, smem, stream, params);
    return;
  }
  CUlaunchAttribute early;
  std::memset(&early, 0, sizeof(early));
  early.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  early.value.programmaticStreamSerializationAllowed = 1;
  launch_with(context, kernel, early, grid_x, grid_y, threads, smem, stream, params,
              " as a programmatic dependent");
}

void launch_clusters(const LaunchContext& context, const ResolvedKernel& kernel, unsigned cluster_x, unsigned grid_x,
                     unsigned grid_y, unsigned threads, unsigned smem, CUstream stream, void* params) {
  CUlaunchAttribute cluster;
  std::memset(&cluster, 0, sizeof(cluster));
  cluster.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  cluster.value.clusterDim.x = cluster_x;
  cluster.value.clusterDim.y = 1;
  cluster.value.clusterDim.z = 1;
  launch_with(context, kernel, cluster, grid_x, grid_y, threads, smem, stream, params,
              " in clusters of " + std::to_string(cluster_x));
}

}  // namespace fkda::gpu
