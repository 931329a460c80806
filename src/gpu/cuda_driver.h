/* SPDX-License-Identifier: MIT */
// Lazy access to the CUDA driver: libcuda.so.1 is dlopen'ed on first use,
// every entry point is resolved through cuGetProcAddress, and the outcome
// (success, or why not) is cached for the life of the process. The library
// never links libcuda, so it loads on machines without a GPU or driver.
#pragma once

#include <cuda.h>

#include <string>

namespace fkda::cuda {

struct Driver {
  int version = 0;  // cuDriverGetVersion
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxGetDevice)(CUdevice*) = nullptr;
  CUresult (*cuPointerGetAttributes)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr) = nullptr;
  CUresult (*cuLibraryLoadData)(CUlibrary*, const void*, CUjit_option*, void**, unsigned int,
                                CUlibraryOption*, void**, unsigned int) = nullptr;
  CUresult (*cuLibraryGetKernel)(CUkernel*, CUlibrary, const char*) = nullptr;
  CUresult (*cuKernelGetFunction)(CUfunction*, CUkernel) = nullptr;
  CUresult (*cuKernelSetAttribute)(CUfunction_attribute, int, CUkernel, CUdevice) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**) = nullptr;
  // Launches in clusters (the decode's layer step), and what a loaded
  // kernel was compiled for.
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*cuKernelGetAttribute)(int*, CUfunction_attribute, CUkernel, CUdevice) = nullptr;
  // Debug checks only: they copy device-side indices to the host.
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t) = nullptr;
};

// The driver, or nullptr when it cannot be used; then unavailable_reason()
// says why ("libcuda.so.1 not found: ...", "cuInit failed: ...", or that the
// driver is older than the kernels need).
const Driver* driver();
const std::string& unavailable_reason();

// The driver only when this process already runs CUDA: driver() has been
// called, or libcuda.so.1 is loaded and initialised by someone else. Never
// loads the library or calls cuInit itself, so that CPU plans leave a
// process free to fork and start CUDA later. nullptr means no memory of
// this process can be device memory.
const Driver* driver_if_started();

// cuDriverGetVersion of the libcuda.so.1 found, usable or not; 0 if none.
int found_driver_version();
// Whether a driver was found whose CUDA version is below the kernels' floor.
bool driver_too_old();

// "CUDA 12.8 (12080)" for a cuDriverGetVersion-style number.
std::string cuda_version_text(int version);
// What this build's kernels were built with and the driver they need, for
// messages about a driver that cannot load them.
std::string kernels_need();

// "CUDA_ERROR_X (text)" for a driver result.
std::string describe(CUresult result);

// Throws fkda::Error(FKDA_ERROR_DRIVER) naming `what` unless result is CUDA_SUCCESS.
void check(CUresult result, const char* what);

// The device meant where the caller names none (fkda_query_device with -1,
// the backend choice of a plan): that of the calling thread's current
// context, else device 0. Returns the result of looking up device 0 when it
// had to (CUDA_SUCCESS otherwise); *device is 0 when that failed.
CUresult current_or_first_device(const Driver& d, CUdevice* device);

// The device of the calling thread's current context; throws
// FKDA_ERROR_NO_DEVICE when there is no driver or no current context.
CUdevice current_device();

}  // namespace fkda::cuda
