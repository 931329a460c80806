"""Plans, the forward pass and device queries on top of the C ABI."""

import contextlib
import ctypes
import sys
from dataclasses import dataclass

from . import _arrays
from ._abi import (
    Backend,
    Dtype,
    FkdaDecodeArgs,
    FkdaDeviceInfo,
    FkdaFwdArgs,
    FkdaPlanDesc,
    NullSlotRule,
    StateLayout,
)
from ._errors import FlashKDAError, invalid_argument
from ._library import library, load_library

_STATE_DTYPE_NAMES = {"bf16": Dtype.BF16, "bfloat16": Dtype.BF16, "f32": Dtype.F32, "float32": Dtype.F32}
_BACKEND_NAMES = {"auto": Backend.AUTO, "cpu": Backend.CPU, "gpu": Backend.GPU, "cuda": Backend.GPU}
_LAYOUT_NAMES = {"vk": StateLayout.VK, "kv": StateLayout.KV}
_NULL_SLOT_RULE_NAMES = {"negative": NullSlotRule.NEGATIVE, "nonpositive": NullSlotRule.NONPOSITIVE}

# Argument tensors the library writes (a pool is updated in place).
_OUTPUTS = ("out", "final_state", "state_pool", "checkpoints")


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


def _stream_handle(stream):
    """A raw CUstream from an int, a torch stream or a CuPy stream."""
    if stream is None:
        return 0
    for attribute in ("cuda_stream", "ptr", "handle"):
        handle = getattr(stream, attribute, None)
        if isinstance(handle, int):
            return handle
    try:
        return int(stream)
    except (TypeError, ValueError):
        raise invalid_argument(
            f"stream: expected a stream handle, a torch or CuPy stream, got {type(stream).__name__}"
        ) from None


class _Call:
    """The views of one call's arguments.

    Where each array lives is checked by the C library (it asks the driver),
    so mixing host and device arrays is reported there, naming the argument.
    The first array given (q, normally) decides the backend of fwd(), the
    device made current, the launch stream and the workspace's allocator.
    """

    def __init__(self, arrays):
        self.views = {}
        for name, array in arrays.items():
            if array is not None:
                self.views[name] = _arrays.view(name, array)
        self.lead_name = next(iter(self.views), None)
        self.lead = self.views.get(self.lead_name)

    @property
    def memory(self):
        return self.lead.memory if self.lead is not None else None

    def args(self, struct, scale):
        """An FkdaFwdArgs or FkdaDecodeArgs over the views."""
        args = struct.initialized()
        for name, view in self.views.items():
            setattr(args, name, _arrays.tensor_of(name, view, writable=name in _OUTPUTS))
        args.scale = _float("scale", scale)
        return args

    def device_scope(self):
        """Makes the arrays' device current, as the library uses the current context."""
        lead = self.lead
        if lead is None or lead.memory != _arrays.CUDA or lead.device is None:
            return contextlib.nullcontext()
        if lead.framework == "torch":
            return sys.modules["torch"].cuda.device(lead.device)
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            return cupy.cuda.Device(lead.device)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.device(lead.device)
        return contextlib.nullcontext()

    def producer_stream(self):
        """The stream the producer of the lead array currently works on."""
        lead = self.lead
        if lead is None or lead.memory != _arrays.CUDA:
            return 0
        if lead.framework == "torch":
            torch = sys.modules["torch"]
            return torch.cuda.current_stream(lead.device).cuda_stream
        if lead.framework == "cupy":
            return sys.modules["cupy"].cuda.get_current_stream().ptr
        if lead.framework == "cuda_array_interface":
            return _arrays.cuda_array_interface_stream(lead.owner[0])
        return 0

    def allocate_workspace(self, size):
        """A workspace of `size` bytes in the memory of the arrays, from their producer."""
        lead = self.lead
        torch = sys.modules.get("torch")
        if lead.memory == _arrays.HOST:
            if lead.framework == "torch":
                return torch.empty(size, dtype=torch.uint8)
            import numpy

            return numpy.empty(size, dtype=numpy.uint8)
        if lead.framework == "torch":
            return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", lead.device))
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            if lead.device is None:
                return cupy.empty(size, dtype=cupy.uint8)
            with cupy.cuda.Device(lead.device):
                return cupy.empty(size, dtype=cupy.uint8)
        if torch is not None and torch.cuda.is_available():
            device = lead.device if lead.device is not None else torch.cuda.current_device()
            return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))
        raise invalid_argument(
            f"workspace: no allocator known for {lead.framework} device arrays; "
            f"pass a device buffer of at least {size} bytes"
        )


def _tokens_and_sequences(call):
    """(total_tokens, num_seqs) as fkda_plan_workspace_size wants them, or None
    when the shapes are malformed (fkda_fwd then reports what is wrong)."""
    q = call.views.get("q")
    if q is None or len(q.shape) != 4:
        return None
    batch, seq_len = q.shape[0], q.shape[1]
    cu_seqlens = call.views.get("cu_seqlens")
    if cu_seqlens is None:
        return batch * seq_len, batch
    if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
        return None
    return batch * seq_len, cu_seqlens.shape[0] - 1


class Plan:
    """An fkda_plan_t: configuration, backend, lower_bound and workspace sizing.

    Use as a context manager or call close(); a plan that is garbage collected
    while open is destroyed then. A plan is not to be used by several threads
    at once.
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
        library_path=None,
    ):
        self._handle = None
        self._library = load_library(library_path) if library_path is not None else library()
        desc = FkdaPlanDesc.initialized()
        desc.num_heads = _int32("num_heads", num_heads)
        desc.head_dim_k = _int32("head_dim_k", head_dim_k)
        desc.head_dim_v = _int32("head_dim_v", head_dim_v)
        desc.state_dtype = _enum_value("state_dtype", state_dtype, _STATE_DTYPE_NAMES)
        desc.state_layout = _enum_value("state_layout", state_layout, _LAYOUT_NAMES)
        desc.backend = _enum_value("backend", backend, _BACKEND_NAMES)
        desc.lower_bound = _float("lower_bound", lower_bound)
        desc.null_slot_rule = _enum_value("null_slot_rule", null_slot_rule, _NULL_SLOT_RULE_NAMES)
        desc.debug_checks = 1 if debug_checks else 0
        handle = ctypes.c_void_p()
        self._library.check(self._library.cdll.fkda_plan_create(ctypes.byref(desc), ctypes.byref(handle)))
        self._handle = handle

    # ------------------------------------------------------------ lifetime

    def close(self):
        """Destroys the plan; later calls are no-ops."""
        handle, self._handle = self._handle, None
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
        value = ctypes.c_int()
        self._library.check(
            self._library.cdll.fkda_plan_get_backend(self._live_handle(), ctypes.byref(value))
        )
        return Backend(value.value)

    def get_lower_bound(self):
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

    # ------------------------------------------------------------- forward

    def fwd(
        self,
        q,
        k,
        v,
        g,
        beta,
        scale,
        out,
        A_log,
        dt_bias,
        initial_state=None,
        final_state=None,
        cu_seqlens=None,
        workspace=None,
        stream=None,
        *,
        state_pool=None,
        state_indices=None,
        has_initial_state=None,
        checkpoint_offsets=None,
        checkpoints=None,
        checkpoint_slots=None,
    ):
        """Runs fkda_fwd, writing `out` (and `final_state`) in place.

        workspace: None allocates one of workspace_size() bytes in the arrays'
        memory (numpy or torch on the host, torch or CuPy on the device).
        stream: None launches on the current stream of the arrays' producer
        (torch.cuda.current_stream(), CuPy's current stream, the stream of a
        __cuda_array_interface__; the legacy default stream otherwise).
        state_pool ... checkpoint_slots: states in a pool and checkpoints, as
        for flashkda.fwd; the pool and the checkpoints are written in place.
        """
        call = _Call(
            {
                "q": q, "k": k, "v": v, "g": g, "beta": beta, "out": out,
                "A_log": A_log, "dt_bias": dt_bias, "initial_state": initial_state,
                "final_state": final_state, "cu_seqlens": cu_seqlens,
                "state_pool": state_pool, "state_indices": state_indices,
                "has_initial_state": has_initial_state,
                "checkpoint_offsets": checkpoint_offsets, "checkpoints": checkpoints,
                "checkpoint_slots": checkpoint_slots,
            }
        )
        self._enqueue(call, call.args(FkdaFwdArgs, scale), self._library.cdll.fkda_fwd,
                      self.workspace_size, workspace, stream)

    def decode(
        self,
        q,
        k,
        v,
        g,
        beta,
        scale,
        out,
        A_log,
        dt_bias,
        state_pool,
        state_indices,
        num_accepted_tokens=None,
        cu_seqlens=None,
        workspace=None,
        stream=None,
    ):
        """Runs fkda_decode: 1 to 16 tokens per sequence on states in a pool.

        Writes `out` and updates `state_pool` in place; workspace and stream
        as for fwd (see flashkda.decode for the arguments).
        """
        call = _Call(
            {
                "q": q, "k": k, "v": v, "g": g, "beta": beta, "out": out,
                "A_log": A_log, "dt_bias": dt_bias, "state_pool": state_pool,
                "state_indices": state_indices, "num_accepted_tokens": num_accepted_tokens,
                "cu_seqlens": cu_seqlens,
            }
        )
        self._enqueue(call, call.args(FkdaDecodeArgs, scale), self._library.cdll.fkda_decode,
                      self.decode_workspace_size, workspace, stream)

    def _enqueue(self, call, args, function, workspace_size, workspace, stream):
        """Calls `function` (fkda_fwd or fkda_decode) with `args`, a workspace
        sized by `workspace_size` unless one is given, on the right stream."""
        handle = self._live_handle()
        backend_memory = _arrays.HOST if self.backend == Backend.CPU else _arrays.CUDA
        # Arrays in the wrong memory for the plan are fkda_fwd's to report, by
        # name, before anything about the workspace.
        arrays_fit_the_plan = call.lead is not None and call.lead.memory == backend_memory

        workspace_owner = workspace
        allocated_here = False
        if workspace is None and arrays_fit_the_plan:
            sizes = _tokens_and_sequences(call)
            size = 0
            if sizes is not None:
                try:
                    size = workspace_size(*sizes)
                except FlashKDAError:
                    size = 0  # the call itself names the malformed argument
            if size:
                workspace_owner = call.allocate_workspace(size)
                allocated_here = True
        workspace_ptr, workspace_bytes = 0, 0
        if workspace_owner is not None:
            workspace_view = _arrays.view("workspace", workspace_owner)
            # fkda_fwd checks the workspace's size and alignment, not where it lives.
            if arrays_fit_the_plan and workspace_view.memory != backend_memory:
                runs = "the CPU backend" if backend_memory == _arrays.HOST else "the GPU backend"
                raise invalid_argument(
                    f"workspace: is in {workspace_view.where()} but the plan runs on {runs}"
                )
            workspace_ptr, workspace_bytes = _arrays.buffer_of("workspace", workspace_view)

        with call.device_scope():
            stream_handle = (
                _stream_handle(stream) if stream is not None else call.producer_stream()
            )
            status = function(
                handle,
                ctypes.byref(args),
                workspace_ptr or None,
                workspace_bytes,
                stream_handle or None,
            )
            launched_elsewhere = (allocated_here and stream is not None and status == 0
                                  and call.lead.framework == "torch"
                                  and call.lead.memory == _arrays.CUDA)
            if launched_elsewhere:
                # torch hands a freed block out again on the stream it was
                # allocated on; recording the launch stream keeps it reserved
                # until the work queued there is done.
                torch = sys.modules["torch"]
                workspace_owner.record_stream(
                    torch.cuda.ExternalStream(stream_handle, device=call.lead.device))
        # `call` keeps every array (and DLPack capsule) alive up to here.
        self._library.check(status)


def temporary_plan(call, states, lower_bound, null_slot_rule):
    """A plan for one call of the module-level functions: the backend follows
    where the arrays live, the head count q (or A_log), the state dtype the
    first of `states` ({name: array or None}) given (f32 when none)."""
    backend = Backend.GPU if call.memory == _arrays.CUDA else Backend.CPU
    num_heads = 1
    if call.views.get("q") is not None and len(call.views["q"].shape) == 4:
        num_heads = call.views["q"].shape[2]
    elif call.views.get("A_log") is not None and len(call.views["A_log"].shape) == 1:
        num_heads = call.views["A_log"].shape[0]
    state_dtype = Dtype.F32
    given = [name for name, state in states.items() if state is not None]
    if given and call.views[given[0]].dtype == Dtype.BF16:
        # Any dtype but bf16 and f32 is the call's to report, by name.
        state_dtype = Dtype.BF16
    return Plan(num_heads, state_dtype=state_dtype, backend=backend, lower_bound=lower_bound,
                null_slot_rule=null_slot_rule)


def fwd(
    q,
    k,
    v,
    g,
    beta,
    scale,
    out,
    A_log,
    dt_bias,
    lower_bound,
    initial_state=None,
    final_state=None,
    cu_seqlens=None,
    *,
    state_pool=None,
    state_indices=None,
    has_initial_state=None,
    checkpoint_offsets=None,
    checkpoints=None,
    checkpoint_slots=None,
    null_slot_rule=NullSlotRule.NEGATIVE,
):
    """The KDA forward pass with the arguments of FlashKDA's flash_kda.fwd.

    Writes `out` (and `final_state` when given) in place. Host arrays run on
    the CPU backend, CUDA arrays on the GPU backend, on the current stream of
    their producer. The plan's state dtype follows the states given (f32 when
    there are none). q, k, v, g: [B, T, H, 128] bf16; beta [B, T, H] bf16;
    A_log [H] and dt_bias [H, 128] f32; states [N, H, 128, 128]; cu_seqlens
    [N + 1] int64 or int32.

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
    """
    call = _Call({"q": q, "A_log": A_log, "initial_state": initial_state,
                  "final_state": final_state, "state_pool": state_pool})
    states = {"initial_state": initial_state, "final_state": final_state, "state_pool": state_pool}
    with temporary_plan(call, states, lower_bound, null_slot_rule) as plan:
        plan.fwd(
            q, k, v, g, beta, scale, out, A_log, dt_bias,
            initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens,
            state_pool=state_pool, state_indices=state_indices,
            has_initial_state=has_initial_state, checkpoint_offsets=checkpoint_offsets,
            checkpoints=checkpoints, checkpoint_slots=checkpoint_slots,
        )


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
    """fkda_query_device: device `device`, or with -1 the current one (else 0)."""
    lib = library()
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


def version():
    """fkda_version_string() of the loaded library, e.g. "0.2.0"."""
    return library().cdll.fkda_version_string().decode()


def version_number():
    """fkda_version(): MAJOR * 10000 + MINOR * 100 + PATCH of the loaded library."""
    return int(library().cdll.fkda_version())


def status_string(status):
    """fkda_status_string(): the library's static text for a status."""
    return library().cdll.fkda_status_string(int(status)).decode()


def last_error():
    """fkda_last_error() on this thread (empty after a successful call)."""
    return library().cdll.fkda_last_error().decode("utf-8", "replace")
