// SPDX-License-Identifier: MIT
//! Safe Rust bindings of libflashkda: Kimi Delta Attention (KDA) forward
//! passes behind the C ABI of `include/flashkda.h`.
//!
//! A [`Plan`] holds a configuration (heads, state dtype, backend, gate form
//! and floor, beta form, null-slot rule) and is destroyed when dropped. [`Plan::fwd_host`] runs the
//! CPU backend on host slices, with every slice length checked against the
//! shapes it implies; [`Plan::fwd_host_pool`] does the same with states in a
//! pool (and checkpoints), [`Plan::decode_host`] the decode step on a pool.
//! [`Plan::fwd_raw`] and [`Plan::decode_raw`] pass device pointers to the GPU
//! backend and are `unsafe`, as nothing can vouch for raw pointers. Every failure is an
//! [`Error`] carrying the library's status and its `fkda_last_error()`
//! message, which names the argument.
//!
//! bf16 values are `u16` bit patterns; [`to_bf16`] and [`from_bf16`] convert.
//! `g` and `beta` are [`Values`]: bf16 or f32 (f32 `g` with
//! [`GateMode::LogDecay`] only).
//!
//! The layer step around the recurrence (the convolution of q, k and v from
//! their raw projections, the gated RMSNorm of the output) is a
//! [`LayerStep`] passed to [`Plan::fwd_host_layer`],
//! [`Plan::fwd_host_pool_layer`] and [`Plan::decode_host_layer`], or a
//! [`RawLayerStep`] in the raw calls' arguments.
//!
//! ```no_run
//! use flashkda::{HostFwd, Plan, PlanDesc, Backend, StateMut, Values, to_bf16};
//!
//! let (b, t, h, k) = (1usize, 64usize, 2usize, 128usize);
//! let input = |seed: f32| -> Vec<u16> {
//!     (0..b * t * h * k).map(|i| to_bf16(((i as f32) * seed).sin())).collect()
//! };
//! let (q, kk, v, g) = (input(0.1), input(0.2), input(0.3), input(0.4));
//! let beta: Vec<u16> = (0..b * t * h).map(|i| to_bf16((i as f32).cos())).collect();
//! let a_log = vec![0.5f32; h];
//! let dt_bias = vec![0.1f32; h * k];
//! let mut out = vec![0u16; b * t * h * k];
//! let mut state = vec![0f32; b * h * k * k];
//!
//! let plan = Plan::new(&PlanDesc { backend: Backend::Cpu, ..PlanDesc::new(h as i32) })?;
//! plan.fwd_host(
//!     HostFwd {
//!         batch: b, seq_len: t, q: &q, k: &kk, v: &v, g: Values::Bf16(&g), beta: Values::Bf16(&beta),
//!         a_log: Some(&a_log), dt_bias: Some(&dt_bias), scale: (k as f32).powf(-0.5), out: &mut out,
//!         initial_state: None, final_state: Some(StateMut::F32(&mut state)), cu_seqlens: None,
//!     },
//!     None,
//! )?;
//! # Ok::<(), flashkda::Error>(())
//! ```

use flashkda_sys as sys;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr::{null_mut, NonNull};

// ------------------------------------------------------------------ errors

/// An `fkda_status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Success,
    InvalidArgument,
    Unsupported,
    NoDevice,
    Driver,
    UnsupportedArch,
    WorkspaceTooSmall,
    LaunchFailed,
    OutOfMemory,
    Internal,
    /// A status this binding does not know (a newer library).
    Other(i32),
}

impl Status {
    pub fn from_raw(status: sys::fkda_status) -> Status {
        match status {
            sys::FKDA_SUCCESS => Status::Success,
            sys::FKDA_ERROR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::FKDA_ERROR_UNSUPPORTED => Status::Unsupported,
            sys::FKDA_ERROR_NO_DEVICE => Status::NoDevice,
            sys::FKDA_ERROR_DRIVER => Status::Driver,
            sys::FKDA_ERROR_UNSUPPORTED_ARCH => Status::UnsupportedArch,
            sys::FKDA_ERROR_WORKSPACE_TOO_SMALL => Status::WorkspaceTooSmall,
            sys::FKDA_ERROR_LAUNCH_FAILED => Status::LaunchFailed,
            sys::FKDA_ERROR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::FKDA_ERROR_INTERNAL => Status::Internal,
            other => Status::Other(other),
        }
    }

    pub fn raw(self) -> sys::fkda_status {
        match self {
            Status::Success => sys::FKDA_SUCCESS,
            Status::InvalidArgument => sys::FKDA_ERROR_INVALID_ARGUMENT,
            Status::Unsupported => sys::FKDA_ERROR_UNSUPPORTED,
            Status::NoDevice => sys::FKDA_ERROR_NO_DEVICE,
            Status::Driver => sys::FKDA_ERROR_DRIVER,
            Status::UnsupportedArch => sys::FKDA_ERROR_UNSUPPORTED_ARCH,
            Status::WorkspaceTooSmall => sys::FKDA_ERROR_WORKSPACE_TOO_SMALL,
            Status::LaunchFailed => sys::FKDA_ERROR_LAUNCH_FAILED,
            Status::OutOfMemory => sys::FKDA_ERROR_OUT_OF_MEMORY,
            Status::Internal => sys::FKDA_ERROR_INTERNAL,
            Status::Other(raw) => raw,
        }
    }

    /// `fkda_status_string()`: the library's static text for this status.
    pub fn text(self) -> &'static str {
        // SAFETY: the library returns static, NUL-terminated text, never NULL.
        unsafe { static_str(sys::fkda_status_string(self.raw())) }
    }
}

/// A failing call: the status and the message naming the argument (the
/// library's `fkda_last_error()`, or this binding's own for the slice length
/// checks it makes before calling the library).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    fn invalid(message: String) -> Error {
        Error { status: Status::InvalidArgument, message }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [status {}: {}]", self.message, self.status.raw(), self.status.text())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// # Safety
/// `text` is NULL or points to NUL-terminated text that lives forever.
unsafe fn static_str(text: *const std::ffi::c_char) -> &'static str {
    if text.is_null() {
        return "";
    }
    CStr::from_ptr(text).to_str().unwrap_or("(message is not UTF-8)")
}

/// `fkda_last_error()` of this thread: the message of the last failing call.
pub fn last_error() -> String {
    // SAFETY: valid until the next fkda_* call on this thread; copied at once.
    unsafe {
        let text = sys::fkda_last_error();
        if text.is_null() {
            String::new()
        } else {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    }
}

fn check(status: sys::fkda_status) -> Result<()> {
    if status == sys::FKDA_SUCCESS {
        Ok(())
    } else {
        Err(Error { status: Status::from_raw(status), message: last_error() })
    }
}

// ------------------------------------------------------------------- enums

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The GPU when a usable device with kernels exists, else the CPU.
    Auto,
    Cpu,
    Gpu,
}

impl Backend {
    fn raw(self) -> sys::fkda_backend {
        match self {
            Backend::Auto => sys::FKDA_BACKEND_AUTO,
            Backend::Cpu => sys::FKDA_BACKEND_CPU,
            Backend::Gpu => sys::FKDA_BACKEND_GPU,
        }
    }
}

/// Element types of tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F16,
    F32,
    I32,
    I64,
    /// One byte, nonzero is true (`has_initial_state`).
    Bool,
}

impl Dtype {
    pub fn raw(self) -> sys::fkda_dtype {
        match self {
            Dtype::Bf16 => sys::FKDA_DTYPE_BF16,
            Dtype::F16 => sys::FKDA_DTYPE_F16,
            Dtype::F32 => sys::FKDA_DTYPE_F32,
            Dtype::I32 => sys::FKDA_DTYPE_I32,
            Dtype::I64 => sys::FKDA_DTYPE_I64,
            Dtype::Bool => sys::FKDA_DTYPE_BOOL,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateLayout {
    /// `[N, H, V, K]`: V-first, decays along the last axis.
    Vk,
    /// `[N, H, K, V]`.
    Kv,
}

/// How each token's per-channel decay `exp(a)`, `a <= 0`, is formed from `g`
/// (`fkda_gate_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateMode {
    /// `a = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`, in
    /// `[lower_bound, 0]`; A_log and dt_bias optional (absent: `exp(A_log) =
    /// 1`, `dt_bias = 0`). The default.
    Bounded,
    /// `a = -exp(A_log[h]) * softplus(g + dt_bias[h])` (Kimi-Linear's gate):
    /// A_log required, dt_bias optional; no floor.
    Softplus,
    /// `a = g`, the log-decay itself (bf16 or f32; values above 0 read as 0):
    /// A_log and dt_bias absent.
    LogDecay,
}

impl GateMode {
    pub fn raw(self) -> sys::fkda_gate_mode {
        match self {
            GateMode::Bounded => sys::FKDA_GATE_BOUNDED,
            GateMode::Softplus => sys::FKDA_GATE_SOFTPLUS,
            GateMode::LogDecay => sys::FKDA_GATE_LOG_DECAY,
        }
    }
}

/// How `beta` becomes the delta rule's step size (`fkda_beta_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BetaMode {
    /// `sigmoid(beta)`. The default.
    Logits,
    /// `beta` as it is, clamped into [0, 1].
    Probabilities,
}

impl BetaMode {
    pub fn raw(self) -> sys::fkda_beta_mode {
        match self {
            BetaMode::Logits => sys::FKDA_BETA_LOGITS,
            BetaMode::Probabilities => sys::FKDA_BETA_PROBABILITIES,
        }
    }
}

/// Which pool indices mean "no sequence here" (padding: zero output rows,
/// no state read or written).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NullSlotRule {
    /// index < 0 is padding; slot 0 is a real slot.
    Negative,
    /// index <= 0 is padding; slot 0 is reserved and never touched.
    Nonpositive,
}

// ------------------------------------------------------------------- plans

/// `fkda_plan_desc` in Rust types. [`PlanDesc::new`] gives the values of
/// `FKDA_PLAN_DESC_INIT` with the head count set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanDesc {
    pub num_heads: i32,
    pub head_dim_k: i32,
    pub head_dim_v: i32,
    /// The dtype of initial and final states: `Dtype::Bf16` or `Dtype::F32`.
    pub state_dtype: Dtype,
    pub state_layout: StateLayout,
    pub backend: Backend,
    /// The gate floor, in [-5, 0], of the bounded gate; other gates keep the
    /// value of [`PlanDesc::new`], -5.
    pub lower_bound: f32,
    pub null_slot_rule: NullSlotRule,
    /// GPU calls copy device-side indices to the host and check them before
    /// the launch (synchronises; not for graph capture).
    pub debug_checks: bool,
    /// How `g` becomes the decay; it also decides which of `A_log` and
    /// `dt_bias` a call takes.
    pub gate_mode: GateMode,
    /// Whether `beta` holds logits or probabilities.
    pub beta_mode: BetaMode,
    /// Forward calls may take the layer step's convolution ([`Conv`],
    /// [`RawLayerStep::conv_weight`]); the workspace sizes count what it
    /// needs. Decode and the output gate need no flag.
    pub layer_step: bool,
}

impl PlanDesc {
    pub fn new(num_heads: i32) -> PlanDesc {
        let init = sys::FKDA_PLAN_DESC_INIT;
        PlanDesc {
            num_heads,
            head_dim_k: init.head_dim_k,
            head_dim_v: init.head_dim_v,
            state_dtype: Dtype::F32,
            state_layout: StateLayout::Vk,
            backend: Backend::Auto,
            lower_bound: init.lower_bound,
            null_slot_rule: NullSlotRule::Negative,
            debug_checks: false,
            gate_mode: GateMode::Bounded,
            beta_mode: BetaMode::Logits,
            layer_step: false,
        }
    }

    fn raw(&self) -> sys::fkda_plan_desc {
        sys::fkda_plan_desc {
            num_heads: self.num_heads,
            head_dim_k: self.head_dim_k,
            head_dim_v: self.head_dim_v,
            state_dtype: self.state_dtype.raw(),
            state_layout: match self.state_layout {
                StateLayout::Vk => sys::FKDA_STATE_LAYOUT_VK,
                StateLayout::Kv => sys::FKDA_STATE_LAYOUT_KV,
            },
            backend: self.backend.raw(),
            lower_bound: self.lower_bound,
            null_slot_rule: match self.null_slot_rule {
                NullSlotRule::Negative => sys::FKDA_NULL_SLOT_NEGATIVE,
                NullSlotRule::Nonpositive => sys::FKDA_NULL_SLOT_NONPOSITIVE,
            },
            debug_checks: self.debug_checks as i32,
            gate_mode: self.gate_mode.raw(),
            beta_mode: self.beta_mode.raw(),
            layer_step: self.layer_step as i32,
            ..sys::FKDA_PLAN_DESC_INIT
        }
    }
}

/// An `fkda_plan_t`, destroyed on drop.
///
/// `Send`: a plan may move to another thread. Not `Sync`: the library does
/// not allow changing a plan while a call on it runs, and `set_lower_bound`
/// takes `&mut self` for that reason.
pub struct Plan {
    handle: NonNull<sys::fkda_plan_s>,
    desc: PlanDesc,
}

// SAFETY: a plan is a host object with no thread affinity; the library
// only forbids concurrent use, which the absence of Sync rules out.
unsafe impl Send for Plan {}

impl Plan {
    /// `fkda_plan_create`.
    pub fn new(desc: &PlanDesc) -> Result<Plan> {
        let raw = desc.raw();
        let mut handle: sys::fkda_plan_t = null_mut();
        // SAFETY: both pointers are valid for the call.
        check(unsafe { sys::fkda_plan_create(&raw, &mut handle) })?;
        let handle = NonNull::new(handle).ok_or_else(|| Error {
            status: Status::Internal,
            message: "plan: fkda_plan_create succeeded but returned NULL".to_string(),
        })?;
        Ok(Plan { handle, desc: *desc })
    }

    /// The description the plan was created with.
    pub fn desc(&self) -> &PlanDesc {
        &self.desc
    }

    /// The raw handle, for calls this crate does not wrap. It stays owned by the plan.
    pub fn as_raw(&self) -> sys::fkda_plan_t {
        self.handle.as_ptr()
    }

    /// `fkda_plan_get_backend`: `Backend::Cpu` or `Backend::Gpu`, never `Auto`.
    pub fn backend(&self) -> Result<Backend> {
        let mut backend: sys::fkda_backend = sys::FKDA_BACKEND_AUTO;
        // SAFETY: live handle, valid out pointer.
        check(unsafe { sys::fkda_plan_get_backend(self.as_raw(), &mut backend) })?;
        Ok(match backend {
            sys::FKDA_BACKEND_GPU => Backend::Gpu,
            sys::FKDA_BACKEND_CPU => Backend::Cpu,
            _ => Backend::Auto,
        })
    }

    /// `fkda_get_lower_bound`: fails on plans of another gate than
    /// [`GateMode::Bounded`], which have no floor.
    pub fn lower_bound(&self) -> Result<f32> {
        let mut value = 0f32;
        // SAFETY: live handle, valid out pointer.
        check(unsafe { sys::fkda_get_lower_bound(self.as_raw(), &mut value) })?;
        Ok(value)
    }

    /// `fkda_set_lower_bound`: accepted range [-5, 0]; bounded plans only.
    pub fn set_lower_bound(&mut self, lower_bound: f32) -> Result<()> {
        // SAFETY: live handle; &mut self excludes a concurrent fwd.
        check(unsafe { sys::fkda_set_lower_bound(self.as_raw(), lower_bound) })?;
        self.desc.lower_bound = lower_bound;
        Ok(())
    }

    /// `fkda_plan_workspace_size`: bytes of workspace for `total_tokens`
    /// tokens in `num_seqs` sequences.
    pub fn workspace_size(&self, total_tokens: i64, num_seqs: i64) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: live handle, valid out pointer.
        check(unsafe { sys::fkda_plan_workspace_size(self.as_raw(), total_tokens, num_seqs, &mut bytes) })?;
        Ok(bytes)
    }

    /// `fkda_plan_decode_workspace_size`: bytes of workspace decode needs (0
    /// today; later versions may need some).
    pub fn decode_workspace_size(&self, total_tokens: i64, num_seqs: i64) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: live handle, valid out pointer.
        check(unsafe {
            sys::fkda_plan_decode_workspace_size(self.as_raw(), total_tokens, num_seqs, &mut bytes)
        })?;
        Ok(bytes)
    }

    /// `fkda_plan_transitions_workspace_size`: bytes of workspace
    /// [`Plan::transitions_host`] needs for these sizes.
    pub fn transitions_workspace_size(&self, total_tokens: i64, num_seqs: i64) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: live handle, valid out pointer.
        check(unsafe {
            sys::fkda_plan_transitions_workspace_size(self.as_raw(), total_tokens, num_seqs, &mut bytes)
        })?;
        Ok(bytes)
    }

    /// `fkda_transitions` on host memory (a CPU plan): each sequence's
    /// segment transition, `S_out = S_in M + E`, written into
    /// `transition_m` and `transition_e` (see [`HostTransitions`]).
    /// `workspace: None` allocates one of
    /// [`Plan::transitions_workspace_size`] bytes.
    pub fn transitions_host(&self, args: HostTransitions<'_>, workspace: Option<&mut [u8]>) -> Result<()> {
        let (batch, seq_len) = (args.batch, args.seq_len);
        let heads = self.desc.num_heads.max(0) as usize;
        let dim_k = self.desc.head_dim_k.max(0) as usize;
        let dim_v = self.desc.head_dim_v.max(0) as usize;
        let num_seqs = match &args.cu_seqlens {
            Some(SeqLens::I64(offsets)) => offsets.len().saturating_sub(1),
            Some(SeqLens::I32(offsets)) => offsets.len().saturating_sub(1),
            None => batch,
        };
        let k_shape = [batch, seq_len, heads, dim_k];
        let mut raw = sys::FKDA_TRANSITION_ARGS_INIT;
        raw.k = host_tensor("k", args.k, Dtype::Bf16, &k_shape)?;
        raw.v = host_tensor("v", args.v, Dtype::Bf16, &[batch, seq_len, heads, dim_v])?;
        raw.g = args.g.tensor("g", &k_shape)?;
        raw.beta = args.beta.tensor("beta", &[batch, seq_len, heads])?;
        if let Some(a_log) = args.a_log {
            raw.A_log = host_tensor("A_log", a_log, Dtype::F32, &[heads])?;
        }
        if let Some(dt_bias) = args.dt_bias {
            raw.dt_bias = host_tensor("dt_bias", dt_bias, Dtype::F32, &[heads, dim_k])?;
        }
        raw.cu_seqlens = match &args.cu_seqlens {
            Some(SeqLens::I64(o)) => host_tensor("cu_seqlens", o, Dtype::I64, &[o.len()])?,
            Some(SeqLens::I32(o)) => host_tensor("cu_seqlens", o, Dtype::I32, &[o.len()])?,
            None => sys::FKDA_TENSOR_NONE,
        };
        raw.transition_m = host_tensor("transition_m", &*args.transition_m, Dtype::F32, &[num_seqs, heads, dim_k, dim_k])?;
        let e_shape = match self.desc.state_layout {
            StateLayout::Vk => [num_seqs, heads, dim_v, dim_k],
            StateLayout::Kv => [num_seqs, heads, dim_k, dim_v],
        };
        raw.transition_e = host_tensor("transition_e", &*args.transition_e, Dtype::F32, &e_shape)?;
        let total_tokens = i64::try_from(batch.saturating_mul(seq_len)).unwrap_or(i64::MAX);
        self.run_host(Entry::Transitions(&raw), (total_tokens, num_seqs as i64), workspace)
    }

    /// `fkda_apply_transitions` on host memory (a CPU plan): `count`
    /// transitions per sequence, `[count, N, H, K, K]` and `[count, N, H, V,
    /// K]` (the plan's layout), applied in order to `initial_state` (`None`:
    /// zeros) into `final_state`, `[N, H, V, K]` in the plan's state dtype.
    pub fn apply_transitions_host(
        &self,
        count: usize,
        num_seqs: usize,
        transition_m: &[f32],
        transition_e: &[f32],
        initial_state: Option<StateRef<'_>>,
        final_state: StateMut<'_>,
    ) -> Result<()> {
        let heads = self.desc.num_heads.max(0) as usize;
        let dim_k = self.desc.head_dim_k.max(0) as usize;
        let state_shape = self.slot_shape(num_seqs);
        let mut e_shape = vec![count];
        e_shape.extend_from_slice(&state_shape);
        let mut raw = sys::FKDA_APPLY_ARGS_INIT;
        raw.transition_m = host_tensor("transition_m", transition_m, Dtype::F32, &[count, num_seqs, heads, dim_k, dim_k])?;
        raw.transition_e = host_tensor("transition_e", transition_e, Dtype::F32, &e_shape)?;
        if let Some(state) = &initial_state {
            raw.initial_state = match state {
                StateRef::Bf16(s) => host_tensor("initial_state", s, Dtype::Bf16, &state_shape)?,
                StateRef::F32(s) => host_tensor("initial_state", s, Dtype::F32, &state_shape)?,
            };
        }
        raw.final_state = state_tensor("final_state", &final_state, &state_shape)?;
        // SAFETY: every tensor points into a slice whose length was checked
        // against its shape; final_state comes from a &mut slice. No
        // workspace is needed.
        check(unsafe { sys::fkda_apply_transitions(self.as_raw(), &raw, null_mut(), 0, null_mut()) })
    }

    /// The forward pass on host memory (a CPU plan). Slices are contiguous
    /// row-major arrays of the shapes listed on [`HostFwd`]; their lengths
    /// are checked before the call. `workspace: None` allocates one of
    /// [`Plan::workspace_size`] bytes.
    pub fn fwd_host(&self, args: HostFwd<'_>, workspace: Option<&mut [u8]>) -> Result<()> {
        let (raw, sizes) = self.host_fwd_args(&args)?;
        self.run_host(Entry::Fwd(&raw), sizes, workspace)
    }

    /// The forward pass on host memory with the states in a pool: sequence n
    /// starts from `pool.pool[pool.state_indices[n]]` and its final state is
    /// written back there (see [`HostPool`]). `args.initial_state` and
    /// `args.final_state` stay `None`.
    pub fn fwd_host_pool(&self, args: HostFwd<'_>, pool: HostPool<'_>, workspace: Option<&mut [u8]>) -> Result<()> {
        let (raw, sizes) = self.host_pool_args(&args, &pool)?;
        self.run_host(Entry::Fwd(&raw), sizes, workspace)
    }

    /// [`Plan::fwd_host`] with the layer step around the recurrence: q, k
    /// and v are the raw projections when `layer.conv` is given (a plan
    /// with [`PlanDesc::layer_step`]); its conv states have a row per
    /// sequence.
    pub fn fwd_host_layer(&self, args: HostFwd<'_>, layer: LayerStep<'_>, workspace: Option<&mut [u8]>) -> Result<()> {
        let (mut raw, sizes) = self.host_fwd_args(&args)?;
        raw.layer = self.layer_tensors(&layer, &args, sizes.1 as usize)?;
        self.run_host(Entry::Fwd(&raw), sizes, workspace)
    }

    /// [`Plan::fwd_host_pool`] with the layer step: the conv states have a
    /// row per pool slot, read and written with the slot's state.
    pub fn fwd_host_pool_layer(
        &self,
        args: HostFwd<'_>,
        pool: HostPool<'_>,
        layer: LayerStep<'_>,
        workspace: Option<&mut [u8]>,
    ) -> Result<()> {
        let (mut raw, sizes) = self.host_pool_args(&args, &pool)?;
        raw.layer = self.layer_tensors(&layer, &args, pool.slots)?;
        self.run_host(Entry::Fwd(&raw), sizes, workspace)
    }

    /// fkda_fwd_args of a host forward call on a pool and its (total_tokens, num_seqs).
    fn host_pool_args(&self, args: &HostFwd<'_>, pool: &HostPool<'_>) -> Result<(sys::fkda_fwd_args, (i64, i64))> {
        let (mut raw, sizes) = self.host_fwd_args(args)?;
        let num_seqs = sizes.1 as usize;
        let slot_shape = self.slot_shape(pool.slots);
        raw.state_pool = state_tensor("state_pool", &pool.pool, &slot_shape)?;
        raw.state_indices = pool.state_indices.tensor("state_indices", &[num_seqs])?;
        if let Some(flags) = pool.has_initial_state {
            raw.has_initial_state = host_tensor("has_initial_state", flags, Dtype::Bool, &[num_seqs])?;
        }
        if let Some(checkpoints) = &pool.checkpoints {
            let table = [num_seqs, checkpoints.per_seq];
            raw.checkpoint_offsets = checkpoints.offsets.tensor("checkpoint_offsets", &table)?;
            match &checkpoints.destination {
                CheckpointDestination::Tensor(states) => {
                    let mut shape = vec![num_seqs, checkpoints.per_seq];
                    shape.extend_from_slice(&slot_shape[1..]);
                    raw.checkpoints = state_tensor("checkpoints", states, &shape)?;
                }
                CheckpointDestination::Slots(slots) => {
                    raw.checkpoint_slots = slots.tensor("checkpoint_slots", &table)?;
                }
            }
        }
        Ok((raw, sizes))
    }

    /// The decode step on host memory (a CPU plan): 1 to 16 tokens per
    /// sequence (batched, `seq_len` <= 16, or packed with `cu_seqlens`,
    /// lengths 0 to 16) on states in a pool, updated in place (see
    /// [`DecodePool`]). `args.initial_state` and `args.final_state` stay
    /// `None`. `workspace: None` allocates one of
    /// [`Plan::decode_workspace_size`] bytes.
    pub fn decode_host(&self, args: HostFwd<'_>, pool: DecodePool<'_>, workspace: Option<&mut [u8]>) -> Result<()> {
        let (raw, sizes) = self.host_decode_args(&args, &pool)?;
        self.run_host(Entry::Decode(&raw), sizes, workspace)
    }

    /// [`Plan::decode_host`] with the layer step: the conv states have a row
    /// per pool slot, read and written with the slot's state (an `[N, W]`
    /// slot table takes no convolution).
    pub fn decode_host_layer(
        &self,
        args: HostFwd<'_>,
        pool: DecodePool<'_>,
        layer: LayerStep<'_>,
        workspace: Option<&mut [u8]>,
    ) -> Result<()> {
        let (mut raw, sizes) = self.host_decode_args(&args, &pool)?;
        raw.layer = self.layer_tensors(&layer, &args, pool.slots)?;
        self.run_host(Entry::Decode(&raw), sizes, workspace)
    }

    /// fkda_decode_args of a host decode call and its (total_tokens, num_seqs).
    fn host_decode_args(&self, args: &HostFwd<'_>, pool: &DecodePool<'_>) -> Result<(sys::fkda_decode_args, (i64, i64))> {
        for (name, given) in [("initial_state", args.initial_state.is_some()), ("final_state", args.final_state.is_some())] {
            if given {
                return Err(Error::invalid(format!("{name}: decode reads and writes its states in the pool")));
            }
        }
        let activations = self.host_activations(args)?;
        let num_seqs = activations.num_seqs;
        let mut raw = sys::FKDA_DECODE_ARGS_INIT;
        raw.q = activations.q;
        raw.k = activations.k;
        raw.v = activations.v;
        raw.g = activations.g;
        raw.beta = activations.beta;
        raw.A_log = activations.a_log;
        raw.dt_bias = activations.dt_bias;
        raw.out = activations.out;
        raw.cu_seqlens = activations.cu_seqlens;
        raw.scale = args.scale;
        raw.state_pool = state_tensor("state_pool", &pool.pool, &self.slot_shape(pool.slots))?;
        raw.state_indices = match pool.verify_columns {
            Some(columns) => pool.state_indices.tensor("state_indices", &[num_seqs, columns])?,
            None => pool.state_indices.tensor("state_indices", &[num_seqs])?,
        };
        if let Some(accepted) = &pool.num_accepted_tokens {
            raw.num_accepted_tokens = accepted.tensor("num_accepted_tokens", &[num_seqs])?;
        }
        Ok((raw, activations.sizes()))
    }

    /// The layer step's descriptors, each slice checked against its shape;
    /// the conv states have `rows` rows.
    fn layer_tensors(&self, layer: &LayerStep<'_>, args: &HostFwd<'_>, rows: usize) -> Result<sys::fkda_layer_step> {
        let heads = self.desc.num_heads.max(0) as usize;
        let channels = heads * self.desc.head_dim_k.max(0) as usize;
        let dim_v = self.desc.head_dim_v.max(0) as usize;
        let mut raw = sys::FKDA_LAYER_STEP_INIT;
        if let Some(conv) = &layer.conv {
            let [q, k, v] = &conv.weights;
            let shape = [channels, conv.width];
            raw.conv_weight_q = q.tensor("layer.conv_weight_q", &shape)?;
            raw.conv_weight_k = k.tensor("layer.conv_weight_k", &shape)?;
            raw.conv_weight_v = v.tensor("layer.conv_weight_v", &shape)?;
            if let Some([q, k, v]) = &conv.biases {
                raw.conv_bias_q = q.tensor("layer.conv_bias_q", &[channels])?;
                raw.conv_bias_k = k.tensor("layer.conv_bias_k", &[channels])?;
                raw.conv_bias_v = v.tensor("layer.conv_bias_v", &[channels])?;
            }
            if let Some(states) = &conv.states {
                let shape = [rows, channels, states.width];
                raw.conv_state_q = state_tensor("layer.conv_state_q", &states.q, &shape)?;
                raw.conv_state_k = state_tensor("layer.conv_state_k", &states.k, &shape)?;
                raw.conv_state_v = state_tensor("layer.conv_state_v", &states.v, &shape)?;
            }
        }
        if let Some(gate) = &layer.out_gate {
            let shape = [args.batch, args.seq_len, heads, dim_v];
            raw.out_gate = host_tensor("layer.out_gate", gate.gate, Dtype::Bf16, &shape)?;
            raw.out_norm_weight = gate.norm_weight.tensor("layer.out_norm_weight", &[dim_v])?;
            raw.out_norm_eps = gate.eps;
        }
        Ok(raw)
    }

    /// `[slots, H, V, K]` (or `[slots, H, K, V]`) in this plan's layout.
    fn slot_shape(&self, slots: usize) -> Vec<usize> {
        let heads = self.desc.num_heads.max(0) as usize;
        let dim_k = self.desc.head_dim_k.max(0) as usize;
        let dim_v = self.desc.head_dim_v.max(0) as usize;
        match self.desc.state_layout {
            StateLayout::Vk => vec![slots, heads, dim_v, dim_k],
            StateLayout::Kv => vec![slots, heads, dim_k, dim_v],
        }
    }

    /// The tensors every call has, checked against the shapes they imply.
    fn host_activations(&self, args: &HostFwd<'_>) -> Result<HostActivations> {
        let (batch, seq_len, cu_seqlens) = (args.batch, args.seq_len, &args.cu_seqlens);
        let heads = self.desc.num_heads.max(0) as usize;
        let dim_k = self.desc.head_dim_k.max(0) as usize;
        let dim_v = self.desc.head_dim_v.max(0) as usize;
        let num_seqs = match cu_seqlens {
            Some(SeqLens::I64(offsets)) => offsets.len().saturating_sub(1),
            Some(SeqLens::I32(offsets)) => offsets.len().saturating_sub(1),
            None => batch,
        };
        let qk_shape = [batch, seq_len, heads, dim_k];
        let v_shape = [batch, seq_len, heads, dim_v];
        Ok(HostActivations {
            num_seqs,
            total_tokens: batch.saturating_mul(seq_len),
            q: host_tensor("q", args.q, Dtype::Bf16, &qk_shape)?,
            k: host_tensor("k", args.k, Dtype::Bf16, &qk_shape)?,
            v: host_tensor("v", args.v, Dtype::Bf16, &v_shape)?,
            g: args.g.tensor("g", &qk_shape)?,
            beta: args.beta.tensor("beta", &[batch, seq_len, heads])?,
            a_log: match args.a_log {
                Some(a_log) => host_tensor("A_log", a_log, Dtype::F32, &[heads])?,
                None => sys::FKDA_TENSOR_NONE,
            },
            dt_bias: match args.dt_bias {
                Some(dt_bias) => host_tensor("dt_bias", dt_bias, Dtype::F32, &[heads, dim_k])?,
                None => sys::FKDA_TENSOR_NONE,
            },
            out: host_tensor("out", &*args.out, Dtype::Bf16, &v_shape)?,
            cu_seqlens: match cu_seqlens {
                Some(SeqLens::I64(o)) => host_tensor("cu_seqlens", o, Dtype::I64, &[o.len()])?,
                Some(SeqLens::I32(o)) => host_tensor("cu_seqlens", o, Dtype::I32, &[o.len()])?,
                None => sys::FKDA_TENSOR_NONE,
            },
        })
    }

    /// fkda_fwd_args of a host forward call and its (total_tokens, num_seqs).
    fn host_fwd_args(&self, args: &HostFwd<'_>) -> Result<(sys::fkda_fwd_args, (i64, i64))> {
        let activations = self.host_activations(args)?;
        let state_shape = self.slot_shape(activations.num_seqs);
        let mut raw = sys::FKDA_FWD_ARGS_INIT;
        raw.q = activations.q;
        raw.k = activations.k;
        raw.v = activations.v;
        raw.g = activations.g;
        raw.beta = activations.beta;
        raw.A_log = activations.a_log;
        raw.dt_bias = activations.dt_bias;
        raw.out = activations.out;
        raw.cu_seqlens = activations.cu_seqlens;
        raw.scale = args.scale;
        if let Some(state) = &args.initial_state {
            raw.initial_state = match state {
                StateRef::Bf16(s) => host_tensor("initial_state", s, Dtype::Bf16, &state_shape)?,
                StateRef::F32(s) => host_tensor("initial_state", s, Dtype::F32, &state_shape)?,
            };
        }
        if let Some(state) = &args.final_state {
            raw.final_state = state_tensor("final_state", state, &state_shape)?;
        }
        Ok((raw, activations.sizes()))
    }

    /// Runs a host call with the given workspace, or one of the size the
    /// library asks for.
    fn run_host(&self, entry: Entry<'_>, sizes: (i64, i64), workspace: Option<&mut [u8]>) -> Result<()> {
        let mut owned_workspace = Vec::new();
        let workspace: &mut [u8] = match workspace {
            Some(buffer) => buffer,
            None => {
                let size = match entry {
                    Entry::Fwd(_) => self.workspace_size(sizes.0, sizes.1),
                    Entry::Decode(_) => self.decode_workspace_size(sizes.0, sizes.1),
                    Entry::Transitions(_) => self.transitions_workspace_size(sizes.0, sizes.1),
                };
                owned_workspace.resize(size.unwrap_or(0), 0u8);
                &mut owned_workspace
            }
        };
        let workspace_ptr = if workspace.is_empty() { null_mut() } else { workspace.as_mut_ptr().cast() };
        // SAFETY: every tensor points into a slice whose length was checked
        // against the shape it is described with; outputs, the pool and the
        // checkpoints come from &mut slices; the workspace is a live &mut
        // buffer. The library validates shapes, dtypes and contents before
        // any access.
        check(unsafe {
            match entry {
                Entry::Fwd(raw) => sys::fkda_fwd(self.as_raw(), raw, workspace_ptr, workspace.len(), null_mut()),
                Entry::Decode(raw) => {
                    sys::fkda_decode(self.as_raw(), raw, workspace_ptr, workspace.len(), null_mut())
                }
                Entry::Transitions(raw) => {
                    sys::fkda_transitions(self.as_raw(), raw, workspace_ptr, workspace.len(), null_mut())
                }
            }
        })
    }

    /// `fkda_fwd` with caller-described tensors, for device memory (a GPU
    /// plan) or any layout `fwd_host` does not cover.
    ///
    /// # Safety
    /// Every tensor must describe memory that is valid for its shape and
    /// strides, readable (and writable for `out` and `final_state`) from the
    /// plan's backend until the work completes (on `stream` for a GPU plan);
    /// the workspace likewise for `workspace_bytes` bytes.
    pub unsafe fn fwd_raw(
        &self,
        args: &RawFwdArgs,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: sys::fkda_stream_t,
    ) -> Result<()> {
        let raw = args.to_sys();
        check(sys::fkda_fwd(self.as_raw(), &raw, workspace, workspace_bytes, stream))
    }

    /// `fkda_decode` with caller-described tensors, for device memory (a GPU
    /// plan) or any layout `decode_host` does not cover.
    ///
    /// # Safety
    /// As for [`Plan::fwd_raw`]; `out` and `state_pool` are written.
    pub unsafe fn decode_raw(
        &self,
        args: &RawDecodeArgs,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: sys::fkda_stream_t,
    ) -> Result<()> {
        let raw = args.to_sys();
        check(sys::fkda_decode(self.as_raw(), &raw, workspace, workspace_bytes, stream))
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: the handle is live and owned; nothing uses it afterwards.
        // A failure here can only be an invalid handle, which ownership rules out.
        unsafe {
            sys::fkda_plan_destroy(self.handle.as_ptr());
        }
    }
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan").field("handle", &self.handle).field("desc", &self.desc).finish()
    }
}

// ----------------------------------------------------------- host forward

/// An initial state: `[N, H, V, K]` (or `[N, H, K, V]`), in the plan's state dtype.
pub enum StateRef<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

/// A final state, written by the call.
pub enum StateMut<'a> {
    Bf16(&'a mut [u16]),
    F32(&'a mut [f32]),
}

/// `g` or `beta` in bf16 (bit patterns) or f32.
#[derive(Clone, Copy, Debug)]
pub enum Values<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

macro_rules! values_from {
    ($($source:ty => $variant:ident),*) => {$(
        impl<'a> From<&'a $source> for Values<'a> {
            fn from(values: &'a $source) -> Values<'a> {
                Values::$variant(values)
            }
        }
    )*};
}

values_from!([u16] => Bf16, Vec<u16> => Bf16, [f32] => F32, Vec<f32> => F32);

impl Values<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<sys::fkda_tensor> {
        match self {
            Values::Bf16(values) => host_tensor(name, values, Dtype::Bf16, shape),
            Values::F32(values) => host_tensor(name, values, Dtype::F32, shape),
        }
    }
}

/// Varlen offsets `[N + 1]`, from 0 to T, non-decreasing.
pub enum SeqLens<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
}

/// Arguments of [`Plan::fwd_host`] (and the activations of
/// [`Plan::fwd_host_pool`] and [`Plan::decode_host`]), all contiguous
/// row-major; H, K and V come from the plan, N is `batch` or
/// `cu_seqlens.len() - 1` (then `batch` is 1).
pub struct HostFwd<'a> {
    pub batch: usize,
    pub seq_len: usize,
    /// bf16 `[B, T, H, K]`.
    pub q: &'a [u16],
    /// bf16 `[B, T, H, K]`.
    pub k: &'a [u16],
    /// bf16 `[B, T, H, V]`.
    pub v: &'a [u16],
    /// `[B, T, H, K]`: the gate before activation (bf16), or the log-decay
    /// itself with [`GateMode::LogDecay`] (bf16 or f32).
    pub g: Values<'a>,
    /// `[B, T, H]`, bf16 or f32: logits, or probabilities with
    /// [`BetaMode::Probabilities`].
    pub beta: Values<'a>,
    /// f32 `[H]`: required with [`GateMode::Softplus`], optional with
    /// [`GateMode::Bounded`], `None` with [`GateMode::LogDecay`].
    pub a_log: Option<&'a [f32]>,
    /// f32 `[H, K]`: optional; `None` with [`GateMode::LogDecay`].
    pub dt_bias: Option<&'a [f32]>,
    pub scale: f32,
    /// bf16 `[B, T, H, V]`, written.
    pub out: &'a mut [u16],
    pub initial_state: Option<StateRef<'a>>,
    pub final_state: Option<StateMut<'a>>,
    pub cu_seqlens: Option<SeqLens<'a>>,
}

/// Arguments of [`Plan::transitions_host`], contiguous row-major; H, K and
/// V come from the plan, N is `batch` or `cu_seqlens.len() - 1`.
pub struct HostTransitions<'a> {
    pub batch: usize,
    pub seq_len: usize,
    /// bf16 `[B, T, H, K]`.
    pub k: &'a [u16],
    /// bf16 `[B, T, H, V]`.
    pub v: &'a [u16],
    /// `[B, T, H, K]`, as for [`HostFwd::g`].
    pub g: Values<'a>,
    /// `[B, T, H]`, as for [`HostFwd::beta`].
    pub beta: Values<'a>,
    pub a_log: Option<&'a [f32]>,
    pub dt_bias: Option<&'a [f32]>,
    pub cu_seqlens: Option<SeqLens<'a>>,
    /// f32 `[N, H, K, K]`, written: M (KV plans: its transpose).
    pub transition_m: &'a mut [f32],
    /// f32 `[N, H, V, K]` (KV plans `[N, H, K, V]`, the transpose), written: E.
    pub transition_e: &'a mut [f32],
}

/// A pool of states `[slots, H, V, K]` (or `[slots, H, K, V]`, the plan's
/// layout) in the plan's state dtype, updated in place.
///
/// Sequence n starts from slot `state_indices[n]` and its final state is
/// written back there; a null index (the plan's [`NullSlotRule`]) makes the
/// sequence padding: zero output rows, no state read or written.
pub struct HostPool<'a> {
    pub pool: StateMut<'a>,
    pub slots: usize,
    /// `[N]`.
    pub state_indices: Indices<'a>,
    /// `[N]`: false starts sequence n from zeros.
    pub has_initial_state: Option<&'a [bool]>,
    pub checkpoints: Option<HostCheckpoints<'a>>,
}

/// The states after given token counts of each sequence (prefix caching).
pub struct HostCheckpoints<'a> {
    /// C, the columns of the `[N, C]` tables.
    pub per_seq: usize,
    /// `[N, C]`: token counts from the sequence's start, multiples of 16,
    /// ascending; negative means none.
    pub offsets: Indices<'a>,
    pub destination: CheckpointDestination<'a>,
}

pub enum CheckpointDestination<'a> {
    /// `[N, C, H, V, K]` (bf16 or f32, whatever the plan's state dtype).
    Tensor(StateMut<'a>),
    /// `[N, C]` slots of the pool; null indices are skipped.
    Slots(Indices<'a>),
}

/// Slot indices or token counts, int32 or int64 as the runtime keeps them.
pub enum Indices<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl Indices<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<sys::fkda_tensor> {
        match self {
            Indices::I32(values) => host_tensor(name, values, Dtype::I32, shape),
            Indices::I64(values) => host_tensor(name, values, Dtype::I64, shape),
        }
    }
}

/// The pool of [`Plan::decode_host`]: states `[slots, H, V, K]` (or the
/// plan's KV layout) in the plan's state dtype, updated in place.
pub struct DecodePool<'a> {
    pub pool: StateMut<'a>,
    pub slots: usize,
    /// `[N]`: read and write slot `state_indices[n]`; or, with
    /// `verify_columns: Some(W)`, `[N, W]` (speculative verify): start from
    /// column `num_accepted_tokens[n] - 1`, write the state after token t into
    /// column t.
    pub state_indices: Indices<'a>,
    pub verify_columns: Option<usize>,
    /// `[N]` in [1, W], with `[N, W]` indices only; `None` means 1.
    pub num_accepted_tokens: Option<Indices<'a>>,
}

/// The layer step around the recurrence (`fkda_layer_step`) of the host
/// calls: the convolution of q, k and v from their raw projections and the
/// gated RMSNorm of the output, each optional ([`LayerStep::new`] has
/// neither):
///
/// ```text
/// x'[t][c] = silu(bias[c] + sum_{j<W} weight[c][j] x[t-W+1+j][c])   each channel c of H*K
/// o'[v]    = o[v] / sqrt(mean_v(o^2) + eps) * w[v] * sigmoid(g_out[v])  each head
/// ```
#[derive(Default)]
pub struct LayerStep<'a> {
    pub conv: Option<Conv<'a>>,
    pub out_gate: Option<OutGate<'a>>,
}

impl<'a> LayerStep<'a> {
    pub fn new() -> LayerStep<'a> {
        LayerStep::default()
    }

    pub fn conv(mut self, conv: Conv<'a>) -> LayerStep<'a> {
        self.conv = Some(conv);
        self
    }

    pub fn out_gate(mut self, out_gate: OutGate<'a>) -> LayerStep<'a> {
        self.out_gate = Some(out_gate);
        self
    }
}

/// The causal depthwise convolution of width `width` (2 to 4) with SiLU: the
/// call's q, k and v are then the raw projections, and the convolved ones
/// enter the recurrence. Forward calls need a plan with
/// [`PlanDesc::layer_step`].
pub struct Conv<'a> {
    pub width: usize,
    /// q's, k's and v's weights, `[H*K, W]` each, bf16 or f32 (one dtype).
    pub weights: [Values<'a>; 3],
    /// q's, k's and v's biases, `[H*K]` each, in the weights' dtype.
    pub biases: Option<[Values<'a>; 3]>,
    /// Without states every sequence starts from zeros.
    pub states: Option<ConvStates<'a>>,
}

impl<'a> Conv<'a> {
    /// The convolution of width `width` with these weights, without biases
    /// and states.
    pub fn new(width: usize, weights: [Values<'a>; 3]) -> Conv<'a> {
        Conv { width, weights, biases: None, states: None }
    }

    pub fn biases(mut self, biases: [Values<'a>; 3]) -> Conv<'a> {
        self.biases = Some(biases);
        self
    }

    pub fn states(mut self, states: ConvStates<'a>) -> Conv<'a> {
        self.states = Some(states);
        self
    }
}

/// The conv states of q, k and v, `[rows, H*K, Wc]` each, bf16 or f32 (one
/// dtype): a row per sequence ([`Plan::fwd_host_layer`]) or per pool slot
/// (the pool and decode calls). A row holds the raw inputs before its
/// sequence's first token, oldest first, read where the sequence reads a
/// recurrent state (zeros otherwise), and its last Wc raw inputs after the
/// call.
pub struct ConvStates<'a> {
    /// Wc: W - 1 or W columns.
    pub width: usize,
    pub q: StateMut<'a>,
    pub k: StateMut<'a>,
    pub v: StateMut<'a>,
}

/// The output gate: `o = RMSNorm(o) * norm_weight * sigmoid(gate)` over each
/// head's V values.
pub struct OutGate<'a> {
    /// bf16 `[B, T, H, V]`, like `out`.
    pub gate: &'a [u16],
    /// `[V]`, bf16 or f32.
    pub norm_weight: Values<'a>,
    /// The RMSNorm's epsilon, finite and > 0.
    pub eps: f32,
}

impl<'a> OutGate<'a> {
    /// The gate with the default epsilon, 1e-5.
    pub fn new(gate: &'a [u16], norm_weight: Values<'a>) -> OutGate<'a> {
        OutGate { gate, norm_weight, eps: sys::FKDA_LAYER_STEP_INIT.out_norm_eps }
    }
}

/// The checked descriptors every call has.
struct HostActivations {
    num_seqs: usize,
    total_tokens: usize,
    q: sys::fkda_tensor,
    k: sys::fkda_tensor,
    v: sys::fkda_tensor,
    g: sys::fkda_tensor,
    beta: sys::fkda_tensor,
    a_log: sys::fkda_tensor,
    dt_bias: sys::fkda_tensor,
    out: sys::fkda_tensor,
    cu_seqlens: sys::fkda_tensor,
}

impl HostActivations {
    /// (total_tokens, num_seqs) as the workspace queries take them.
    fn sizes(&self) -> (i64, i64) {
        (i64::try_from(self.total_tokens).unwrap_or(i64::MAX), self.num_seqs as i64)
    }
}

/// Which entry point a host call runs.
enum Entry<'r> {
    Fwd(&'r sys::fkda_fwd_args),
    Decode(&'r sys::fkda_decode_args),
    Transitions(&'r sys::fkda_transition_args),
}

fn state_tensor(name: &str, state: &StateMut<'_>, shape: &[usize]) -> Result<sys::fkda_tensor> {
    match state {
        StateMut::Bf16(s) => host_tensor(name, s, Dtype::Bf16, shape),
        StateMut::F32(s) => host_tensor(name, s, Dtype::F32, shape),
    }
}

fn host_tensor<T>(name: &str, data: &[T], dtype: Dtype, shape: &[usize]) -> Result<sys::fkda_tensor> {
    let expected = shape
        .iter()
        .try_fold(1usize, |acc, &extent| acc.checked_mul(extent))
        .ok_or_else(|| Error::invalid(format!("{name}: shape {shape:?} overflows")))?;
    if data.len() != expected {
        return Err(Error::invalid(format!(
            "{name}: slice holds {} elements, but shape {shape:?} needs {expected}",
            data.len()
        )));
    }
    let shape: Vec<i64> = shape.iter().map(|&extent| extent as i64).collect();
    RawTensor::new(data.as_ptr() as *mut c_void, dtype, &shape, None).map(|t| t.to_sys())
}

// ------------------------------------------------------------ raw forward

/// A tensor descriptor over caller-owned memory (host or device).
#[derive(Clone, Copy, Debug)]
pub struct RawTensor {
    pub data: *mut c_void,
    pub dtype: Dtype,
    rank: usize,
    shape: [i64; sys::FKDA_MAX_RANK],
    strides: [i64; sys::FKDA_MAX_RANK],
}

impl RawTensor {
    /// `strides` in elements; `None` means contiguous row-major.
    pub fn new(data: *mut c_void, dtype: Dtype, shape: &[i64], strides: Option<&[i64]>) -> Result<RawTensor> {
        if shape.len() > sys::FKDA_MAX_RANK {
            return Err(Error::invalid(format!(
                "tensor: rank {} exceeds the maximum of {}",
                shape.len(),
                sys::FKDA_MAX_RANK
            )));
        }
        let mut tensor = RawTensor {
            data,
            dtype,
            rank: shape.len(),
            shape: [0; sys::FKDA_MAX_RANK],
            strides: [0; sys::FKDA_MAX_RANK],
        };
        tensor.shape[..shape.len()].copy_from_slice(shape);
        match strides {
            Some(strides) => {
                if strides.len() != shape.len() {
                    return Err(Error::invalid(format!(
                        "tensor: {} strides for rank {}",
                        strides.len(),
                        shape.len()
                    )));
                }
                tensor.strides[..shape.len()].copy_from_slice(strides);
            }
            None => {
                let mut step = 1i64;
                for axis in (0..shape.len()).rev() {
                    tensor.strides[axis] = step;
                    step = step.saturating_mul(shape[axis].max(1));
                }
            }
        }
        Ok(tensor)
    }

    pub fn shape(&self) -> &[i64] {
        &self.shape[..self.rank]
    }

    pub fn strides(&self) -> &[i64] {
        &self.strides[..self.rank]
    }

    pub fn to_sys(&self) -> sys::fkda_tensor {
        sys::fkda_tensor {
            data: self.data,
            dtype: self.dtype.raw(),
            rank: self.rank as i32,
            shape: self.shape,
            strides: self.strides,
        }
    }
}

/// The layer step of [`RawFwdArgs`] and [`RawDecodeArgs`]: `fkda_layer_step`
/// over caller-described tensors, shapes and dtypes as in the header (see
/// [`LayerStep`]). The arrays hold q's, k's and v's tensors; they may be
/// views into one packed buffer (any strides).
#[derive(Clone, Copy, Debug)]
pub struct RawLayerStep {
    /// `[H*K, W]` each: the convolution (a forward call needs a plan with
    /// [`PlanDesc::layer_step`]).
    pub conv_weight: Option<[RawTensor; 3]>,
    /// `[H*K]` each.
    pub conv_bias: Option<[RawTensor; 3]>,
    /// `[rows, H*K, Wc]` each, written.
    pub conv_state: Option<[RawTensor; 3]>,
    /// bf16 `[B, T, H, V]`: the output gate.
    pub out_gate: Option<RawTensor>,
    /// `[V]`, with `out_gate`.
    pub out_norm_weight: Option<RawTensor>,
    pub out_norm_eps: f32,
}

impl Default for RawLayerStep {
    /// Nothing given, `out_norm_eps` 1e-5: `FKDA_LAYER_STEP_INIT`.
    fn default() -> RawLayerStep {
        RawLayerStep {
            conv_weight: None,
            conv_bias: None,
            conv_state: None,
            out_gate: None,
            out_norm_weight: None,
            out_norm_eps: sys::FKDA_LAYER_STEP_INIT.out_norm_eps,
        }
    }
}

impl RawLayerStep {
    pub fn to_sys(&self) -> sys::fkda_layer_step {
        let three = |tensors: &Option<[RawTensor; 3]>| match tensors {
            Some([q, k, v]) => [q.to_sys(), k.to_sys(), v.to_sys()],
            None => [sys::FKDA_TENSOR_NONE; 3],
        };
        let [conv_weight_q, conv_weight_k, conv_weight_v] = three(&self.conv_weight);
        let [conv_bias_q, conv_bias_k, conv_bias_v] = three(&self.conv_bias);
        let [conv_state_q, conv_state_k, conv_state_v] = three(&self.conv_state);
        sys::fkda_layer_step {
            conv_weight_q,
            conv_weight_k,
            conv_weight_v,
            conv_bias_q,
            conv_bias_k,
            conv_bias_v,
            conv_state_q,
            conv_state_k,
            conv_state_v,
            out_gate: optional_tensor(&self.out_gate),
            out_norm_weight: optional_tensor(&self.out_norm_weight),
            out_norm_eps: self.out_norm_eps,
            ..sys::FKDA_LAYER_STEP_INIT
        }
    }
}

fn optional_layer(layer: &Option<RawLayerStep>) -> sys::fkda_layer_step {
    layer.map_or(sys::FKDA_LAYER_STEP_INIT, |l| l.to_sys())
}

/// Arguments of [`Plan::fwd_raw`]; the shapes are those of `fkda_fwd_args`.
#[derive(Clone, Copy, Debug)]
pub struct RawFwdArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub g: RawTensor,
    pub beta: RawTensor,
    /// As the plan's [`GateMode`] allows.
    pub a_log: Option<RawTensor>,
    pub dt_bias: Option<RawTensor>,
    pub out: RawTensor,
    pub initial_state: Option<RawTensor>,
    pub final_state: Option<RawTensor>,
    pub cu_seqlens: Option<RawTensor>,
    pub scale: f32,
    /// States in a pool and checkpoints, as in `fkda_fwd_args`.
    pub pool: Option<RawPoolArgs>,
    /// The layer step around the recurrence.
    pub layer: Option<RawLayerStep>,
}

/// The pool fields of `fkda_fwd_args`.
#[derive(Clone, Copy, Debug)]
pub struct RawPoolArgs {
    pub state_pool: Option<RawTensor>,
    pub state_indices: Option<RawTensor>,
    pub has_initial_state: Option<RawTensor>,
    pub checkpoint_offsets: Option<RawTensor>,
    pub checkpoints: Option<RawTensor>,
    pub checkpoint_slots: Option<RawTensor>,
}

fn optional_tensor(tensor: &Option<RawTensor>) -> sys::fkda_tensor {
    tensor.map_or(sys::FKDA_TENSOR_NONE, |t| t.to_sys())
}

impl RawFwdArgs {
    pub fn to_sys(&self) -> sys::fkda_fwd_args {
        let optional = optional_tensor;
        let pool = self.pool.as_ref();
        let pool_field = |field: fn(&RawPoolArgs) -> Option<RawTensor>| optional(&pool.and_then(field));
        sys::fkda_fwd_args {
            q: self.q.to_sys(),
            k: self.k.to_sys(),
            v: self.v.to_sys(),
            g: self.g.to_sys(),
            beta: self.beta.to_sys(),
            A_log: optional(&self.a_log),
            dt_bias: optional(&self.dt_bias),
            out: self.out.to_sys(),
            initial_state: optional(&self.initial_state),
            final_state: optional(&self.final_state),
            cu_seqlens: optional(&self.cu_seqlens),
            scale: self.scale,
            state_pool: pool_field(|p| p.state_pool),
            state_indices: pool_field(|p| p.state_indices),
            has_initial_state: pool_field(|p| p.has_initial_state),
            checkpoint_offsets: pool_field(|p| p.checkpoint_offsets),
            checkpoints: pool_field(|p| p.checkpoints),
            checkpoint_slots: pool_field(|p| p.checkpoint_slots),
            layer: optional_layer(&self.layer),
            ..sys::FKDA_FWD_ARGS_INIT
        }
    }
}

/// Arguments of [`Plan::decode_raw`]; the shapes are those of `fkda_decode_args`.
#[derive(Clone, Copy, Debug)]
pub struct RawDecodeArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub g: RawTensor,
    pub beta: RawTensor,
    /// As the plan's [`GateMode`] allows.
    pub a_log: Option<RawTensor>,
    pub dt_bias: Option<RawTensor>,
    pub out: RawTensor,
    pub state_pool: RawTensor,
    pub state_indices: RawTensor,
    pub num_accepted_tokens: Option<RawTensor>,
    pub cu_seqlens: Option<RawTensor>,
    pub scale: f32,
    /// The layer step around the recurrence (conv state rows are pool slots).
    pub layer: Option<RawLayerStep>,
}

impl RawDecodeArgs {
    pub fn to_sys(&self) -> sys::fkda_decode_args {
        sys::fkda_decode_args {
            q: self.q.to_sys(),
            k: self.k.to_sys(),
            v: self.v.to_sys(),
            g: self.g.to_sys(),
            beta: self.beta.to_sys(),
            A_log: optional_tensor(&self.a_log),
            dt_bias: optional_tensor(&self.dt_bias),
            out: self.out.to_sys(),
            state_pool: self.state_pool.to_sys(),
            state_indices: self.state_indices.to_sys(),
            num_accepted_tokens: optional_tensor(&self.num_accepted_tokens),
            cu_seqlens: optional_tensor(&self.cu_seqlens),
            scale: self.scale,
            layer: optional_layer(&self.layer),
            ..sys::FKDA_DECODE_ARGS_INIT
        }
    }
}

// ----------------------------------------------------------------- devices

/// `fkda_device_info` in Rust types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub driver_loaded: bool,
    pub driver_version: i32,
    pub device_count: i32,
    pub device: i32,
    pub cc_major: i32,
    pub cc_minor: i32,
    pub has_kernels: bool,
    pub name: String,
}

/// `fkda_query_device`: device `device`, or with -1 the current one (else 0).
/// Succeeds without a driver or GPU; fails, naming both versions, with a
/// driver older than [`build_info`]'s `min_driver_version`.
pub fn query_device(device: i32) -> Result<DeviceInfo> {
    let mut info = sys::FKDA_DEVICE_INFO_INIT;
    // SAFETY: valid out pointer with struct_size set.
    check(unsafe { sys::fkda_query_device(device, &mut info) })?;
    let name_bytes: Vec<u8> = info.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    Ok(DeviceInfo {
        driver_loaded: info.driver_loaded != 0,
        driver_version: info.driver_version,
        device_count: info.device_count,
        device: info.device,
        cc_major: info.cc_major,
        cc_minor: info.cc_minor,
        has_kernels: info.has_kernels != 0,
        name: String::from_utf8_lossy(&name_bytes).into_owned(),
    })
}

// ------------------------------------------------------------------- build

/// `fkda_build_info` in Rust types; versions as `cuDriverGetVersion` encodes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildInfo {
    /// CUDA toolkit the kernels were compiled with (12.9 is 12090).
    pub cuda_version: i32,
    /// Oldest driver that loads them.
    pub min_driver_version: i32,
    /// Images in the fatbin, e.g. "sm_80 sm_90a compute_90".
    pub architectures: String,
}

/// `fkda_get_build_info`: the CUDA version, images and driver floor of the kernels.
pub fn build_info() -> Result<BuildInfo> {
    let mut info = sys::FKDA_BUILD_INFO_INIT;
    // SAFETY: valid out pointer with struct_size set.
    check(unsafe { sys::fkda_get_build_info(&mut info) })?;
    let bytes: Vec<u8> = info.architectures.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    Ok(BuildInfo {
        cuda_version: info.cuda_version,
        min_driver_version: info.min_driver_version,
        architectures: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// `fkda_version()`: MAJOR * 10000 + MINOR * 100 + PATCH of the loaded library.
pub fn version() -> u32 {
    // SAFETY: no arguments, no state.
    unsafe { sys::fkda_version() }
}

/// `fkda_version_string()`: "MAJOR.MINOR.PATCH" of the loaded library.
pub fn version_string() -> &'static str {
    // SAFETY: static text.
    unsafe { static_str(sys::fkda_version_string()) }
}

// -------------------------------------------------------------------- bf16

/// f32 -> bf16 bits, rounding to nearest even; NaN stays a (quiet) NaN.
pub fn to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let lowest_kept_bit = (bits >> 16) & 1;
    // No overflow for non-NaN values: the largest is -inf + 0x8000.
    ((bits + 0x7FFF + lowest_kept_bit) >> 16) as u16
}

/// bf16 bits -> f32 (exact).
pub fn from_bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}
