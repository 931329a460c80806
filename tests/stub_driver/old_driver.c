/* SPDX-License-Identifier: MIT */
/*
 * Runs against the stub libcuda.so.1 (found through LD_LIBRARY_PATH) and
 * checks that a driver the kernels cannot use is reported in words, naming
 * the driver version found and the one needed:
 *   old_driver old      the driver is older than fkda_get_build_info's floor
 *   old_driver refused  the driver passes the floor but refuses the image
 * Each mode needs its own process: the library loads the driver once.
 */
#include <flashkda.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

static void expect(int condition, const char* what) {
  if (!condition) {
    fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

static void expect_in(const char* text, const char* part) {
  if (strstr(text, part) == NULL) {
    fprintf(stderr, "FAILED: message lacks \"%s\":\n  %s\n", part, text);
    ++failures;
  }
}

/* "CUDA 12.8 (12080)", as the library writes versions. */
static void version_text(char* out, size_t size, int version) {
  snprintf(out, size, "CUDA %d.%d (%d)", version / 1000, version % 1000 / 10, version);
}

static void set_stub_version(int version) {
  char text[16];
  snprintf(text, sizeof text, "%d", version);
  setenv("FKDA_STUB_DRIVER_VERSION", text, 1);
}

static void expect_driver_texts(const char* message, int found, const fkda_build_info* build) {
  char text[64], needed[96];
  version_text(text, sizeof text, found);
  expect_in(message, text);
  version_text(text, sizeof text, build->min_driver_version);
  snprintf(needed, sizeof needed, "need a driver for %s or newer", text);
  expect_in(message, needed);
  expect_in(message, build->architectures);
}

static void too_old(const fkda_build_info* build) {
  const int found = build->min_driver_version - 920; /* the previous major's x.8 */
  set_stub_version(found);

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = 1;
  desc.backend = FKDA_BACKEND_GPU;
  fkda_plan_t plan = NULL;
  expect(fkda_plan_create(&desc, &plan) == FKDA_ERROR_NO_DEVICE, "a GPU plan on an old driver: NO_DEVICE");
  printf("fkda_plan_create: %s\n", fkda_last_error());
  expect_in(fkda_last_error(), "desc.backend: GPU requested but no usable CUDA driver: the CUDA driver supports");
  expect_driver_texts(fkda_last_error(), found, build);

  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  expect(fkda_query_device(-1, &info) == FKDA_ERROR_NO_DEVICE, "fkda_query_device on an old driver: NO_DEVICE");
  printf("fkda_query_device: %s\n", fkda_last_error());
  expect_driver_texts(fkda_last_error(), found, build);
  expect(info.driver_version == found, "fkda_query_device reports the version found");
  expect(info.driver_loaded == 0, "an old driver is not reported as loaded");

  desc.backend = FKDA_BACKEND_AUTO;
  fkda_backend backend = FKDA_BACKEND_GPU;
  expect(fkda_plan_create(&desc, &plan) == FKDA_SUCCESS, "an AUTO plan on an old driver");
  expect(fkda_plan_get_backend(plan, &backend) == FKDA_SUCCESS && backend == FKDA_BACKEND_CPU,
         "AUTO falls back to the CPU");
  fkda_plan_destroy(plan);
}

static fkda_tensor tensor(void* data, int64_t b, int64_t t, int64_t h, int64_t k) {
  fkda_tensor x = FKDA_TENSOR_NONE;
  x.data = data;
  x.dtype = FKDA_DTYPE_BF16;
  x.rank = k > 0 ? 4 : 3;
  const int64_t shape[4] = {b, t, h, k};
  int64_t stride = 1;
  for (int i = x.rank - 1; i >= 0; --i) {
    x.shape[i] = shape[i];
    x.strides[i] = stride;
    stride *= shape[i];
  }
  return x;
}

static void refused(const fkda_build_info* build) {
  set_stub_version(build->min_driver_version);
  setenv("FKDA_STUB_LOAD_RESULT", "222", 1); /* CUDA_ERROR_UNSUPPORTED_PTX_VERSION */

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = 1;
  desc.backend = FKDA_BACKEND_GPU;
  fkda_plan_t plan = NULL;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) {
    fprintf(stderr, "FAILED: a GPU plan on the stub device: %s\n", fkda_last_error());
    ++failures;
    return;
  }
  /* The stub calls every pointer device memory; nothing is launched. */
  enum { B = 1, T = 16, H = 1, K = 128 };
  size_t workspace_bytes = 0;
  expect(fkda_plan_workspace_size(plan, B * T, B, &workspace_bytes) == FKDA_SUCCESS, "workspace size");
  void* activations = aligned_alloc(64, 6 * B * T * H * K * 2);
  float* params = aligned_alloc(64, (16 + H * K) * sizeof(float)); /* dt_bias 64-byte aligned */
  void* workspace = aligned_alloc(64, workspace_bytes + 64);
  char* a = activations;
  const size_t step = B * T * H * K * 2;
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
  args.q = tensor(a, B, T, H, K);
  args.k = tensor(a + step, B, T, H, K);
  args.v = tensor(a + 2 * step, B, T, H, K);
  args.g = tensor(a + 3 * step, B, T, H, K);
  args.out = tensor(a + 4 * step, B, T, H, K);
  args.beta = tensor(a + 5 * step, B, T, H, 0);
  args.A_log = (fkda_tensor){params, FKDA_DTYPE_F32, 1, {H}, {1}};
  args.dt_bias = (fkda_tensor){params + 16, FKDA_DTYPE_F32, 2, {H, K}, {K, 1}};
  fkda_status status = fkda_fwd(plan, &args, workspace, workspace_bytes, NULL);
  printf("fkda_fwd: %s: %s\n", fkda_status_string(status), fkda_last_error());
  expect(status == FKDA_ERROR_DRIVER, "fkda_fwd with a refused image: FKDA_ERROR_DRIVER");
  expect_in(fkda_last_error(), "cuLibraryLoadData (the embedded kernels) failed: CUDA_ERROR_UNSUPPORTED_PTX_VERSION");
  expect_driver_texts(fkda_last_error(), build->min_driver_version, build);
  fkda_plan_destroy(plan);
  free(activations);
  free(params);
  free(workspace);
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  fkda_build_info build = FKDA_BUILD_INFO_INIT;
  if (fkda_get_build_info(&build) != FKDA_SUCCESS) {
    fprintf(stderr, "fkda_get_build_info: %s\n", fkda_last_error());
    return 1;
  }
  if (strcmp(mode, "old") == 0) {
    too_old(&build);
  } else if (strcmp(mode, "refused") == 0) {
    refused(&build);
  } else {
    fprintf(stderr, "usage: old_driver old|refused\n");
    return 2;
  }
  if (failures == 0) printf("old_driver %s: all checks passed\n", mode);
  return failures == 0 ? 0 : 1;
}
