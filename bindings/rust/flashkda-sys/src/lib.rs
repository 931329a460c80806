// SPDX-License-Identifier: MIT
//! Raw declarations of libflashkda's C ABI, one to one with
//! `include/flashkda.h`: the same names, the same field order, the same
//! values. C enums are `c_int` type aliases with constants, as the library
//! may return values a Rust enum would not know.
//!
//! `tests/header_abi.rs` checks every declaration here against the header,
//! and every struct's size and field offsets against a C compiler.
//!
//! The safe API is the `flashkda` crate.

#![no_std]
#![allow(non_camel_case_types, non_snake_case)]

use core::ffi::{c_char, c_int, c_void};
use core::marker::{PhantomData, PhantomPinned};
use core::mem::size_of;
use core::ptr::null_mut;

pub const FKDA_VERSION_MAJOR: u32 = 0;
pub const FKDA_VERSION_MINOR: u32 = 5;
pub const FKDA_VERSION_PATCH: u32 = 0;
pub const FKDA_VERSION_NUMBER: u32 =
    FKDA_VERSION_MAJOR * 10000 + FKDA_VERSION_MINOR * 100 + FKDA_VERSION_PATCH;

// ------------------------------------------------------------------ status

pub type fkda_status = c_int;
pub const FKDA_SUCCESS: fkda_status = 0;
pub const FKDA_ERROR_INVALID_ARGUMENT: fkda_status = 1;
pub const FKDA_ERROR_UNSUPPORTED: fkda_status = 2;
pub const FKDA_ERROR_NO_DEVICE: fkda_status = 3;
pub const FKDA_ERROR_DRIVER: fkda_status = 4;
pub const FKDA_ERROR_UNSUPPORTED_ARCH: fkda_status = 5;
pub const FKDA_ERROR_WORKSPACE_TOO_SMALL: fkda_status = 6;
pub const FKDA_ERROR_LAUNCH_FAILED: fkda_status = 7;
pub const FKDA_ERROR_OUT_OF_MEMORY: fkda_status = 8;
pub const FKDA_ERROR_INTERNAL: fkda_status = 9;

// ----------------------------------------------------------------- tensors

pub type fkda_dtype = c_int;
pub const FKDA_DTYPE_INVALID: fkda_dtype = 0;
pub const FKDA_DTYPE_BF16: fkda_dtype = 1;
pub const FKDA_DTYPE_F16: fkda_dtype = 2;
pub const FKDA_DTYPE_F32: fkda_dtype = 3;
pub const FKDA_DTYPE_I32: fkda_dtype = 4;
pub const FKDA_DTYPE_I64: fkda_dtype = 5;
pub const FKDA_DTYPE_BOOL: fkda_dtype = 6;

pub const FKDA_MAX_RANK: usize = 6;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_tensor {
    pub data: *mut c_void,
    pub dtype: i32,
    pub rank: i32,
    pub shape: [i64; FKDA_MAX_RANK],
    pub strides: [i64; FKDA_MAX_RANK],
}

/// FKDA_TENSOR_NONE: an absent optional tensor.
pub const FKDA_TENSOR_NONE: fkda_tensor = fkda_tensor {
    data: null_mut(),
    dtype: FKDA_DTYPE_INVALID,
    rank: 0,
    shape: [0; FKDA_MAX_RANK],
    strides: [0; FKDA_MAX_RANK],
};

// ------------------------------------------------------------------- plans

pub type fkda_backend = c_int;
pub const FKDA_BACKEND_AUTO: fkda_backend = 0;
pub const FKDA_BACKEND_CPU: fkda_backend = 1;
pub const FKDA_BACKEND_GPU: fkda_backend = 2;

pub type fkda_state_layout = c_int;
pub const FKDA_STATE_LAYOUT_VK: fkda_state_layout = 0;
pub const FKDA_STATE_LAYOUT_KV: fkda_state_layout = 1;

pub type fkda_null_slot_rule = c_int;
pub const FKDA_NULL_SLOT_NEGATIVE: fkda_null_slot_rule = 0;
pub const FKDA_NULL_SLOT_NONPOSITIVE: fkda_null_slot_rule = 1;

pub type fkda_gate_mode = c_int;
pub const FKDA_GATE_BOUNDED: fkda_gate_mode = 0;
pub const FKDA_GATE_SOFTPLUS: fkda_gate_mode = 1;
pub const FKDA_GATE_LOG_DECAY: fkda_gate_mode = 2;

pub type fkda_beta_mode = c_int;
pub const FKDA_BETA_LOGITS: fkda_beta_mode = 0;
pub const FKDA_BETA_PROBABILITIES: fkda_beta_mode = 1;

pub type fkda_chunk_parallel = c_int;
pub const FKDA_CHUNK_PARALLEL_AUTO: fkda_chunk_parallel = 0;
pub const FKDA_CHUNK_PARALLEL_OFF: fkda_chunk_parallel = 1;
pub const FKDA_CHUNK_PARALLEL_ON: fkda_chunk_parallel = 2;

/// The opaque plan object behind `fkda_plan_t`.
#[repr(C)]
pub struct fkda_plan_s {
    _opaque: [u8; 0],
    _not_send_sync_unpin: PhantomData<(*mut u8, PhantomPinned)>,
}
pub type fkda_plan_t = *mut fkda_plan_s;

/// `struct CUstream_st`, the type behind cudaStream_t and CUstream.
#[repr(C)]
pub struct CUstream_st {
    _opaque: [u8; 0],
    _not_send_sync_unpin: PhantomData<(*mut u8, PhantomPinned)>,
}
pub type fkda_stream_t = *mut CUstream_st;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_plan_desc {
    pub struct_size: usize,
    pub num_heads: i32,
    pub head_dim_k: i32,
    pub head_dim_v: i32,
    pub state_dtype: i32,
    pub state_layout: i32,
    pub backend: i32,
    pub lower_bound: f32,
    pub null_slot_rule: i32,
    pub debug_checks: i32,
    pub gate_mode: i32,
    pub beta_mode: i32,
    pub vsplit: i32,
    pub chunk_parallel: i32,
    pub window_slots: i64,
    pub segment_chunks: i64,
    pub layer_step: i32,
}

/// FKDA_PLAN_DESC_INIT.
pub const FKDA_PLAN_DESC_INIT: fkda_plan_desc = fkda_plan_desc {
    struct_size: size_of::<fkda_plan_desc>(),
    num_heads: 0,
    head_dim_k: 128,
    head_dim_v: 128,
    state_dtype: FKDA_DTYPE_F32,
    state_layout: FKDA_STATE_LAYOUT_VK,
    backend: FKDA_BACKEND_AUTO,
    lower_bound: -5.0,
    null_slot_rule: FKDA_NULL_SLOT_NEGATIVE,
    debug_checks: 0,
    gate_mode: FKDA_GATE_BOUNDED,
    beta_mode: FKDA_BETA_LOGITS,
    vsplit: 0,
    chunk_parallel: FKDA_CHUNK_PARALLEL_AUTO,
    window_slots: 0,
    segment_chunks: 0,
    layer_step: 0,
};

// -------------------------------------------------------------- layer step

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_layer_step {
    pub conv_weight_q: fkda_tensor,
    pub conv_weight_k: fkda_tensor,
    pub conv_weight_v: fkda_tensor,
    pub conv_bias_q: fkda_tensor,
    pub conv_bias_k: fkda_tensor,
    pub conv_bias_v: fkda_tensor,
    pub conv_state_q: fkda_tensor,
    pub conv_state_k: fkda_tensor,
    pub conv_state_v: fkda_tensor,
    pub out_gate: fkda_tensor,
    pub out_norm_weight: fkda_tensor,
    pub out_norm_eps: f32,
    pub reserved: i32,
}

/// FKDA_LAYER_STEP_INIT: every tensor absent, out_norm_eps 1e-5.
pub const FKDA_LAYER_STEP_INIT: fkda_layer_step = fkda_layer_step {
    conv_weight_q: FKDA_TENSOR_NONE,
    conv_weight_k: FKDA_TENSOR_NONE,
    conv_weight_v: FKDA_TENSOR_NONE,
    conv_bias_q: FKDA_TENSOR_NONE,
    conv_bias_k: FKDA_TENSOR_NONE,
    conv_bias_v: FKDA_TENSOR_NONE,
    conv_state_q: FKDA_TENSOR_NONE,
    conv_state_k: FKDA_TENSOR_NONE,
    conv_state_v: FKDA_TENSOR_NONE,
    out_gate: FKDA_TENSOR_NONE,
    out_norm_weight: FKDA_TENSOR_NONE,
    out_norm_eps: 1e-5,
    reserved: 0,
};

// ----------------------------------------------------------------- forward

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_fwd_args {
    pub struct_size: usize,
    pub q: fkda_tensor,
    pub k: fkda_tensor,
    pub v: fkda_tensor,
    pub g: fkda_tensor,
    pub beta: fkda_tensor,
    pub A_log: fkda_tensor,
    pub dt_bias: fkda_tensor,
    pub out: fkda_tensor,
    pub initial_state: fkda_tensor,
    pub final_state: fkda_tensor,
    pub cu_seqlens: fkda_tensor,
    pub scale: f32,
    pub state_pool: fkda_tensor,
    pub state_indices: fkda_tensor,
    pub has_initial_state: fkda_tensor,
    pub checkpoint_offsets: fkda_tensor,
    pub checkpoints: fkda_tensor,
    pub checkpoint_slots: fkda_tensor,
    pub layer: fkda_layer_step,
}

/// FKDA_FWD_ARGS_INIT: every tensor absent, scale 128^-0.5.
pub const FKDA_FWD_ARGS_INIT: fkda_fwd_args = fkda_fwd_args {
    struct_size: size_of::<fkda_fwd_args>(),
    q: FKDA_TENSOR_NONE,
    k: FKDA_TENSOR_NONE,
    v: FKDA_TENSOR_NONE,
    g: FKDA_TENSOR_NONE,
    beta: FKDA_TENSOR_NONE,
    A_log: FKDA_TENSOR_NONE,
    dt_bias: FKDA_TENSOR_NONE,
    out: FKDA_TENSOR_NONE,
    initial_state: FKDA_TENSOR_NONE,
    final_state: FKDA_TENSOR_NONE,
    cu_seqlens: FKDA_TENSOR_NONE,
    scale: 0.088_388_347_648_318_45,
    state_pool: FKDA_TENSOR_NONE,
    state_indices: FKDA_TENSOR_NONE,
    has_initial_state: FKDA_TENSOR_NONE,
    checkpoint_offsets: FKDA_TENSOR_NONE,
    checkpoints: FKDA_TENSOR_NONE,
    checkpoint_slots: FKDA_TENSOR_NONE,
    layer: FKDA_LAYER_STEP_INIT,
};

// ------------------------------------------------------------------ decode

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_decode_args {
    pub struct_size: usize,
    pub q: fkda_tensor,
    pub k: fkda_tensor,
    pub v: fkda_tensor,
    pub g: fkda_tensor,
    pub beta: fkda_tensor,
    pub A_log: fkda_tensor,
    pub dt_bias: fkda_tensor,
    pub out: fkda_tensor,
    pub state_pool: fkda_tensor,
    pub state_indices: fkda_tensor,
    pub num_accepted_tokens: fkda_tensor,
    pub cu_seqlens: fkda_tensor,
    pub scale: f32,
    pub layer: fkda_layer_step,
}

/// FKDA_DECODE_ARGS_INIT: every tensor absent, scale 128^-0.5.
pub const FKDA_DECODE_ARGS_INIT: fkda_decode_args = fkda_decode_args {
    struct_size: size_of::<fkda_decode_args>(),
    q: FKDA_TENSOR_NONE,
    k: FKDA_TENSOR_NONE,
    v: FKDA_TENSOR_NONE,
    g: FKDA_TENSOR_NONE,
    beta: FKDA_TENSOR_NONE,
    A_log: FKDA_TENSOR_NONE,
    dt_bias: FKDA_TENSOR_NONE,
    out: FKDA_TENSOR_NONE,
    state_pool: FKDA_TENSOR_NONE,
    state_indices: FKDA_TENSOR_NONE,
    num_accepted_tokens: FKDA_TENSOR_NONE,
    cu_seqlens: FKDA_TENSOR_NONE,
    scale: 0.088_388_347_648_318_45,
    layer: FKDA_LAYER_STEP_INIT,
};

// ------------------------------------------------------------- transitions

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_transition_args {
    pub struct_size: usize,
    pub k: fkda_tensor,
    pub v: fkda_tensor,
    pub g: fkda_tensor,
    pub beta: fkda_tensor,
    pub A_log: fkda_tensor,
    pub dt_bias: fkda_tensor,
    pub cu_seqlens: fkda_tensor,
    pub transition_m: fkda_tensor,
    pub transition_e: fkda_tensor,
}

/// FKDA_TRANSITION_ARGS_INIT: every tensor absent.
pub const FKDA_TRANSITION_ARGS_INIT: fkda_transition_args = fkda_transition_args {
    struct_size: size_of::<fkda_transition_args>(),
    k: FKDA_TENSOR_NONE,
    v: FKDA_TENSOR_NONE,
    g: FKDA_TENSOR_NONE,
    beta: FKDA_TENSOR_NONE,
    A_log: FKDA_TENSOR_NONE,
    dt_bias: FKDA_TENSOR_NONE,
    cu_seqlens: FKDA_TENSOR_NONE,
    transition_m: FKDA_TENSOR_NONE,
    transition_e: FKDA_TENSOR_NONE,
};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_apply_args {
    pub struct_size: usize,
    pub transition_m: fkda_tensor,
    pub transition_e: fkda_tensor,
    pub initial_state: fkda_tensor,
    pub final_state: fkda_tensor,
}

/// FKDA_APPLY_ARGS_INIT: every tensor absent.
pub const FKDA_APPLY_ARGS_INIT: fkda_apply_args = fkda_apply_args {
    struct_size: size_of::<fkda_apply_args>(),
    transition_m: FKDA_TENSOR_NONE,
    transition_e: FKDA_TENSOR_NONE,
    initial_state: FKDA_TENSOR_NONE,
    final_state: FKDA_TENSOR_NONE,
};

// ----------------------------------------------------------------- devices

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_device_info {
    pub struct_size: usize,
    pub driver_loaded: i32,
    pub driver_version: i32,
    pub device_count: i32,
    pub device: i32,
    pub cc_major: i32,
    pub cc_minor: i32,
    pub has_kernels: i32,
    pub name: [c_char; 256],
}

/// FKDA_DEVICE_INFO_INIT.
pub const FKDA_DEVICE_INFO_INIT: fkda_device_info = fkda_device_info {
    struct_size: size_of::<fkda_device_info>(),
    driver_loaded: 0,
    driver_version: 0,
    device_count: 0,
    device: -1,
    cc_major: 0,
    cc_minor: 0,
    has_kernels: 0,
    name: [0; 256],
};

// ---------------------------------------------------------- launch report

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_launch_report {
    pub struct_size: usize,
    pub vsplit: i64,
    pub windows: i64,
    pub slots_per_window: i64,
    pub chunk_parallel: i64,
    pub segment_chunks: i64,
}

/// FKDA_LAUNCH_REPORT_INIT.
pub const FKDA_LAUNCH_REPORT_INIT: fkda_launch_report = fkda_launch_report {
    struct_size: size_of::<fkda_launch_report>(),
    vsplit: 0,
    windows: 0,
    slots_per_window: 0,
    chunk_parallel: 0,
    segment_chunks: 0,
};

// ------------------------------------------------------------------- build

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fkda_build_info {
    pub struct_size: usize,
    pub cuda_version: i32,
    pub min_driver_version: i32,
    pub architectures: [c_char; 64],
}

/// FKDA_BUILD_INFO_INIT.
pub const FKDA_BUILD_INFO_INIT: fkda_build_info = fkda_build_info {
    struct_size: size_of::<fkda_build_info>(),
    cuda_version: 0,
    min_driver_version: 0,
    architectures: [0; 64],
};

// --------------------------------------------------------------- functions

extern "C" {
    pub fn fkda_status_string(status: fkda_status) -> *const c_char;
    pub fn fkda_last_error() -> *const c_char;
    pub fn fkda_version() -> u32;
    pub fn fkda_version_string() -> *const c_char;

    pub fn fkda_plan_create(desc: *const fkda_plan_desc, plan: *mut fkda_plan_t) -> fkda_status;
    pub fn fkda_plan_destroy(plan: fkda_plan_t) -> fkda_status;
    pub fn fkda_plan_get_backend(plan: fkda_plan_t, backend: *mut fkda_backend) -> fkda_status;
    pub fn fkda_set_lower_bound(plan: fkda_plan_t, lower_bound: f32) -> fkda_status;
    pub fn fkda_get_lower_bound(plan: fkda_plan_t, lower_bound: *mut f32) -> fkda_status;
    pub fn fkda_plan_workspace_size(
        plan: fkda_plan_t,
        total_tokens: i64,
        num_seqs: i64,
        bytes: *mut usize,
    ) -> fkda_status;

    pub fn fkda_fwd(
        plan: fkda_plan_t,
        args: *const fkda_fwd_args,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: fkda_stream_t,
    ) -> fkda_status;

    pub fn fkda_plan_decode_workspace_size(
        plan: fkda_plan_t,
        total_tokens: i64,
        num_seqs: i64,
        bytes: *mut usize,
    ) -> fkda_status;
    pub fn fkda_decode(
        plan: fkda_plan_t,
        args: *const fkda_decode_args,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: fkda_stream_t,
    ) -> fkda_status;

    pub fn fkda_plan_transitions_workspace_size(
        plan: fkda_plan_t,
        total_tokens: i64,
        num_seqs: i64,
        bytes: *mut usize,
    ) -> fkda_status;
    pub fn fkda_transitions(
        plan: fkda_plan_t,
        args: *const fkda_transition_args,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: fkda_stream_t,
    ) -> fkda_status;
    pub fn fkda_apply_transitions(
        plan: fkda_plan_t,
        args: *const fkda_apply_args,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: fkda_stream_t,
    ) -> fkda_status;

    pub fn fkda_query_device(device: i32, info: *mut fkda_device_info) -> fkda_status;

    pub fn fkda_plan_get_launch_report(plan: fkda_plan_t, report: *mut fkda_launch_report) -> fkda_status;
    pub fn fkda_get_build_info(info: *mut fkda_build_info) -> fkda_status;
}
