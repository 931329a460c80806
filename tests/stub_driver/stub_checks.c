// SPDX-License-Identifier: MIT
/*
 * Runs with the stub libcuda.so.1 on the library path (LD_LIBRARY_PATH) and
 * checks what only a driver can show, one mode per process (the library
 * loads the driver once):
 *   stub_checks cpu_only       CPU plans never load or initialise the driver
 *   stub_checks cpu_resident   ... nor initialise one the process loaded; once
 *                              the process has run cuInit, CPU plans do check
 *                              where their memory lives
 *   stub_checks tuning         a plan's launch tuning is read once, at its
 *                              creation, and is what the launch uses
 *   stub_checks no_partial     a kernel that fails to resolve fails the call
 *                              before any launch of it, the layer step's
 *                              too; a GPU plan's layer step stages v alone
 *   stub_checks small_smem     a device with 99 KB of shared memory a block,
 *                              running the sm_80 code, serves every call
 *   stub_checks decode_routes  fkda_decode launches the streamed kernel for
 *                              large batches on [N] indices and V x K pools,
 *                              the plain kernels otherwise
 *   stub_checks decode_routes_sm80  ... and only the plain ones where the
 *                              device runs sm_80 code
 * The stub reports every pointer as device memory and runs no kernel, so the
 * GPU calls here only reach the launches, which the stub counts.
 */
#include <flashkda.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

static void expect(int condition, const char* what) {
  if (!condition) {
    fprintf(stderr, "FAILED: %s (last error: \"%s\")\n", what, fkda_last_error());
    ++failures;
  }
}

static void expect_in(const char* text, const char* part) {
  if (strstr(text, part) == NULL) {
    fprintf(stderr, "FAILED: message lacks \"%s\":\n  %s\n", part, text);
    ++failures;
  }
}

static fkda_tensor packed(void* data, int32_t dtype, int rank, const int64_t* shape) {
  fkda_tensor x = FKDA_TENSOR_NONE;
  x.data = data;
  x.dtype = dtype;
  x.rank = rank;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    x.shape[i] = shape[i];
    x.strides[i] = stride;
    stride *= shape[i];
  }
  return x;
}

enum { H = 2, K = 128 };

/* Zeroed host memory for a forward call of B rows of T tokens (16-byte
 * aligned everywhere, so that GPU plans on the stub accept it too). */
struct Call {
  void* memory;
  fkda_fwd_args args;
};

static struct Call forward_call(int64_t B, int64_t T) {
  struct Call c;
  const size_t act = (size_t)(B * T * H * K) * 2;
  const size_t bytes = 5 * act + (size_t)(B * T * H) * 2 + 64 + (size_t)(H * K) * 4;
  c.memory = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  memset(c.memory, 0, bytes);
  char* at = c.memory;
  const int64_t act_shape[4] = {B, T, H, K};
  const int64_t beta_shape[3] = {B, T, H};
  const int64_t dt_shape[2] = {H, K};
  fkda_fwd_args a = FKDA_FWD_ARGS_INIT;
  a.q = packed(at, FKDA_DTYPE_BF16, 4, act_shape);
  a.k = packed(at + act, FKDA_DTYPE_BF16, 4, act_shape);
  a.v = packed(at + 2 * act, FKDA_DTYPE_BF16, 4, act_shape);
  a.g = packed(at + 3 * act, FKDA_DTYPE_BF16, 4, act_shape);
  a.out = packed(at + 4 * act, FKDA_DTYPE_BF16, 4, act_shape);
  a.beta = packed(at + 5 * act, FKDA_DTYPE_BF16, 3, beta_shape);
  a.dt_bias = packed(at + (5 * act + (size_t)(B * T * H) * 2 + 63) / 64 * 64, FKDA_DTYPE_F32, 2, dt_shape);
  c.args = a;
  return c;
}

static fkda_plan_t make_plan(fkda_backend backend, const fkda_plan_desc* base) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  if (base != NULL) desc = *base;
  desc.num_heads = H;
  desc.backend = backend;
  fkda_plan_t plan = NULL;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) {
    fprintf(stderr, "FAILED: fkda_plan_create: %s\n", fkda_last_error());
    ++failures;
  }
  return plan;
}

/* layer: NULL, or the layer step the call passes. */
static fkda_status run_forward_with(fkda_plan_t plan, int64_t B, int64_t T, const fkda_layer_step* layer) {
  struct Call c = forward_call(B, T);
  if (layer != NULL) c.args.layer = *layer;
  size_t bytes = 0;
  fkda_status status = fkda_plan_workspace_size(plan, B * T, B, &bytes);
  if (status == FKDA_SUCCESS) {
    void* workspace = aligned_alloc(64, bytes / 64 * 64 + 64);
    status = fkda_fwd(plan, &c.args, workspace, bytes, NULL);
    free(workspace);
  }
  free(c.memory);
  return status;
}

static fkda_status run_forward(fkda_plan_t plan, int64_t B, int64_t T) { return run_forward_with(plan, B, T, NULL); }

/* The convolution (W = 4, no conv states) and the output gate for one row
 * of T tokens, in zeroed host memory: the layer kernels on either side of
 * the recurrence. */
struct LayerInputs {
  float* weights;
  float* norm;
  uint16_t* gate;
  uint16_t* conv_states;
  fkda_layer_step layer;
};

/* The layer step of B rows of T tokens (W = 4); with conv states in a pool
 * of `slots` rows (Wc = 3, bf16) when slots > 0: [slots, 3 H K, 3], or
 * channel-last [slots, 3, 3 H K]. */
static struct LayerInputs layer_inputs_of(int64_t B, int64_t T, int64_t slots, int channel_last) {
  enum { W = 4, Wc = 3 };
  const int64_t weight_shape[2] = {H * K, W};
  const int64_t norm_shape[1] = {K};
  const int64_t gate_shape[4] = {B, T, H, K};
  struct LayerInputs in;
  in.weights = aligned_alloc(64, 3 * H * K * W * sizeof(float));
  in.norm = aligned_alloc(64, K * sizeof(float));
  in.gate = aligned_alloc(64, (size_t)(B * T * H * K) * 2);
  in.conv_states = slots > 0 ? calloc((size_t)(slots * 3 * H * K * Wc), 2) : NULL;
  memset(in.weights, 0, 3 * H * K * W * sizeof(float));
  memset(in.norm, 0, K * sizeof(float));
  memset(in.gate, 0, (size_t)(B * T * H * K) * 2);
  const fkda_layer_step none = FKDA_LAYER_STEP_INIT;
  in.layer = none;
  in.layer.conv_weight_q = packed(in.weights, FKDA_DTYPE_F32, 2, weight_shape);
  in.layer.conv_weight_k = packed(in.weights + H * K * W, FKDA_DTYPE_F32, 2, weight_shape);
  in.layer.conv_weight_v = packed(in.weights + 2 * H * K * W, FKDA_DTYPE_F32, 2, weight_shape);
  in.layer.out_gate = packed(in.gate, FKDA_DTYPE_BF16, 4, gate_shape);
  in.layer.out_norm_weight = packed(in.norm, FKDA_DTYPE_F32, 1, norm_shape);
  if (slots > 0) {
    fkda_tensor* states[3] = {&in.layer.conv_state_q, &in.layer.conv_state_k, &in.layer.conv_state_v};
    const int64_t channels = 3 * H * K;
    for (int proj = 0; proj < 3; ++proj) {
      fkda_tensor t = FKDA_TENSOR_NONE;
      t.data = in.conv_states + (channel_last ? proj * H * K : proj * H * K * Wc);
      t.dtype = FKDA_DTYPE_BF16;
      t.rank = 3;
      t.shape[0] = slots;
      t.shape[1] = H * K;
      t.shape[2] = Wc;
      t.strides[0] = channels * Wc;
      t.strides[1] = channel_last ? 1 : Wc;
      t.strides[2] = channel_last ? channels : 1;
      *states[proj] = t;
    }
  }
  return in;
}

static struct LayerInputs layer_inputs(int64_t T) { return layer_inputs_of(1, T, 0, 0); }

static void free_layer_inputs(struct LayerInputs* in) {
  free(in->weights);
  free(in->norm);
  free(in->gate);
  free(in->conv_states);
}

/* fkda_fwd of one row of T tokens with the layer step. */
static fkda_status run_layer_forward(fkda_plan_t plan, int64_t T) {
  struct LayerInputs in = layer_inputs(T);
  const fkda_status status = run_forward_with(plan, 1, T, &in.layer);
  free_layer_inputs(&in);
  return status;
}

/* fkda_decode of one token for each of N sequences, sequence n on slot n + 1
 * of a pool of the plan's state dtype (a slot table of one column when
 * `table`); layer: NULL, or the layer step the call passes. */
static fkda_status run_decode_of(fkda_plan_t plan, int32_t state_dtype, int64_t N, int table,
                                 const fkda_layer_step* layer) {
  struct Call c = forward_call(N, 1);
  const int64_t pool_shape[4] = {N + 1, H, K, K};
  const int64_t index_shape[2] = {N, 1};
  float* pool = calloc((size_t)((N + 1) * H * K * K), sizeof(float));
  int32_t* indices = malloc((size_t)N * sizeof(int32_t));
  for (int64_t n = 0; n < N; ++n) indices[n] = (int32_t)(n + 1);
  fkda_decode_args d = FKDA_DECODE_ARGS_INIT;
  d.q = c.args.q;
  d.k = c.args.k;
  d.v = c.args.v;
  d.g = c.args.g;
  d.beta = c.args.beta;
  d.dt_bias = c.args.dt_bias;
  d.out = c.args.out;
  d.state_pool = packed(pool, state_dtype, 4, pool_shape);
  d.state_indices = packed(indices, FKDA_DTYPE_I32, table ? 2 : 1, index_shape);
  if (layer != NULL) d.layer = *layer;
  size_t bytes = 0;
  fkda_status status = fkda_plan_decode_workspace_size(plan, N, N, &bytes);
  if (status == FKDA_SUCCESS) status = fkda_decode(plan, &d, NULL, 0, NULL);
  free(indices);
  free(pool);
  free(c.memory);
  return status;
}

static fkda_status run_decode_with(fkda_plan_t plan, const fkda_layer_step* layer) {
  return run_decode_of(plan, FKDA_DTYPE_F32, 1, 0, layer);
}

static fkda_status run_decode(fkda_plan_t plan) { return run_decode_with(plan, NULL); }

/* fkda_decode of one token with the layer step. */
static fkda_status run_layer_decode(fkda_plan_t plan) {
  struct LayerInputs in = layer_inputs(1);
  const fkda_status status = run_decode_with(plan, &in.layer);
  free_layer_inputs(&in);
  return status;
}

static int libcuda_resident(void) {
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (handle == NULL) return 0;
  dlclose(handle);
  return 1;
}

/* One of the stub's own functions (fkda_stub_*), or NULL, a failure. */
static void* stub_symbol(void* stub, const char* name) {
  void* symbol = dlsym(stub, name);
  if (symbol == NULL) {
    fprintf(stderr, "FAILED: the stub driver lacks %s\n", name);
    ++failures;
  }
  return symbol;
}

static int stub_counter(void* stub, const char* name) {
  int (*counter)(void) = (int (*)(void))stub_symbol(stub, name);
  return counter == NULL ? -1 : counter();
}

static void cpu_only(void) {
  fkda_plan_t plan = make_plan(FKDA_BACKEND_CPU, NULL);
  expect(run_forward(plan, 1, 32) == FKDA_SUCCESS, "fkda_fwd on a CPU plan");
  expect(run_decode(plan) == FKDA_SUCCESS, "fkda_decode on a CPU plan");
  fkda_plan_destroy(plan);
  expect(!libcuda_resident(), "CPU plans leave libcuda.so.1 unloaded");
}

typedef int (*get_proc_t)(const char*, void**, int, unsigned long long, int*);

static void cpu_resident(void) {
  void* stub = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (stub == NULL) {
    fprintf(stderr, "FAILED: no libcuda.so.1 on the library path: %s\n", dlerror());
    ++failures;
    return;
  }
  fkda_plan_t plan = make_plan(FKDA_BACKEND_CPU, NULL);
  expect(run_forward(plan, 1, 32) == FKDA_SUCCESS, "fkda_fwd on a CPU plan, driver loaded, not initialised");
  expect(run_decode(plan) == FKDA_SUCCESS, "fkda_decode on a CPU plan, driver loaded, not initialised");
  expect(stub_counter(stub, "fkda_stub_inits") == 0, "CPU plans do not call cuInit");

  /* The process starts CUDA itself: from now on device memory can exist,
   * and the stub calls every pointer device memory. */
  get_proc_t get_proc = (get_proc_t)dlsym(stub, "cuGetProcAddress_v2");
  int (*init)(unsigned int) = NULL;
  int found = 0;
  expect(get_proc != NULL && get_proc("cuInit", (void**)&init, 12000, 0, &found) == 0 && init != NULL,
         "cuInit from the stub");
  if (init != NULL) init(0);
  expect(run_forward(plan, 1, 32) == FKDA_ERROR_INVALID_ARGUMENT, "a CPU plan checks residency once CUDA runs");
  expect_in(fkda_last_error(), "device memory passed to a CPU plan");
  fkda_plan_destroy(plan);
}

static void tuning(void* stub) {
  const int64_t B = 1, T = 160; /* 10 chunks, 12 chunk slots (fkda_num_chunk_slots) */
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  fkda_plan_t plan = NULL;
  unsetenv("FKDA_VSPLIT");
  unsetenv("FKDA_WINDOW_SLOTS");

  /* Read at creation, never again. */
  setenv("FKDA_WINDOW_SLOTS", "1", 1);
  fkda_plan_t one_slot = make_plan(FKDA_BACKEND_GPU, NULL);
  unsetenv("FKDA_WINDOW_SLOTS");
  fkda_plan_t automatic = make_plan(FKDA_BACKEND_GPU, NULL);
  size_t one_slot_bytes = 0, automatic_bytes = 0;
  expect(fkda_plan_workspace_size(one_slot, B * T, B, &one_slot_bytes) == FKDA_SUCCESS, "workspace size");
  expect(fkda_plan_workspace_size(automatic, B * T, B, &automatic_bytes) == FKDA_SUCCESS, "workspace size");
  /* 11 carries between 12 windows outweigh 11 slots of records. */
  expect(one_slot_bytes > automatic_bytes, "FKDA_WINDOW_SLOTS=1 at creation: the workspace of 12 windows");
  setenv("FKDA_WINDOW_SLOTS", "1", 1);
  size_t later = 0;
  expect(fkda_plan_workspace_size(automatic, B * T, B, &later) == FKDA_SUCCESS && later == automatic_bytes,
         "FKDA_WINDOW_SLOTS set after creation changes nothing");
  unsetenv("FKDA_WINDOW_SLOTS");
  expect(fkda_plan_workspace_size(one_slot, B * T, B, &later) == FKDA_SUCCESS && later == one_slot_bytes,
         "FKDA_WINDOW_SLOTS unset after creation changes nothing");

  /* The launch follows the plan, whatever the environment says by then (the
   * automatic V split of 2 heads on 132 multiprocessors is 8). */
  setenv("FKDA_VSPLIT", "1", 1);
  setenv("FKDA_WINDOW_SLOTS", "5", 1);
  const int before = stub_counter(stub, "fkda_stub_launches");
  expect(run_forward(one_slot, B, T) == FKDA_SUCCESS, "fkda_fwd on the stub device");
  fkda_launch_report report = FKDA_LAUNCH_REPORT_INIT;
  expect(fkda_plan_get_launch_report(one_slot, &report) == FKDA_SUCCESS, "launch report");
  expect(report.slots_per_window == 1 && report.windows == 12, "one slot per window, 12 windows");
  expect(report.vsplit == 8, "FKDA_VSPLIT set after creation is not used");
  expect(report.chunk_parallel == 0 && report.segment_chunks == 0, "no chunk-parallel launch reported");
  expect(stub_counter(stub, "fkda_stub_launches") - before == 24, "a preparation and a recurrence per window");
  unsetenv("FKDA_VSPLIT");
  unsetenv("FKDA_WINDOW_SLOTS");
  fkda_plan_destroy(one_slot);
  fkda_plan_destroy(automatic);

  /* The desc's fields, ahead of the environment. */
  setenv("FKDA_VSPLIT", "8", 1);
  desc.vsplit = 2;
  desc.window_slots = 4;
  plan = make_plan(FKDA_BACKEND_GPU, &desc);
  unsetenv("FKDA_VSPLIT");
  expect(run_forward(plan, B, T) == FKDA_SUCCESS, "fkda_fwd with desc tuning");
  expect(fkda_plan_get_launch_report(plan, &report) == FKDA_SUCCESS, "launch report");
  expect(report.vsplit == 2 && report.slots_per_window == 4 && report.windows == 3, "desc.vsplit 2, window_slots 4");
  fkda_plan_destroy(plan);

  /* Bad values: rejected by fkda_plan_create, naming the field or variable. */
  struct Bad {
    const char* variable;
    const char* value;
  } bad_variables[] = {{"FKDA_VSPLIT", "3"},          {"FKDA_VSPLIT", "two"},
                       {"FKDA_WINDOW_SLOTS", "0"},    {"FKDA_WINDOW_SLOTS", "7 slots"},
                       {"FKDA_CHUNK_PARALLEL", "yes"}, {"FKDA_SEGMENT_CHUNKS", "-2"}};
  for (size_t i = 0; i < sizeof bad_variables / sizeof bad_variables[0]; ++i) {
    setenv(bad_variables[i].variable, bad_variables[i].value, 1);
    fkda_plan_desc d = FKDA_PLAN_DESC_INIT;
    d.num_heads = H;
    d.backend = FKDA_BACKEND_CPU; /* read whatever the backend */
    plan = NULL;
    expect(fkda_plan_create(&d, &plan) == FKDA_ERROR_INVALID_ARGUMENT && plan == NULL, bad_variables[i].variable);
    expect_in(fkda_last_error(), bad_variables[i].variable);
    unsetenv(bad_variables[i].variable);
  }
  setenv("FKDA_CHUNK_PARALLEL", "off", 1);
  plan = make_plan(FKDA_BACKEND_CPU, NULL);
  fkda_plan_destroy(plan);
  unsetenv("FKDA_CHUNK_PARALLEL");
  for (int field = 0; field < 4; ++field) {
    fkda_plan_desc d = FKDA_PLAN_DESC_INIT;
    d.num_heads = H;
    const char* names[] = {"desc.vsplit", "desc.chunk_parallel", "desc.window_slots", "desc.segment_chunks"};
    if (field == 0) d.vsplit = 16;
    if (field == 1) d.chunk_parallel = 3;
    if (field == 2) d.window_slots = -1;
    if (field == 3) d.segment_chunks = -1;
    plan = NULL;
    expect(fkda_plan_create(&d, &plan) == FKDA_ERROR_INVALID_ARGUMENT, names[field]);
    expect_in(fkda_last_error(), names[field]);
  }
}

static void no_partial(void* stub) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.window_slots = 1; /* many windows: many launch pairs */
  fkda_plan_t plan = make_plan(FKDA_BACKEND_GPU, &desc);
  const char* kernels[] = {"chunk_recurrence", "prepare_chunks"};
  for (int i = 0; i < 2; ++i) {
    setenv("FKDA_STUB_FAIL_KERNEL", kernels[i], 1);
    const int before = stub_counter(stub, "fkda_stub_launches");
    expect(run_forward(plan, 1, 64) == FKDA_ERROR_DRIVER, "a kernel that does not resolve: FKDA_ERROR_DRIVER");
    expect_in(fkda_last_error(), kernels[i]);
    expect(stub_counter(stub, "fkda_stub_launches") == before, "nothing launched before the failure");
  }
  unsetenv("FKDA_STUB_FAIL_KERNEL");
  const int before = stub_counter(stub, "fkda_stub_launches");
  expect(run_forward(plan, 1, 64) == FKDA_SUCCESS, "fkda_fwd once every kernel resolves");
  expect(stub_counter(stub, "fkda_stub_launches") - before == 12, "6 windows, 2 launches each");

  /* The layer step: its kernels and the preparation that convolves q and k
   * are resolved before the convolution of v is launched. */
  desc.layer_step = 1;
  fkda_plan_t layer_plan = make_plan(FKDA_BACKEND_GPU, &desc);
  const char* layer_kernels[] = {"layer_pack_conv_weights", "layer_convolve", "prepare_chunks_conv", "chunk_recurrence",
                                 "layer_gate"};
  for (int i = 0; i < 5; ++i) {
    setenv("FKDA_STUB_FAIL_KERNEL", layer_kernels[i], 1);
    const int before_layer = stub_counter(stub, "fkda_stub_launches");
    expect(run_layer_forward(layer_plan, 64) == FKDA_ERROR_DRIVER,
           "a layer step kernel that does not resolve: FKDA_ERROR_DRIVER");
    expect_in(fkda_last_error(), layer_kernels[i]);
    expect(stub_counter(stub, "fkda_stub_launches") == before_layer, "nothing of the layer step launched");
  }
  unsetenv("FKDA_STUB_FAIL_KERNEL");
  const int before_layer = stub_counter(stub, "fkda_stub_launches");
  expect(run_layer_forward(layer_plan, 64) == FKDA_SUCCESS, "fkda_fwd with the layer step");
  expect(stub_counter(stub, "fkda_stub_launches") - before_layer == 15,
         "the weight table, the convolution of v, 6 windows of 2 launches, the output gate");

  /* The staging area of a GPU plan holds v alone, 64 tokens of H * K bf16,
   * and the weight table: 10 floats a channel (q's and k's four weights
   * and bias), rounded up to 256 bytes. */
  size_t plain_bytes = 0, layer_bytes = 0;
  expect(fkda_plan_workspace_size(plan, 64, 1, &plain_bytes) == FKDA_SUCCESS &&
             fkda_plan_workspace_size(layer_plan, 64, 1, &layer_bytes) == FKDA_SUCCESS,
         "workspace sizes");
  expect(layer_bytes - plain_bytes == (size_t)(64 * H * K * 2) + (size_t)((10 * 4 * H * K + 255) / 256 * 256),
         "a GPU plan's layer step stages v alone, and the weight table");
  expect(fkda_plan_workspace_size(plan, 0, 1, &plain_bytes) == FKDA_SUCCESS &&
             fkda_plan_workspace_size(layer_plan, 0, 1, &layer_bytes) == FKDA_SUCCESS && layer_bytes == plain_bytes,
         "an empty call stages nothing");
  fkda_plan_destroy(layer_plan);
  fkda_plan_destroy(plan);
}

/* A device of compute capability 8.6 that allows a block 99 KB of shared
 * memory (sm_86 and sm_89 devices), running the sm_80 code: every call
 * works, the decode's layer step included. */
static void small_smem(void* stub) {
  setenv("FKDA_STUB_CC_MAJOR", "8", 1);
  setenv("FKDA_STUB_CC_MINOR", "6", 1);
  setenv("FKDA_STUB_SMEM_OPTIN", "101376", 1);
  setenv("FKDA_STUB_SMEM_PER_SM", "102400", 1);
  setenv("FKDA_STUB_PTX_VERSION", "80", 1);
  fkda_plan_t plan = make_plan(FKDA_BACKEND_GPU, NULL);
  int before = stub_counter(stub, "fkda_stub_launches");
  expect(run_decode(plan) == FKDA_SUCCESS, "fkda_decode on a 99 KB device");
  expect(stub_counter(stub, "fkda_stub_launches") - before == 1, "one decode launch");
  before = stub_counter(stub, "fkda_stub_launches");
  expect(run_layer_decode(plan) == FKDA_SUCCESS, "fkda_decode with the layer step on a 99 KB device");
  expect(stub_counter(stub, "fkda_stub_launches") - before == 1, "one layer decode launch");
  before = stub_counter(stub, "fkda_stub_launches");
  expect(run_forward(plan, 1, 64) == FKDA_SUCCESS, "fkda_fwd on a 99 KB device");
  expect(stub_counter(stub, "fkda_stub_launches") - before > 0, "fkda_fwd launches");
  fkda_plan_destroy(plan);
}

static const char* stub_text(void* stub, const char* name) {
  const char* (*text)(void) = (const char* (*)(void))stub_symbol(stub, name);
  return text == NULL ? "" : text();
}

/* Which kernel fkda_decode launches: the streamed one for [N] indices on a
 * V x K pool, from two items for each block: 64-row items and two blocks a
 * multiprocessor (N H >= 2 x 132 on the stub's device); with the layer
 * step, whole heads and one block a multiprocessor (N H >= 2 x 132 too).
 * It runs a persistent grid with as many stages as fit; the plain kernels
 * run otherwise (slot tables, K x V pools, channel-last conv states), and
 * wherever the device runs sm_80 code. */
static void expect_decode_kernel(void* stub, fkda_plan_t plan, int32_t state_dtype, int64_t N, int table,
                                 const fkda_layer_step* layer, const char* kernel, const char* what) {
  const int before = stub_counter(stub, "fkda_stub_launches");
  expect(run_decode_of(plan, state_dtype, N, table, layer) == FKDA_SUCCESS, what);
  expect(stub_counter(stub, "fkda_stub_launches") - before == 1, what);
  const char* launched = stub_text(stub, "fkda_stub_last_kernel");
  if (strcmp(launched, kernel) != 0) {
    fprintf(stderr, "FAILED: %s: launched %s, expected %s\n", what, launched, kernel);
    ++failures;
  }
}

static void decode_routes(void* stub, int sm80_code) {
  const int64_t fewest = 132;  /* N x H = 264 */
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.state_dtype = FKDA_DTYPE_F32;
  fkda_plan_t plan = make_plan(FKDA_BACKEND_GPU, &desc);
  const char* streamed = sm80_code ? "fkda_decode_f32_vk" : "fkda_decode_streamed_f32";
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, fewest, 0, NULL, streamed, "f32 pool, N x H = 264");
  if (!sm80_code) {
    expect(stub_counter(stub, "fkda_stub_last_grid_x") == 264, "two blocks a multiprocessor");
    expect(stub_counter(stub, "fkda_stub_last_threads") == 160, "four consumer warps and a producer");
    /* 233,472 bytes a multiprocessor: 115,712 a block, three f32 stages. */
    const int smem = stub_counter(stub, "fkda_stub_last_smem");
    expect(smem > 3 * 32768 && smem <= 115712, "three f32 stages in half a multiprocessor's shared memory");
  }
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, fewest - 1, 0, NULL, "fkda_decode_f32_vk", "f32 pool, N x H = 262");
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, fewest, 1, NULL, "fkda_decode_f32_vk", "a slot table");
  struct LayerInputs in = layer_inputs(1);
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, 1, 0, &in.layer, "fkda_decode_f32_vk_layer", "the layer step");
  free_layer_inputs(&in);
  in = layer_inputs_of(fewest, 1, fewest + 1, 0);
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, fewest, 0, &in.layer,
                       sm80_code ? "fkda_decode_f32_vk_layer" : "fkda_decode_streamed_f32_layer",
                       "the layer step, N x H = 264");
  if (!sm80_code) {
    expect(stub_counter(stub, "fkda_stub_last_grid_x") == 132, "the layer form: one block a multiprocessor");
    expect(stub_counter(stub, "fkda_stub_last_threads") == 320,
           "the layer form: eight consumer warps, a producer and a gate warp");
    /* A stage holds a head's state and 2,304 bytes of bf16 conv states:
     * three in the 232,448 bytes a block may have. */
    const int smem = stub_counter(stub, "fkda_stub_last_smem");
    expect(smem > 3 * (65536 + 2304) && smem <= 232448, "three f32 stages of the layer form");
  }
  free_layer_inputs(&in);
  in = layer_inputs_of(fewest - 1, 1, fewest, 0);
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, fewest - 1, 0, &in.layer, "fkda_decode_f32_vk_layer",
                       "the layer step, N x H = 262");
  free_layer_inputs(&in);
  in = layer_inputs_of(fewest, 1, fewest + 1, 1);
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, fewest, 0, &in.layer, "fkda_decode_f32_vk_layer",
                       "channel-last conv states");
  free_layer_inputs(&in);
  fkda_plan_destroy(plan);
  desc.state_layout = FKDA_STATE_LAYOUT_KV;
  plan = make_plan(FKDA_BACKEND_GPU, &desc);
  expect_decode_kernel(stub, plan, FKDA_DTYPE_F32, fewest, 0, NULL, "fkda_decode_f32_kv", "a K x V pool");
  fkda_plan_destroy(plan);
  desc.state_layout = FKDA_STATE_LAYOUT_VK;
  desc.state_dtype = FKDA_DTYPE_BF16;
  plan = make_plan(FKDA_BACKEND_GPU, &desc);
  expect_decode_kernel(stub, plan, FKDA_DTYPE_BF16, 4 * fewest, 0, NULL,
                       sm80_code ? "fkda_decode_bf16_vk" : "fkda_decode_streamed_bf16", "bf16 pool");
  in = layer_inputs_of(4 * fewest, 1, 4 * fewest + 1, 0);
  expect_decode_kernel(stub, plan, FKDA_DTYPE_BF16, 4 * fewest, 0, &in.layer,
                       sm80_code ? "fkda_decode_bf16_vk_layer" : "fkda_decode_streamed_bf16_layer",
                       "bf16 pool, the layer step");
  free_layer_inputs(&in);
  fkda_plan_destroy(plan);
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (strcmp(mode, "cpu_only") == 0) {
    cpu_only();
  } else if (strcmp(mode, "cpu_resident") == 0) {
    cpu_resident();
  } else if (strcmp(mode, "tuning") == 0 || strcmp(mode, "no_partial") == 0 || strcmp(mode, "small_smem") == 0 ||
             strcmp(mode, "decode_routes") == 0 || strcmp(mode, "decode_routes_sm80") == 0) {
    void* stub = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (stub == NULL) {
      fprintf(stderr, "no libcuda.so.1 on the library path: %s\n", dlerror());
      return 1;
    }
    if (strcmp(mode, "tuning") == 0) {
      tuning(stub);
    } else if (strcmp(mode, "small_smem") == 0) {
      small_smem(stub);
    } else if (strcmp(mode, "decode_routes") == 0) {
      decode_routes(stub, 0);
    } else if (strcmp(mode, "decode_routes_sm80") == 0) {
      setenv("FKDA_STUB_PTX_VERSION", "80", 1);
      decode_routes(stub, 1);
    } else {
      no_partial(stub);
    }
  } else {
    fprintf(stderr, "usage: stub_checks cpu_only|cpu_resident|tuning|no_partial|small_smem|decode_routes|"
                    "decode_routes_sm80\n");
    return 2;
  }
  if (failures == 0) printf("stub_checks %s: all checks passed\n", mode);
  return failures == 0 ? 0 : 1;
}
