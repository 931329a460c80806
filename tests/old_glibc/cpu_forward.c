/* SPDX-License-Identifier: MIT */
/*
 * A forward pass on the CPU backend through nothing but the C ABI, for
 * scripts/old-glibc-check.sh: it runs under an older distribution's glibc
 * and prints a checksum of the output and final state, which must equal the
 * one printed under the build machine's glibc.
 */
#include <flashkda.h>

#include <gnu/libc-version.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 1, T = 37, H = 2, K = 128 };

/* A fixed pseudo-random bf16 in [-1, 1): the top half of an f32's bits. */
static uint16_t next_bf16(uint32_t* seed) {
  *seed = *seed * 1664525u + 1013904223u;
  float value = (float)(*seed >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return (uint16_t)(bits >> 16);
}

static fkda_tensor bf16_tensor(uint16_t* data, int rank, const int64_t* shape) {
  fkda_tensor t = FKDA_TENSOR_NONE;
  int64_t stride = 1;
  t.data = data;
  t.dtype = FKDA_DTYPE_BF16;
  t.rank = rank;
  for (int i = rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

int main(void) {
  static uint16_t act[5][B * T * H * K], beta[B * T * H];
  static float A_log[H], dt_bias[H * K], state[B * H * K * K];
  const int64_t act_shape[4] = {B, T, H, K}, beta_shape[3] = {B, T, H};
  uint32_t seed = 7;
  for (int a = 0; a < 4; ++a)
    for (int i = 0; i < B * T * H * K; ++i) act[a][i] = next_bf16(&seed);
  for (int i = 0; i < B * T * H; ++i) beta[i] = next_bf16(&seed);
  for (int i = 0; i < H; ++i) A_log[i] = 0.25f * (float)(i + 1);
  for (int i = 0; i < H * K; ++i) dt_bias[i] = 0.01f * (float)(i % 17);

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = H;
  desc.backend = FKDA_BACKEND_CPU;
  fkda_plan_t plan = NULL;
  size_t bytes = 0;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS ||
      fkda_plan_workspace_size(plan, B * T, B, &bytes) != FKDA_SUCCESS) {
    fprintf(stderr, "plan: %s\n", fkda_last_error());
    return 1;
  }
  void* workspace = malloc(bytes ? bytes : 1);
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
  args.q = bf16_tensor(act[0], 4, act_shape);
  args.k = bf16_tensor(act[1], 4, act_shape);
  args.v = bf16_tensor(act[2], 4, act_shape);
  args.g = bf16_tensor(act[3], 4, act_shape);
  args.out = bf16_tensor(act[4], 4, act_shape);
  args.beta = bf16_tensor(beta, 3, beta_shape);
  args.A_log = (fkda_tensor){A_log, FKDA_DTYPE_F32, 1, {H}, {1}};
  args.dt_bias = (fkda_tensor){dt_bias, FKDA_DTYPE_F32, 2, {H, K}, {K, 1}};
  args.final_state = (fkda_tensor){state, FKDA_DTYPE_F32, 4, {B, H, K, K}, {H * K * K, K * K, K, 1}};
  if (fkda_fwd(plan, &args, workspace, bytes, NULL) != FKDA_SUCCESS) {
    fprintf(stderr, "fkda_fwd: %s\n", fkda_last_error());
    return 1;
  }
  uint64_t checksum = 1469598103934665603ull; /* FNV-1a over the output and state bytes */
  const unsigned char* parts[2] = {(const unsigned char*)act[4], (const unsigned char*)state};
  const size_t sizes[2] = {sizeof act[4], sizeof state};
  double largest = 0;
  for (int p = 0; p < 2; ++p)
    for (size_t i = 0; i < sizes[p]; ++i) checksum = (checksum ^ parts[p][i]) * 1099511628211ull;
  for (int i = 0; i < B * H * K * K; ++i) largest = fmax(largest, fabs(state[i]));
  fkda_plan_destroy(plan);
  free(workspace);
  if (!(largest > 0)) {
    fprintf(stderr, "the final state is all zeros\n");
    return 1;
  }
  printf("glibc %s: flashkda %s cpu forward checksum %016llx\n", gnu_get_libc_version(), fkda_version_string(),
         (unsigned long long)checksum);
  return 0;
}
