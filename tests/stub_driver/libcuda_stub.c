/* SPDX-License-Identifier: MIT */
/*
 * A stand-in libcuda.so.1 for machines without a GPU: enough of the driver
 * API for libflashkda's loader, one device of compute capability 9.0 with a
 * current context, and knobs read from the environment:
 *   FKDA_STUB_DRIVER_VERSION  what cuDriverGetVersion reports (default 13000)
 *   FKDA_STUB_LOAD_RESULT     the CUresult cuLibraryLoadData returns (default 0)
 *   FKDA_STUB_FAIL_KERNEL     cuKernelGetFunction fails for kernels whose
 *                             name contains this text
 * Every pointer is reported as device memory of device 0, so a GPU plan's
 * arguments pass validation and the call reaches the kernel image. Launches
 * run nothing; they are counted (fkda_stub_launches), as are cuInit calls
 * (fkda_stub_inits). Before cuInit, cuDeviceGetCount answers
 * CUDA_ERROR_NOT_INITIALIZED, as the real driver does.
 */
#include <cuda.h>
#include <stdlib.h>
#include <string.h>

#define STUB_API __attribute__((visibility("default")))

static int env_int(const char* name, int fallback) {
  const char* text = getenv(name);
  return text != NULL && *text != '\0' ? atoi(text) : fallback;
}

STUB_API CUresult cuDriverGetVersion(int* version) {
  *version = env_int("FKDA_STUB_DRIVER_VERSION", 13000);
  return CUDA_SUCCESS;
}

static int inits;
static int launches;

STUB_API int fkda_stub_inits(void) { return inits; }
STUB_API int fkda_stub_launches(void) { return launches; }

static CUresult stub_init(unsigned int flags) {
  (void)flags;
  ++inits;
  return CUDA_SUCCESS;
}

static CUresult stub_error_name(CUresult result, const char** text) {
  *text = result == CUDA_ERROR_UNSUPPORTED_PTX_VERSION ? "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
          : result == CUDA_ERROR_NO_BINARY_FOR_GPU     ? "CUDA_ERROR_NO_BINARY_FOR_GPU"
                                                       : "CUDA_ERROR_STUB";
  return CUDA_SUCCESS;
}

static CUresult stub_error_string(CUresult result, const char** text) {
  (void)result;
  *text = "reported by the stub driver";
  return CUDA_SUCCESS;
}

static CUresult stub_device_count(int* count) {
  if (inits == 0) return CUDA_ERROR_NOT_INITIALIZED;
  *count = 1;
  return CUDA_SUCCESS;
}

static CUresult stub_device_get(CUdevice* device, int ordinal) {
  *device = ordinal;
  return CUDA_SUCCESS;
}

static CUresult stub_attribute(int* value, CUdevice_attribute which, CUdevice device) {
  (void)device;
  switch (which) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = env_int("FKDA_STUB_CC_MAJOR", 9); break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = env_int("FKDA_STUB_CC_MINOR", 0); break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
      *value = env_int("FKDA_STUB_SMEM_OPTIN", 232448);
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR:
      *value = env_int("FKDA_STUB_SMEM_PER_SM", 233472);
      break;
    default: *value = 0; break;
  }
  return CUDA_SUCCESS;
}

static CUresult stub_device_name(char* name, int length, CUdevice device) {
  (void)device;
  strncpy(name, "stub device", (size_t)length);
  return CUDA_SUCCESS;
}

static CUresult stub_ctx_current(CUcontext* context) {
  static int token;
  *context = (CUcontext)&token;
  return CUDA_SUCCESS;
}

static CUresult stub_ctx_device(CUdevice* device) {
  *device = 0;
  return CUDA_SUCCESS;
}

static CUresult stub_pointer_attributes(unsigned int count, CUpointer_attribute* attributes, void** values,
                                        CUdeviceptr pointer) {
  (void)pointer;
  for (unsigned int i = 0; i < count; ++i) {
    if (attributes[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE) *(unsigned int*)values[i] = CU_MEMORYTYPE_DEVICE;
    if (attributes[i] == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) *(int*)values[i] = 0;
  }
  return CUDA_SUCCESS;
}

static CUresult stub_library_load(CUlibrary* library, const void* image, CUjit_option* jit_options,
                                  void** jit_values, unsigned int jit_count, CUlibraryOption* options,
                                  void** option_values, unsigned int option_count) {
  (void)image, (void)jit_options, (void)jit_values, (void)jit_count;
  (void)options, (void)option_values, (void)option_count;
  static int token;
  *library = (CUlibrary)&token;
  return (CUresult)env_int("FKDA_STUB_LOAD_RESULT", CUDA_SUCCESS);
}

/* Kernels by name: a CUkernel (and its CUfunction) points at its name. */
static char kernel_names[64][96];
static int kernel_count;

static CUresult stub_library_kernel(CUkernel* kernel, CUlibrary library, const char* name) {
  (void)library;
  if (kernel_count == 64) return CUDA_ERROR_OUT_OF_MEMORY;
  strncpy(kernel_names[kernel_count], name, sizeof kernel_names[0] - 1);
  *kernel = (CUkernel)kernel_names[kernel_count++];
  return CUDA_SUCCESS;
}

static CUresult stub_kernel_function(CUfunction* function, CUkernel kernel) {
  const char* fail = getenv("FKDA_STUB_FAIL_KERNEL");
  if (fail != NULL && *fail != '\0' && strstr((const char*)kernel, fail) != NULL) return CUDA_ERROR_NOT_FOUND;
  *function = (CUfunction)kernel;
  return CUDA_SUCCESS;
}

static CUresult stub_kernel_attribute(CUfunction_attribute which, int value, CUkernel kernel, CUdevice device) {
  (void)which, (void)value, (void)kernel, (void)device;
  return CUDA_SUCCESS;
}

/* The last launch: its kernel's name, grid (x), threads and dynamic shared
 * memory, for the checks of which kernel a call chose. */
static const char* last_kernel = "";
static unsigned last_grid_x, last_threads, last_smem;
STUB_API const char* fkda_stub_last_kernel(void) { return last_kernel; }
STUB_API int fkda_stub_last_grid_x(void) { return (int)last_grid_x; }
STUB_API int fkda_stub_last_threads(void) { return (int)last_threads; }
STUB_API int fkda_stub_last_smem(void) { return (int)last_smem; }

static void record_launch(CUfunction f, unsigned gx, unsigned bx, unsigned smem) {
  ++launches;
  last_kernel = (const char*)f;
  last_grid_x = gx;
  last_threads = bx;
  last_smem = smem;
}

static CUresult stub_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned smem, CUstream stream, void** params, void** extra) {
  (void)gy, (void)gz, (void)by, (void)bz, (void)stream, (void)params, (void)extra;
  record_launch(f, gx, bx, smem);
  return CUDA_SUCCESS;
}

static CUresult stub_launch_ex(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
  (void)params, (void)extra;
  record_launch(f, config->gridDimX, config->blockDimX, config->sharedMemBytes);
  return CUDA_SUCCESS;
}

/* Every kernel as compiled for compute_90, the build's newest PTX, unless
 * FKDA_STUB_PTX_VERSION says otherwise (80: the code an sm_8x device runs). */
static CUresult stub_kernel_get_attribute(int* value, CUfunction_attribute which, CUkernel kernel, CUdevice device) {
  (void)kernel, (void)device;
  *value = which == CU_FUNC_ATTRIBUTE_PTX_VERSION ? env_int("FKDA_STUB_PTX_VERSION", 90) : 0;
  return CUDA_SUCCESS;
}

/* Entry points the loader resolves but the tests never reach. */
static CUresult stub_unreached(void) { return CUDA_ERROR_NOT_SUPPORTED; }

struct entry {
  const char* name;
  void* address;
};

static const struct entry entries[] = {
    {"cuInit", (void*)stub_init},
    {"cuDriverGetVersion", (void*)cuDriverGetVersion},
    {"cuGetErrorName", (void*)stub_error_name},
    {"cuGetErrorString", (void*)stub_error_string},
    {"cuDeviceGetCount", (void*)stub_device_count},
    {"cuDeviceGet", (void*)stub_device_get},
    {"cuDeviceGetAttribute", (void*)stub_attribute},
    {"cuDeviceGetName", (void*)stub_device_name},
    {"cuCtxGetCurrent", (void*)stub_ctx_current},
    {"cuCtxGetDevice", (void*)stub_ctx_device},
    {"cuPointerGetAttributes", (void*)stub_pointer_attributes},
    {"cuLibraryLoadData", (void*)stub_library_load},
    {"cuLibraryGetKernel", (void*)stub_library_kernel},
    {"cuKernelGetFunction", (void*)stub_kernel_function},
    {"cuKernelSetAttribute", (void*)stub_kernel_attribute},
    {"cuLaunchKernel", (void*)stub_launch},
    {"cuLaunchKernelEx", (void*)stub_launch_ex},
    {"cuKernelGetAttribute", (void*)stub_kernel_get_attribute},
    {"cuStreamGetCtx", (void*)stub_unreached},
    {"cuStreamSynchronize", (void*)stub_unreached},
    {"cuMemcpyDtoH", (void*)stub_unreached},
};

STUB_API CUresult cuGetProcAddress_v2(const char* symbol, void** address, int version, cuuint64_t flags,
                                      CUdriverProcAddressQueryResult* found) {
  (void)version, (void)flags;
  for (size_t i = 0; i < sizeof entries / sizeof entries[0]; ++i) {
    if (strcmp(symbol, entries[i].name) == 0) {
      *address = entries[i].address;
      if (found != NULL) *found = CU_GET_PROC_ADDRESS_SUCCESS;
      return CUDA_SUCCESS;
    }
  }
  *address = NULL;
  if (found != NULL) *found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}
