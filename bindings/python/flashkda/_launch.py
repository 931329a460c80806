# SPDX-License-Identifier: MIT
"""The launch path shared by every entry point of the C ABI.

A call is split into what changes every time (data pointers, the stream, a
workspace from the producer's allocator) and what only changes with the
layout of the arguments (the ctypes argument block with dtypes, shapes and
strides, the workspace size, the plan). The second part is built once per
layout, through the careful path that names a bad argument, and cached; a
call whose layout was seen before writes its pointers into the cached block
and goes straight to the C function, which validates everything again.
"""

import ctypes
import functools
import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Tuple

from . import _arrays
from ._errors import invalid_argument

# Per-thread argument blocks: the C call reads the block while another thread
# could be writing its pointers, so blocks are never shared between threads.
_BLOCKS_PER_THREAD = 256


@dataclass(frozen=True)
class EntryPoint:
    """What the launch path needs to know about one C entry point.

    tensors: the fkda_tensor fields of `struct`, in the order callers pass them.
    workspace: (plan, views by name) -> bytes, or 0 when the shapes are too
    malformed to size it (the C function then names what is wrong).
    plan_shape: views by name -> (num_heads, state dtype) for plans derived
    from the arguments.
    convolution_plan: whether a call given the layer step's convolution
    (conv_weight_q) needs a plan created with layer_step = 1.
    """

    function: str
    struct: type
    tensors: Tuple[str, ...]
    outputs: Tuple[str, ...]
    workspace: Callable
    plan_shape: Callable
    convolution_plan: bool = False

    @functools.cached_property
    def data_slots(self):
        """Index of each tensor's data pointer in the block seen as 64-bit words."""
        from ._abi import FkdaTensor, tensor_offset

        return tuple(
            (tensor_offset(self.struct, name) + FkdaTensor.data.offset) // 8
            for name in self.tensors
        )

    def layer_step(self, views):
        """fkda_plan_desc.layer_step for a plan derived from these arguments."""
        return int(self.convolution_plan and views.get("conv_weight_q") is not None)


# ------------------------------------------------------------ producers ---


class _TorchTensors:
    """torch tensors, described from cheap attributes (no __cuda_array_interface__)."""

    def describe(self, names, arrays):
        """(lead device, layout signature, data pointers, owners to keep alive)."""
        signature = []
        pointers = []
        for array in arrays:
            if array is None:
                signature.append(None)
            else:
                signature.append((array.shape, array.stride(), array.dtype))
                pointers.append(array.data_ptr())
        return arrays[0].get_device(), tuple(signature), pointers, None


class _AnyArrays:
    """numpy, CuPy, __cuda_array_interface__ and DLPack producers, through _arrays.view."""

    def describe(self, names, arrays):
        views = [None if array is None else _arrays.view(name, array)
                 for name, array in zip(names, arrays)]
        signature = tuple(
            None if v is None else (v.shape, v.byte_strides, v.itemsize, v.dtype, v.readonly)
            for v in views
        )
        lead = next((v for v in views if v is not None), None)
        # The stream a __cuda_array_interface__ names belongs to the array, so
        # it is part of the key: a block then launches on the stream it was built for.
        device = None if lead is None else (lead.framework, lead.memory, lead.device,
                                             _arrays.cuda_array_interface_stream(lead))
        pointers = [v.ptr for v in views if v is not None]
        return device, signature, pointers, views


_ANY = _AnyArrays()
_producers = {}


def producer_of(array):
    """The describer for the producer of the lead array, memoised by type."""
    kind = type(array)
    producer = _producers.get(kind)
    if producer is None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(array, torch.Tensor):
            producer = _TorchTensors()
        else:
            producer = _ANY
        _producers[kind] = producer
    return producer


def describe(producer, names, arrays):
    try:
        return producer.describe(names, arrays)
    except (AttributeError, TypeError):
        # Arrays of several producers, or something that is no array: the
        # general path describes each one or names the one it cannot.
        return _ANY.describe(names, arrays)


# ----------------------------------------------- where the arrays live ---


def _stream_handle(stream):
    """A raw CUstream from an int, a torch stream or a CuPy stream."""
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


class _Placement:
    """How to reach the memory of the lead array: its device, the producer's
    current stream, its allocator. Fixed per argument block; it holds no
    array, so a cached block keeps no caller's memory alive."""

    def __init__(self, lead):
        self.memory = lead.memory if lead is not None else None
        self.framework = lead.framework if lead is not None else None
        self.device = lead.device if lead is not None else None
        # Host arrays and producers without a stream notion: the legacy default
        # stream (int() is 0), which CPU plans ignore anyway.
        self.stream = int
        self.current_device = None
        torch = sys.modules.get("torch")
        cupy = sys.modules.get("cupy")
        if self.memory != _arrays.CUDA:
            return
        if self.framework == "torch":
            self.stream = functools.partial(torch._C._cuda_getCurrentRawStream, self.device)
            self.current_device = torch._C._cuda_getDevice
        elif self.framework == "cupy":
            self.stream = lambda: cupy.cuda.get_current_stream().ptr
            self.current_device = cupy.cuda.runtime.getDevice
        elif self.framework == "cuda_array_interface":
            self.stream = functools.partial(int, _arrays.cuda_array_interface_stream(lead))
        if self.current_device is None and self.device is not None:
            if cupy is not None:
                self.current_device = cupy.cuda.runtime.getDevice
            elif torch is not None and torch.cuda.is_available():
                self.current_device = torch.cuda.current_device

    def elsewhere(self):
        """Whether the arrays' device is not the current one (the library
        launches in the current context)."""
        return self.current_device is not None and self.current_device() != self.device

    def device_scope(self):
        """Makes the arrays' device current for a block."""
        if self.framework == "torch" or "cupy" not in sys.modules:
            return sys.modules["torch"].cuda.device(self.device)
        return sys.modules["cupy"].cuda.Device(self.device)

    def allocator(self):
        """A function bytes -> (owner, pointer) in the memory of the arrays, from
        their producer (torch's and CuPy's caching allocators on the device)."""
        torch = sys.modules.get("torch")
        if self.memory == _arrays.HOST:
            if self.framework == "torch":
                return functools.partial(_torch_bytes, torch, torch.device("cpu"))
            return _numpy_bytes
        if self.framework == "torch":
            return functools.partial(_torch_bytes, torch, torch.device("cuda", self.device))
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            return functools.partial(_cupy_bytes, cupy, self.device)
        if torch is not None and torch.cuda.is_available():
            device = self.device if self.device is not None else torch.cuda.current_device()
            return functools.partial(_torch_bytes, torch, torch.device("cuda", device))
        return None


def _torch_bytes(torch, device, size):
    owner = torch.empty(size, dtype=torch.uint8, device=device)
    return owner, owner.data_ptr()


def _numpy_bytes(size):
    import numpy

    owner = numpy.empty(size, dtype=numpy.uint8)
    return owner, owner.ctypes.data


def _cupy_bytes(cupy, device, size):
    if device is None:
        owner = cupy.empty(size, dtype=cupy.uint8)
    else:
        with cupy.cuda.Device(device):
            owner = cupy.empty(size, dtype=cupy.uint8)
    return owner, owner.data.ptr


# ------------------------------------------------------ argument blocks ---


class ArgumentBlock:
    """One entry point's ctypes arguments for one layout, all but the pointers.

    hold_plan: whether the block keeps its plan alive. A block the plan
    itself caches must not (plan -> block -> plan is a cycle, which leaves the
    plan to the garbage collector, on whatever thread it runs); blocks kept
    elsewhere must, since they hold its raw handle.
    """

    def __init__(self, entry, plan, views, scale, placement, hold_plan, out_norm_eps=None):
        """out_norm_eps: the layer step's (fwd and decode); None keeps the
        _INIT value."""
        from ._abi import set_tensor
        from ._api import _float

        self.entry = entry
        self._held_plan = plan if hold_plan else None
        self._plan = weakref.ref(plan)
        self.handle = plan._live_handle()
        self.library = plan._library
        self.function = getattr(plan._library.cdll, entry.function)
        args = entry.struct.initialized()
        for name, view in views.items():
            if view is not None:
                set_tensor(args, name, _arrays.tensor_of(name, view, writable=name in entry.outputs))
        if hasattr(entry.struct, "scale"):
            args.scale = _float("scale", scale)
        if out_norm_eps is not None:
            args.layer.out_norm_eps = _float("out_norm_eps", out_norm_eps)
        self.args = args
        self.args_ref = ctypes.byref(args)
        self.words = memoryview(args).cast("B").cast("Q")
        self.slots = tuple(slot for slot, name in zip(entry.data_slots, entry.tensors)
                           if views[name] is not None)
        self.placement = placement
        backend_memory = plan._backend_memory()
        # Arrays in the wrong memory for the plan are the C function's to
        # report, by name, before anything about the workspace.
        self.fits_plan = placement.memory == backend_memory
        self.workspace_bytes = entry.workspace(plan, views) if self.fits_plan else 0
        self.allocate = placement.allocator() if self.workspace_bytes else None
        if self.workspace_bytes and self.allocate is None:
            raise invalid_argument(
                f"workspace: no allocator known for {placement.framework} device arrays; "
                f"pass a device buffer of at least {self.workspace_bytes} bytes"
            )

    @property
    def plan(self):
        """The block's plan (None once it is gone, for a block it does not hold)."""
        return self._plan()

    def set_pointers(self, pointers):
        words = self.words
        for slot, pointer in zip(self.slots, pointers):
            words[slot] = pointer

    def _workspace(self, workspace):
        """(owner, pointer, bytes) of the workspace for one call."""
        if workspace is None:
            if not self.workspace_bytes:
                return None, 0, 0
            owner, pointer = self.allocate(self.workspace_bytes)
            return owner, pointer, self.workspace_bytes
        view = _arrays.view("workspace", workspace)
        backend_memory = self.plan._backend_memory()
        # fkda_fwd checks the workspace's size and alignment, not where it lives.
        if self.fits_plan and view.memory != backend_memory:
            runs = "the CPU backend" if backend_memory == _arrays.HOST else "the GPU backend"
            raise invalid_argument(f"workspace: is in {view.where()} but the plan runs on {runs}")
        pointer, size = _arrays.buffer_of("workspace", view)
        return view, pointer, size

    def launch(self, pointers, workspace=None, stream=None):
        """Writes the pointers and calls the entry point; raises FlashKDAError."""
        self.set_pointers(pointers)
        owner, workspace_ptr, workspace_bytes = self._workspace(workspace)
        placement = self.placement
        stream_handle = placement.stream() if stream is None else _stream_handle(stream)
        arguments = (self.handle, self.args_ref, workspace_ptr, workspace_bytes, stream_handle)
        if placement.elsewhere():
            with placement.device_scope():
                status = self.function(*arguments)
        else:
            status = self.function(*arguments)
        if status:
            self.library.check(status)
        if stream is not None and workspace is None and owner is not None \
                and placement.framework == "torch" and placement.memory == _arrays.CUDA:
            # torch hands a freed block out again on the stream it was
            # allocated on; recording the launch stream keeps it reserved
            # until the work queued there is done.
            torch = sys.modules["torch"]
            owner.record_stream(torch.cuda.ExternalStream(stream_handle, device=placement.device))


class Prepared:
    """A launch bound to fixed arrays, workspace and plan: calling it runs the
    entry point with nothing in Python but the ctypes call.

    The stream is the one given to prepare(), else the producer's current
    stream read at each call (so a call inside torch.cuda.graph() is captured
    on the capture stream).
    """

    __slots__ = ("_function", "_handle", "_args_ref", "_workspace_ptr", "_workspace_bytes",
                 "_stream", "_check", "_keep")

    def __init__(self, block, pointers, keep, workspace, stream):
        block.set_pointers(pointers)
        owner, workspace_ptr, workspace_bytes = block._workspace(workspace)
        self._function = block.function
        self._handle = block.handle
        self._args_ref = block.args_ref
        self._workspace_ptr = workspace_ptr
        self._workspace_bytes = workspace_bytes
        self._stream = (block.placement.stream if stream is None
                        else functools.partial(int, _stream_handle(stream)))
        self._check = block.library.check
        # The arrays, the workspace and the block (holding its plan) live as
        # long as this object: the C call reads their memory at every launch.
        self._keep = (block, keep, owner)

    @property
    def workspace_bytes(self):
        return self._workspace_bytes

    def __call__(self):
        status = self._function(self._handle, self._args_ref, self._workspace_ptr,
                                self._workspace_bytes, self._stream())
        if status:
            self._check(status)


def thread_blocks(owner):
    """The per-thread dict of argument blocks hanging off `owner` (a threading.local)."""
    blocks = getattr(owner, "blocks", None)
    if blocks is None:
        blocks = owner.blocks = {}
    return blocks


def remember(blocks, key, block):
    if len(blocks) >= _BLOCKS_PER_THREAD:
        del blocks[next(iter(blocks))]
    blocks[key] = block


def views_by_name(entry, arrays):
    return {name: None if array is None else _arrays.view(name, array)
            for name, array in zip(entry.tensors, arrays)}


def placement_of(views):
    """The placement of the first array given (q, normally): it decides the
    backend of derived plans, the device made current, the launch stream and
    the workspace's allocator. Where each other array lives is checked by the
    C library (it asks the driver), which names the argument."""
    lead = next((view for view in views.values() if view is not None), None)
    return _Placement(lead)

