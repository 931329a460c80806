// SPDX-License-Identifier: MIT
#include "gpu/cuda_driver.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "error.h"
#include "fkda_build_info.h"

namespace fkda::cuda {
namespace {

using GetProcAddress = CUresult (*)(const char*, void**, int, cuuint64_t,
                                    CUdriverProcAddressQueryResult*);

bool below_floor(int version) { return version != 0 && version < FKDA_BUILD_MIN_DRIVER_VERSION; }

struct Loaded {
  Driver driver;
  bool ok = false;
  int found_version = 0;
  std::string reason;
};

// Resolves `name` at the API version these prototypes were written for
// (CUDA 12.0), so a newer driver hands back the matching ABI.
template <typename Fn>
bool resolve(GetProcAddress get_proc, const char* name, Fn& slot, std::string& reason) {
  void* address = nullptr;
  CUdriverProcAddressQueryResult found{};
  CUresult result = get_proc(name, &address, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &found);
  if (result != CUDA_SUCCESS || address == nullptr || found != CU_GET_PROC_ADDRESS_SUCCESS) {
    reason = std::string("the CUDA driver lacks ") + name + " (driver too old?)";
    return false;
  }
  slot = reinterpret_cast<Fn>(address);
  return true;
}

Loaded load() {
  Loaded loaded;
  // Never dlclose'd: kernels and contexts may outlive any scope we could pick.
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    loaded.reason = std::string("libcuda.so.1 not found: ") + (why ? why : "dlopen failed");
    return loaded;
  }
  // Asked first and straight from the library: an old driver may lack the
  // entry points below, and its version is what the user needs to hear.
  auto get_version = reinterpret_cast<CUresult (*)(int*)>(dlsym(handle, "cuDriverGetVersion"));
  if (get_version == nullptr) {
    loaded.reason = "libcuda.so.1 has no cuDriverGetVersion (not a CUDA driver?)";
    return loaded;
  }
  if (get_version(&loaded.found_version) != CUDA_SUCCESS) loaded.found_version = 0;
  if (below_floor(loaded.found_version)) {
    loaded.reason = "the CUDA driver supports " + cuda_version_text(loaded.found_version) + ", but " +
                    kernels_need() + ": update the NVIDIA driver";
    return loaded;
  }
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(handle, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    loaded.reason = "libcuda.so.1 has no cuGetProcAddress_v2 (a CUDA 12 or newer driver is needed)";
    return loaded;
  }
  CUresult (*init)(unsigned int) = nullptr;
  Driver& d = loaded.driver;
  std::string& r = loaded.reason;
  bool ok = resolve(get_proc, "cuInit", init, r) &&
            resolve(get_proc, "cuGetErrorName", d.cuGetErrorName, r) &&
            resolve(get_proc, "cuGetErrorString", d.cuGetErrorString, r) &&
            resolve(get_proc, "cuDeviceGetCount", d.cuDeviceGetCount, r) &&
            resolve(get_proc, "cuDeviceGet", d.cuDeviceGet, r) &&
            resolve(get_proc, "cuDeviceGetAttribute", d.cuDeviceGetAttribute, r) &&
            resolve(get_proc, "cuDeviceGetName", d.cuDeviceGetName, r) &&
            resolve(get_proc, "cuCtxGetCurrent", d.cuCtxGetCurrent, r) &&
            resolve(get_proc, "cuCtxGetDevice", d.cuCtxGetDevice, r) &&
            resolve(get_proc, "cuPointerGetAttributes", d.cuPointerGetAttributes, r) &&
            resolve(get_proc, "cuLibraryLoadData", d.cuLibraryLoadData, r) &&
            resolve(get_proc, "cuLibraryGetKernel", d.cuLibraryGetKernel, r) &&
            resolve(get_proc, "cuKernelGetFunction", d.cuKernelGetFunction, r) &&
            resolve(get_proc, "cuKernelSetAttribute", d.cuKernelSetAttribute, r) &&
            resolve(get_proc, "cuLaunchKernel", d.cuLaunchKernel, r) &&
            resolve(get_proc, "cuLaunchKernelEx", d.cuLaunchKernelEx, r) &&
            resolve(get_proc, "cuKernelGetAttribute", d.cuKernelGetAttribute, r) &&
            resolve(get_proc, "cuStreamSynchronize", d.cuStreamSynchronize, r) &&
            resolve(get_proc, "cuMemcpyDtoH", d.cuMemcpyDtoH, r);
  if (!ok) return loaded;
  CUresult result = init(0);
  if (result != CUDA_SUCCESS) {
    const char* name = nullptr;
    d.cuGetErrorName(result, &name);
    loaded.reason = std::string("cuInit failed: ") + (name ? name : "unknown error") +
                    (result == CUDA_ERROR_NO_DEVICE ? " (no CUDA device)" : "");
    return loaded;
  }
  d.version = loaded.found_version;
  loaded.ok = true;
  return loaded;
}

// Set once loaded() has run: from then on asking the driver starts nothing.
std::atomic<bool> load_attempted{false};

const Loaded& loaded() {
  static const Loaded instance = load();  // thread-safe, once per process
  load_attempted.store(true, std::memory_order_release);
  return instance;
}

// Whether a libcuda.so.1 already in the process has been through cuInit:
// before it, every call but a few returns CUDA_ERROR_NOT_INITIALIZED, and no
// device memory can exist.
bool resident_and_initialised() {
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (handle == nullptr) return false;
  bool initialised = false;
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(handle, "cuGetProcAddress_v2"));
  CUresult (*device_count)(int*) = nullptr;
  std::string ignored;
  if (get_proc != nullptr && resolve(get_proc, "cuDeviceGetCount", device_count, ignored)) {
    int count = 0;
    initialised = device_count(&count) != CUDA_ERROR_NOT_INITIALIZED;
  }
  dlclose(handle);  // drops the reference RTLD_NOLOAD took; the library stays
  return initialised;
}

}  // namespace

const Driver* driver_if_started() {
  if (load_attempted.load(std::memory_order_acquire) || resident_and_initialised()) return driver();
  return nullptr;
}

const Driver* driver() {
  const Loaded& l = loaded();
  return l.ok ? &l.driver : nullptr;
}

const std::string& unavailable_reason() { return loaded().reason; }

int found_driver_version() { return loaded().found_version; }

bool driver_too_old() { return below_floor(loaded().found_version); }

std::string cuda_version_text(int version) {
  return "CUDA " + std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10) + " (" +
         std::to_string(version) + ")";
}

std::string kernels_need() {
  return "this build's kernels (compiled with " + cuda_version_text(FKDA_BUILD_CUDA_VERSION) + " for " +
         FKDA_BUILD_ARCHITECTURES + ") need a driver for " + cuda_version_text(FKDA_BUILD_MIN_DRIVER_VERSION) +
         " or newer";
}

std::string describe(CUresult result) {
  const Driver* d = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d != nullptr) {
    d->cuGetErrorName(result, &name);
    d->cuGetErrorString(result, &text);
  }
  std::string out = name ? name : ("CUresult " + std::to_string(static_cast<int>(result)));
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) fail(FKDA_ERROR_DRIVER, std::string(what) + " failed: " + describe(result));
}

CUresult current_or_first_device(const Driver& d, CUdevice* device) {
  CUcontext context = nullptr;
  if (d.cuCtxGetCurrent(&context) == CUDA_SUCCESS && context != nullptr &&
      d.cuCtxGetDevice(device) == CUDA_SUCCESS) {
    return CUDA_SUCCESS;
  }
  *device = 0;
  return d.cuDeviceGet(device, 0);
}

CUdevice current_device() {
  const Driver* d = driver();
  if (d == nullptr) fail(FKDA_ERROR_NO_DEVICE, "no usable CUDA driver: " + unavailable_reason());
  CUcontext context = nullptr;
  check(d->cuCtxGetCurrent(&context), "cuCtxGetCurrent");
  if (context == nullptr) {
    fail(FKDA_ERROR_NO_DEVICE,
         "no current CUDA context on this thread: make one current first "
         "(cudaSetDevice, torch.cuda.set_device or cuCtxSetCurrent)");
  }
  CUdevice device = 0;
  check(d->cuCtxGetDevice(&device), "cuCtxGetDevice");
  return device;
}

}  // namespace fkda::cuda
