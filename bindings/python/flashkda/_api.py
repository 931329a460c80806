# SPDX-License-Identifier: MIT
"""Plans, the forward pass, the decode step and device queries on top of the C ABI."""

import ctypes
import threading
from dataclasses import dataclass

from . import _arrays, _launch, _layer, _plans
from ._abi import (
    APPLY_TENSOR_FIELDS,
    DECODE_TENSOR_FIELDS,
    DEFAULT_OUT_NORM_EPS,
    LAYER_TENSOR_FIELDS,
    TRANSITION_TENSOR_FIELDS,
    FWD_POOL_TENSOR_FIELDS,
    FWD_TENSOR_FIELDS,
    Backend,
    BetaMode,
    ChunkParallel,
    Dtype,
    FkdaApplyArgs,
    FkdaBuildInfo,
    FkdaDecodeArgs,
    FkdaDeviceInfo,
    FkdaFwdArgs,
    FkdaPlanDesc,
    FkdaTransitionArgs,
    GateMode,
    NullSlotRule,
    StateLayout,
)
from ._errors import FlashKDAError, invalid_argument
from ._library import library as _current_library
from ._library import load_library

_STATE_DTYPE_NAMES = {"bf16": Dtype.BF16, "bfloat16": Dtype.BF16, "f32": Dtype.F32, "float32": Dtype.F32}
_BACKEND_NAMES = {"auto": Backend.AUTO, "cpu": Backend.CPU, "gpu": Backend.GPU, "cuda": Backend.GPU}
_LAYOUT_NAMES = {"vk": StateLayout.VK, "kv": StateLayout.KV}
_NULL_SLOT_RULE_NAMES = {"negative": NullSlotRule.NEGATIVE, "nonpositive": NullSlotRule.NONPOSITIVE}
_GATE_MODE_NAMES = {"bounded": GateMode.BOUNDED, "softplus": GateMode.SOFTPLUS,
                    "log_decay": GateMode.LOG_DECAY, "log-decay": GateMode.LOG_DECAY}
_BETA_MODE_NAMES = {"logits": BetaMode.LOGITS, "probabilities": BetaMode.PROBABILITIES}
_CHUNK_PARALLEL_NAMES = {"auto": ChunkParallel.AUTO, "off": ChunkParallel.OFF, "on": ChunkParallel.ON}
# FKDA_PLAN_DESC_INIT's lower_bound: the value a plan without a floor (any
# gate but the bounded one) must keep, and what lower_bound=None stands for.
_DEFAULT_LOWER_BOUND = -5.0


def _enum_value(name, value, names):
    if isinstance(value, str):
        try:
            return int(names[value.lower()])
        except KeyError:
            raise invalid_argument(
                f"{name}: unknown value '{value}' (expected one of {', '.join(names)})"
            ) from None
    return _int32(name, value)


def _int32(name, value):
    try:
        number = int(value.__index__())
    except (AttributeError, TypeError):
        raise invalid_argument(f"{name}: expected an integer, got {type(value).__name__}") from None
    if not -(2**31) <= number < 2**31:
        raise invalid_argument(f"{name}: {number} does not fit in int32")
    return number


def _int64(name, value):
    try:
        number = int(value.__index__())
    except (AttributeError, TypeError):
        raise invalid_argument(f"{name}: expected an integer, got {type(value).__name__}") from None
    if not -(2**63) <= number < 2**63:
        raise invalid_argument(f"{name}: {number} does not fit in int64")
    return number


def _float(name, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise invalid_argument(f"{name}: expected a number, got {type(value).__name__}") from None


def _lower_bound(value):
    """lower_bound as the plan takes it: None is FKDA_PLAN_DESC_INIT's -5,
    the value plans of the softplus and log-decay gates must keep."""
    return _DEFAULT_LOWER_BOUND if value is None else _float("lower_bound", value)


def _sized_by(query):
    """The workspace sizing of an entry point: the plan's `query` (a method
    name) for the arguments' (total tokens, sequences), or 0 when the shapes
    are too malformed to size it (the call itself then names the argument)."""

    def workspace(plan, views):
        q = views["q"]
        if q is None or len(q.shape) != 4:
            return 0
        batch, seq_len = q.shape[0], q.shape[1]
        num_seqs = batch
        cu_seqlens = views["cu_seqlens"]
        if cu_seqlens is not None:
            if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
                return 0
            num_seqs = cu_seqlens.shape[0] - 1
        try:
            return getattr(plan, query)(batch * seq_len, num_seqs)
        except FlashKDAError:
            return 0

    return workspace


def _shaped_by(states):
    """The plan a module-level call derives from its arguments: heads from q
    (else A_log), state dtype from the first of `states` given (f32 without)."""

    def plan_shape(views):
        num_heads = 1
        q, A_log = views["q"], views["A_log"]
        if q is not None and len(q.shape) == 4:
            num_heads = q.shape[2]
        elif A_log is not None and len(A_log.shape) == 1:
            num_heads = A_log.shape[0]
        given = [views[name] for name in states if views[name] is not None]
        # Any dtype but bf16 and f32 is the call's to report, by name.
        state_dtype = Dtype.BF16 if given and given[0].dtype == Dtype.BF16 else Dtype.F32
        return num_heads, state_dtype

    return plan_shape


# The layer step's convolution states are updated in place.
_CONV_STATES = ("conv_state_q", "conv_state_k", "conv_state_v")

FWD = _launch.EntryPoint(
    function="fkda_fwd",
    struct=FkdaFwdArgs,
    tensors=FWD_TENSOR_FIELDS + FWD_POOL_TENSOR_FIELDS + LAYER_TENSOR_FIELDS,
    outputs=("out", "final_state", "state_pool", "checkpoints") + _CONV_STATES,
    workspace=_sized_by("workspace_size"),
    plan_shape=_shaped_by(("initial_state", "final_state", "state_pool")),
    convolution_plan=True,
)

def _transitions_workspace(plan, views):
    """fkda_plan_transitions_workspace_size for the shapes of k and cu_seqlens
    (0 when they are too malformed to size: the call names the argument)."""
    k = views["k"]
    if k is None or len(k.shape) != 4:
        return 0
    num_seqs = k.shape[0]
    cu_seqlens = views["cu_seqlens"]
    if cu_seqlens is not None:
        if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
            return 0
        num_seqs = cu_seqlens.shape[0] - 1
    try:
        return plan.transitions_workspace_size(k.shape[0] * k.shape[1], num_seqs)
    except FlashKDAError:
        return 0


def _transitions_shape(views):
    k = views["k"]
    return (k.shape[2] if k is not None and len(k.shape) == 4 else 1), Dtype.F32


def _apply_shape(views):
    m = views["transition_m"]
    num_heads = m.shape[2] if m is not None and len(m.shape) == 5 else 1
    given = [views[name] for name in ("initial_state", "final_state") if views[name] is not None]
    return num_heads, Dtype.BF16 if given and given[0].dtype == Dtype.BF16 else Dtype.F32


TRANSITIONS = _launch.EntryPoint(
    function="fkda_transitions",
    struct=FkdaTransitionArgs,
    tensors=TRANSITION_TENSOR_FIELDS,
    outputs=("transition_m", "transition_e"),
    workspace=_transitions_workspace,
    plan_shape=_transitions_shape,
)

APPLY = _launch.EntryPoint(
    function="fkda_apply_transitions",
    struct=FkdaApplyArgs,
    tensors=APPLY_TENSOR_FIELDS,
    outputs=("final_state",),
    workspace=lambda plan, views: 0,  # none is needed
    plan_shape=_apply_shape,
)

DECODE = _launch.EntryPoint(
    function="fkda_decode",
    struct=FkdaDecodeArgs,
    tensors=DECODE_TENSOR_FIELDS + LAYER_TENSOR_FIELDS,
    outputs=("out", "state_pool") + _CONV_STATES,
    workspace=_sized_by("decode_workspace_size"),
    plan_shape=_shaped_by(("state_pool",)),
)


def _cached_block(blocks, key, build):
    """The argument block for `key` in this thread's `blocks`, built on a miss."""
    try:
        block = blocks.get(key)
    except TypeError:  # an unhashable scale or lower_bound: build() names it
        return build()
    if block is None:
        block = build()
        _launch.remember(blocks, key, block)
    return block


class Plan:
    """An fkda_plan_t: configuration, backend, gate, lower_bound and workspace sizing.

    gate_mode: how g becomes each token's decay, "bounded" (the default:
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), A_log and dt_bias
    optional), "softplus" (-exp(A_log) * softplus(g + dt_bias), Kimi-Linear's
    gate: A_log required, dt_bias optional, no floor) or "log_decay" (g, bf16
    or f32, is the log-decay itself; no A_log, no dt_bias). beta_mode:
    "logits" (sigmoid(beta), the default) or "probabilities" (beta as it is).
    GateMode and BetaMode members are accepted too. lower_bound belongs to the
    bounded gate: other gates leave it at -5 (None means -5). chunk_parallel
    ("auto", "off", "on" or ChunkParallel) and segment_chunks choose how long
    sequences are cut into segments that run in parallel (0: automatic; CPU
    plans only cut them when it is "on"). layer_step=True lets fwd take the
    layer step's convolution (conv_weight; its workspace is larger); decode
    and the output gate need no flag.

    Use as a context manager or call close(); a plan that is garbage collected
    while open is destroyed then. fwd and decode may run on one plan from
    several threads at once (each thread has its own argument blocks), and
    so may set_lower_bound. A plan is destroyed as soon as its last reference
    goes (it is in no reference cycle), or by close(); calls already running
    on it finish normally.
    """

    def __init__(
        self,
        num_heads,
        *,
        head_dim_k=128,
        head_dim_v=128,
        state_dtype=Dtype.F32,
        state_layout=StateLayout.VK,
        backend=Backend.AUTO,
        lower_bound=-5.0,
        null_slot_rule=NullSlotRule.NEGATIVE,
        debug_checks=False,
        gate_mode=GateMode.BOUNDED,
        beta_mode=BetaMode.LOGITS,
        chunk_parallel=ChunkParallel.AUTO,
        segment_chunks=0,
        layer_step=False,
        library_path=None,
        library=None,
    ):
        """library: a loaded _library.Library (used by the shared plans of
        flashkda.fwd); library_path loads one; neither: the current one."""
        self._handle = None
        self._backend = None
        # Argument blocks of this plan, per thread (see _launch).
        self._blocks = threading.local()
        if library is None:
            library = load_library(library_path) if library_path is not None else _current_library()
        self._library = library
        desc = FkdaPlanDesc.initialized()
        desc.num_heads = _int32("num_heads", num_heads)
        desc.head_dim_k = _int32("head_dim_k", head_dim_k)
        desc.head_dim_v = _int32("head_dim_v", head_dim_v)
        desc.state_dtype = _enum_value("state_dtype", state_dtype, _STATE_DTYPE_NAMES)
        desc.state_layout = _enum_value("state_layout", state_layout, _LAYOUT_NAMES)
        desc.backend = _enum_value("backend", backend, _BACKEND_NAMES)
        desc.lower_bound = _lower_bound(lower_bound)
        desc.null_slot_rule = _enum_value("null_slot_rule", null_slot_rule, _NULL_SLOT_RULE_NAMES)
        desc.debug_checks = 1 if debug_checks else 0
        desc.gate_mode = _enum_value("gate_mode", gate_mode, _GATE_MODE_NAMES)
        desc.beta_mode = _enum_value("beta_mode", beta_mode, _BETA_MODE_NAMES)
        desc.chunk_parallel = _enum_value("chunk_parallel", chunk_parallel, _CHUNK_PARALLEL_NAMES)
        desc.segment_chunks = _int64("segment_chunks", segment_chunks)
        desc.layer_step = 1 if layer_step else 0
        handle = ctypes.c_void_p()
        self._library.check(self._library.cdll.fkda_plan_create(ctypes.byref(desc), ctypes.byref(handle)))
        self._handle = handle
        # The library accepted them, so they are members.
        self._gate_mode = GateMode(desc.gate_mode)
        self._beta_mode = BetaMode(desc.beta_mode)
        self._layer_step = bool(desc.layer_step)

    # ------------------------------------------------------------ lifetime

    def close(self):
        """Destroys the plan; later calls are no-ops."""
        handle, self._handle = self._handle, None
        # Blocks hold the raw handle: none may outlive it.
        self._blocks = threading.local()
        if handle is not None:
            self._library.check(self._library.cdll.fkda_plan_destroy(handle))

    @property
    def closed(self):
        return self._handle is None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to report to
            pass

    def _live_handle(self):
        if self._handle is None:
            raise invalid_argument("plan: used after close()")
        return self._handle

    # ------------------------------------------------------------- queries

    @property
    def library_path(self):
        return self._library.path

    @property
    def backend(self):
        """The backend the plan resolved to: Backend.CPU or Backend.GPU."""
        handle = self._live_handle()
        if self._backend is None:
            value = ctypes.c_int()
            self._library.check(
                self._library.cdll.fkda_plan_get_backend(handle, ctypes.byref(value))
            )
            self._backend = Backend(value.value)
        return self._backend

    @property
    def gate_mode(self):
        """The GateMode the plan was created with."""
        return self._gate_mode

    @property
    def beta_mode(self):
        """The BetaMode the plan was created with."""
        return self._beta_mode

    @property
    def layer_step(self):
        """Whether the plan was created with layer_step (fwd may take the convolution)."""
        return self._layer_step

    def _backend_memory(self):
        return _arrays.HOST if self.backend == Backend.CPU else _arrays.CUDA

    def get_lower_bound(self):
        """The gate floor; a plan of another gate than "bounded" has none (FlashKDAError)."""
        value = ctypes.c_float()
        self._library.check(
            self._library.cdll.fkda_get_lower_bound(self._live_handle(), ctypes.byref(value))
        )
        return value.value

    def set_lower_bound(self, lower_bound):
        self._library.check(
            self._library.cdll.fkda_set_lower_bound(
                self._live_handle(), _float("lower_bound", lower_bound)
            )
        )

    lower_bound = property(get_lower_bound, set_lower_bound)

    def workspace_size(self, total_tokens, num_seqs):
        """Bytes of workspace fwd needs for `total_tokens` tokens in `num_seqs` sequences."""
        return self._size_query(self._library.cdll.fkda_plan_workspace_size, total_tokens, num_seqs)

    def decode_workspace_size(self, total_tokens, num_seqs):
        """Bytes of workspace decode needs (0 today; later versions may need some)."""
        return self._size_query(
            self._library.cdll.fkda_plan_decode_workspace_size, total_tokens, num_seqs)

    def transitions_workspace_size(self, total_tokens, num_seqs):
        """Bytes of workspace transitions needs for these sizes."""
        return self._size_query(
            self._library.cdll.fkda_plan_transitions_workspace_size, total_tokens, num_seqs)

    def _size_query(self, function, total_tokens, num_seqs):
        value = ctypes.c_size_t()
        self._library.check(
            function(
                self._live_handle(),
                _int64("total_tokens", total_tokens),
                _int64("num_seqs", num_seqs),
                ctypes.byref(value),
            )
        )
        return value.value

    # ------------------------------------------------------- fwd and decode

    def fwd(self, q, k, v, g, beta, scale, out, A_log, dt_bias, initial_state=None,
            final_state=None, cu_seqlens=None, workspace=None, stream=None, *,
            state_pool=None, state_indices=None, has_initial_state=None,
            checkpoint_offsets=None, checkpoints=None, checkpoint_slots=None,
            conv_weight=None, conv_bias=None, conv_state=None, out_gate=None,
            out_norm_weight=None, out_norm_eps=DEFAULT_OUT_NORM_EPS):
        """Runs fkda_fwd, writing `out` (and `final_state`) in place.

        workspace: None allocates one of workspace_size() bytes in the arrays'
        memory from their producer (numpy or torch on the host, torch's or
        CuPy's caching allocator on the device).
        stream: None launches on the current stream of the arrays' producer
        (torch's current stream, CuPy's current stream, the stream of a
        __cuda_array_interface__; the legacy default stream otherwise).
        state_pool ... checkpoint_slots: states in a pool and checkpoints, as
        for flashkda.fwd; the pool and the checkpoints are written in place.
        A_log and dt_bias may be None where the plan's gate_mode allows it.
        conv_weight ... out_norm_eps: the layer step, as for flashkda.fwd;
        the convolution needs a plan created with layer_step=True.
        """
        self._run(FWD, (q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state,
                        cu_seqlens, state_pool, state_indices, has_initial_state,
                        checkpoint_offsets, checkpoints, checkpoint_slots)
                  + _layer.arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight),
                  scale, workspace, stream, out_norm_eps)

    def decode(self, q, k, v, g, beta, scale, out, A_log, dt_bias, state_pool, state_indices,
               num_accepted_tokens=None, cu_seqlens=None, workspace=None, stream=None, *,
               conv_weight=None, conv_bias=None, conv_state=None, out_gate=None,
               out_norm_weight=None, out_norm_eps=DEFAULT_OUT_NORM_EPS):
        """Runs fkda_decode: 1 to 16 tokens per sequence on states in a pool.

        Writes `out` and updates `state_pool` (and `conv_state`) in place;
        workspace and stream as for fwd (see flashkda.decode for the arguments).
        """
        self._run(DECODE, (q, k, v, g, beta, A_log, dt_bias, out, state_pool, state_indices,
                           num_accepted_tokens, cu_seqlens)
                  + _layer.arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight),
                  scale, workspace, stream, out_norm_eps)

    def transitions(self, k, v, g, beta, A_log, dt_bias, transition_m, transition_e,
                    cu_seqlens=None, workspace=None, stream=None):
        """Runs fkda_transitions: each sequence's segment transition, written
        into transition_m [N, H, 128, 128] and transition_e [N, H, 128, 128]
        (f32; KV plans hold the transposes). workspace and stream as for fwd."""
        self._run(TRANSITIONS, (k, v, g, beta, A_log, dt_bias, cu_seqlens, transition_m,
                                transition_e), 0.0, workspace, stream)

    def apply_transitions(self, transition_m, transition_e, final_state, initial_state=None,
                          stream=None):
        """Runs fkda_apply_transitions: transitions [R, N, H, 128, 128] applied
        in order (r = 0 first) to initial_state (None: zeros), into
        final_state (which may be initial_state itself)."""
        self._run(APPLY, (transition_m, transition_e, initial_state, final_state), 0.0, None,
                  stream)

    def _run(self, entry, arrays, scale, workspace, stream, out_norm_eps=None):
        """Launches `entry` on `arrays` (in entry.tensors' order) through this
        thread's argument block for their layout."""
        device, signature, pointers, keep = _launch.describe(
            _launch.producer_of(arrays[0]), entry.tensors, arrays)

        def build():
            self._live_handle()
            views = _launch.views_by_name(entry, arrays)
            # Cached in the plan: holding it back would be a cycle.
            return _launch.ArgumentBlock(entry, self, views, scale, _launch.placement_of(views),
                                         hold_plan=False, out_norm_eps=out_norm_eps)

        blocks = _launch.thread_blocks(self._blocks)
        block = _cached_block(blocks, (entry.function, device, scale, out_norm_eps, signature),
                              build)
        block.launch(pointers, workspace, stream)
        # `keep` holds DLPack capsules (and the like) alive up to here.
        del keep

    # ----------------------------------------------------- prepared launches

    def prepare(self, q, k, v, g, beta, scale, out, A_log, dt_bias, initial_state=None,
                final_state=None, cu_seqlens=None, workspace=None, stream=None, *,
                state_pool=None, state_indices=None, has_initial_state=None,
                checkpoint_offsets=None, checkpoints=None, checkpoint_slots=None,
                conv_weight=None, conv_bias=None, conv_state=None, out_gate=None,
                out_norm_weight=None, out_norm_eps=DEFAULT_OUT_NORM_EPS):
        """Binds fwd's arguments once and returns a callable that launches
        fkda_fwd on them with no Python work beyond the ctypes call.

        The callable keeps the arrays, the workspace and this plan alive and
        reads their memory at every call, so refill the arrays in place to run
        on new data. workspace: None allocates one now (as fwd does). stream:
        None reads the producer's current stream at each call, which is what
        CUDA graph capture needs (torch.cuda.graph captures on its own stream).
        The callable is valid until the plan is closed.
        """
        return self._prepare(FWD, (q, k, v, g, beta, A_log, dt_bias, out, initial_state,
                                   final_state, cu_seqlens, state_pool, state_indices,
                                   has_initial_state, checkpoint_offsets, checkpoints,
                                   checkpoint_slots)
                             + _layer.arrays(conv_weight, conv_bias, conv_state, out_gate,
                                             out_norm_weight),
                             scale, workspace, stream, out_norm_eps)

    def prepare_decode(self, q, k, v, g, beta, scale, out, A_log, dt_bias, state_pool,
                       state_indices, num_accepted_tokens=None, cu_seqlens=None,
                       workspace=None, stream=None, *, conv_weight=None, conv_bias=None,
                       conv_state=None, out_gate=None, out_norm_weight=None,
                       out_norm_eps=DEFAULT_OUT_NORM_EPS):
        """prepare() for decode: a callable launching fkda_decode on bound arrays."""
        return self._prepare(DECODE, (q, k, v, g, beta, A_log, dt_bias, out, state_pool,
                                      state_indices, num_accepted_tokens, cu_seqlens)
                             + _layer.arrays(conv_weight, conv_bias, conv_state, out_gate,
                                             out_norm_weight),
                             scale, workspace, stream, out_norm_eps)

    def _prepare(self, entry, arrays, scale, workspace, stream, out_norm_eps):
        self._live_handle()
        views = _launch.views_by_name(entry, arrays)
        block = _launch.ArgumentBlock(entry, self, views, scale, _launch.placement_of(views),
                                      hold_plan=True, out_norm_eps=out_norm_eps)
        pointers = [view.ptr for view in views.values() if view is not None]
        return _launch.Prepared(block, pointers, views, workspace, stream)


# The argument blocks of flashkda.fwd and flashkda.decode, per thread; their
# plans come from _plans.
_derived_blocks = threading.local()


def run_derived(entry, arrays, scale, lower_bound, null_slot_rule, gate_mode, beta_mode,
                check=None, out_norm_eps=None):
    """Launches `entry` on a shared plan derived from the arguments: the backend
    follows where the arrays live, heads and state dtype entry.plan_shape,
    layer_step whether the call convolves (entry.layer_step); the rest of the
    plan's description is given. out_norm_eps: the layer step's (None: the
    _INIT value).

    check: None, or a function of (arrays, scale, lower_bound) that raises for
    arguments its caller refuses. It runs when an argument block is built, so
    it may only look at what the block's key holds (the arrays' layouts and
    dtypes, the lead array's device, scale and lower_bound), and it is part
    of the key."""
    library = _current_library()
    device, signature, pointers, keep = _launch.describe(
        _launch.producer_of(arrays[0]), entry.tensors, arrays)

    def build():
        if check is not None:
            check(arrays, scale, lower_bound)
        views = _launch.views_by_name(entry, arrays)
        placement = _launch.placement_of(views)
        num_heads, state_dtype = entry.plan_shape(views)
        descriptor = _plans.Descriptor(
            library=library,
            device=placement.device,
            num_heads=_int32("num_heads", num_heads),
            head_dim_k=128,
            head_dim_v=128,
            state_dtype=int(state_dtype),
            state_layout=int(StateLayout.VK),
            backend=int(Backend.GPU if placement.memory == _arrays.CUDA else Backend.CPU),
            lower_bound=_lower_bound(lower_bound),
            null_slot_rule=_enum_value("null_slot_rule", null_slot_rule, _NULL_SLOT_RULE_NAMES),
            gate_mode=_enum_value("gate_mode", gate_mode, _GATE_MODE_NAMES),
            beta_mode=_enum_value("beta_mode", beta_mode, _BETA_MODE_NAMES),
            layer_step=entry.layer_step(views),
        )
        return _launch.ArgumentBlock(entry, _plans.cached_plan(descriptor), views, scale,
                                     placement, hold_plan=True, out_norm_eps=out_norm_eps)

    key = (entry.function, library, device, scale, lower_bound, null_slot_rule, gate_mode, beta_mode,
           out_norm_eps, signature, check)
    block = _cached_block(_launch.thread_blocks(_derived_blocks), key, build)
    block.launch(pointers)
    del keep


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
        final_state=None, cu_seqlens=None, *, state_pool=None, state_indices=None,
        has_initial_state=None, checkpoint_offsets=None, checkpoints=None,
        checkpoint_slots=None, null_slot_rule=NullSlotRule.NEGATIVE,
        gate_mode=GateMode.BOUNDED, beta_mode=BetaMode.LOGITS, conv_weight=None,
        conv_bias=None, conv_state=None, out_gate=None, out_norm_weight=None,
        out_norm_eps=DEFAULT_OUT_NORM_EPS):
    """The KDA forward pass with the arguments of FlashKDA's flash_kda.fwd.

    Writes `out` (and `final_state` when given) in place. Host arrays run on
    the CPU backend, CUDA arrays on the GPU backend, on the current stream of
    their producer. The plan's state dtype follows the states given (f32 when
    there are none). q, k, v, g: [B, T, H, 128] bf16; beta [B, T, H] bf16 or
    f32; A_log [H] and dt_bias [H, 128] f32; states [N, H, 128, 128];
    cu_seqlens [N + 1] int64 or int32.

    The gate and beta forms (keywords; the defaults are FlashKDA's):
      gate_mode  "bounded": lower_bound * sigmoid(exp(A_log) * (g + dt_bias)),
                 A_log and dt_bias may be None (exp(A_log) = 1, dt_bias = 0);
                 "softplus": -exp(A_log) * softplus(g + dt_bias), A_log
                 required, dt_bias may be None, lower_bound None (or -5);
                 "log_decay": g (bf16 or f32) is the log-decay itself, A_log
                 and dt_bias None, lower_bound None (or -5)
      beta_mode  "logits": sigmoid(beta); "probabilities": beta as it is
    (or GateMode and BetaMode members).

    States in a pool, as serving runtimes keep them:
      state_pool         [slots, H, 128, 128] f32 or bf16, updated in place
      state_indices      [N] int32/int64: sequence n starts from
                         state_pool[state_indices[n]] and its final state is
                         written back there; a null index (null_slot_rule:
                         "negative" pads with index < 0, "nonpositive" with
                         index <= 0, keeping slot 0 unused) makes sequence n
                         padding, with zero output rows and no state touched
      has_initial_state  [N] bool/int32/int64: 0 starts sequence n from zeros
      checkpoint_offsets [N, C] int32/int64: token counts (multiples of 16,
                         ascending, negative = none) whose states are written
                         to checkpoints [N, C, H, 128, 128] (bf16 or f32) or
                         to the pool slots checkpoint_slots [N, C]

    The layer step around the recurrence (fkda_layer_step), every part optional:
      conv_weight        q, k and v are then the raw projections, convolved
                         (causal, depthwise, width W in 2..4) and passed
                         through SiLU before the recurrence: (wq, wk, wv),
                         each [H*128, W] (or torch's [H*128, 1, W]), bf16 or
                         f32, or one packed [3*H*128, W] (or [3*H*128, 1, W])
                         split into the three
      conv_bias          (bq, bk, bv) [H*128] each, or one packed [3*H*128],
                         the weights' dtype
      conv_state         (sq, sk, sv) [rows, H*128, Wc] each (Wc = W - 1 or
                         W; rows: sequences, or pool slots with
                         state_indices), or one packed [rows, 3*H*128, Wc];
                         bf16 or f32; the raw inputs before a sequence's
                         first token, read where the sequence reads a
                         recurrent state and updated in place to its last
                         Wc inputs
      out_gate           bf16 [B, T, H, 128]: out = RMSNorm(out) *
                         out_norm_weight * sigmoid(out_gate) per head
      out_norm_weight    [128] bf16 or f32, with out_gate
      out_norm_eps       the RMSNorm's epsilon (1e-5)
    A call with conv_weight runs on a plan created with layer_step = 1.

    Plans and argument blocks are cached by the arguments' layout (shapes,
    strides, dtypes, device), scale, lower_bound, null_slot_rule, gate_mode,
    beta_mode and out_norm_eps, so a repeated call costs reading the data
    pointers, a workspace from the producer's allocator and the C call.
    """
    run_derived(FWD, (q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state,
                      cu_seqlens, state_pool, state_indices, has_initial_state,
                      checkpoint_offsets, checkpoints, checkpoint_slots)
                + _layer.arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight),
                scale, lower_bound, null_slot_rule, gate_mode, beta_mode,
                out_norm_eps=out_norm_eps)


def transitions(k, v, g, beta, A_log, dt_bias, lower_bound, transition_m, transition_e,
                cu_seqlens=None, *, gate_mode=GateMode.BOUNDED, beta_mode=BetaMode.LOGITS):
    """The segment transition of each sequence (fkda_transitions), written in place.

    A sequence's tokens map any state S ([H, 128, 128], V-first) entering them
    to S @ M + E leaving them. k, v, g, beta, A_log, dt_bias, cu_seqlens,
    lower_bound, gate_mode and beta_mode as for flashkda.fwd (no q, no out);
    transition_m and transition_e: f32 [N, H, 128, 128]. Host arrays run on
    the CPU backend, CUDA arrays on the GPU backend.
    """
    run_derived(TRANSITIONS, (k, v, g, beta, A_log, dt_bias, cu_seqlens, transition_m,
                              transition_e),
                0.0, lower_bound, NullSlotRule.NEGATIVE, gate_mode, beta_mode)


def apply_transitions(transition_m, transition_e, final_state, initial_state=None):
    """S <- S @ M_r + E_r for r = 0 .. R-1 (fkda_apply_transitions), per sequence and head.

    transition_m, transition_e: f32 [R, N, H, 128, 128], V-first as
    flashkda.transitions writes them; initial_state [N, H, 128, 128] f32 or
    bf16 (None: zeros); final_state the same shape and dtype, written (may be
    initial_state itself). The state is carried in f32 and rounded once.
    """
    run_derived(APPLY, (transition_m, transition_e, initial_state, final_state),
                0.0, None, NullSlotRule.NEGATIVE, GateMode.BOUNDED, BetaMode.LOGITS)


@dataclass(frozen=True)
class DeviceInfo:
    """fkda_device_info in Python types."""

    driver_loaded: bool
    driver_version: int
    device_count: int
    device: int
    cc_major: int
    cc_minor: int
    has_kernels: bool
    name: str


def query_device(device=-1):
    """fkda_query_device: device `device`, or with -1 the current one (else 0).

    Raises FlashKDAError, naming both versions, with a driver older than
    build_info().min_driver_version."""
    lib = _current_library()
    info = FkdaDeviceInfo.initialized()
    lib.check(lib.cdll.fkda_query_device(_int32("device", device), ctypes.byref(info)))
    return DeviceInfo(
        driver_loaded=bool(info.driver_loaded),
        driver_version=info.driver_version,
        device_count=info.device_count,
        device=info.device,
        cc_major=info.cc_major,
        cc_minor=info.cc_minor,
        has_kernels=bool(info.has_kernels),
        name=info.name.decode("utf-8", "replace"),
    )


@dataclass(frozen=True)
class BuildInfo:
    """fkda_build_info in Python types; versions as cuDriverGetVersion encodes them."""

    cuda_version: int
    min_driver_version: int
    architectures: str


def build_info():
    """fkda_get_build_info: the CUDA version, images and driver floor of the kernels."""
    info = FkdaBuildInfo.initialized()
    lib = _current_library()
    lib.check(lib.cdll.fkda_get_build_info(ctypes.byref(info)))
    return BuildInfo(
        cuda_version=info.cuda_version,
        min_driver_version=info.min_driver_version,
        architectures=info.architectures.decode("ascii"),
    )


def version():
    """fkda_version_string() of the loaded library, e.g. "0.1.0"."""
    return _current_library().cdll.fkda_version_string().decode()


def version_number():
    """fkda_version(): MAJOR * 10000 + MINOR * 100 + PATCH of the loaded library."""
    return int(_current_library().cdll.fkda_version())


def status_string(status):
    """fkda_status_string(): the library's static text for a status."""
    return _current_library().cdll.fkda_status_string(int(status)).decode()


def last_error():
    """fkda_last_error() on this thread (empty after a successful call)."""
    return _current_library().cdll.fkda_last_error().decode("utf-8", "replace")
