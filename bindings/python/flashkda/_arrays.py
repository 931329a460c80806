# SPDX-License-Identifier: MIT
"""Translating arrays of several libraries into fkda_tensor descriptors.

Supported producers: numpy arrays (host), torch tensors (host or CUDA),
anything with __cuda_array_interface__ (CuPy, Numba, ...), and anything with
__dlpack__ (host or CUDA). The binding only describes memory; dtype, shape and
stride rules are checked by the C library.
"""

import ctypes
import math
import sys
from dataclasses import dataclass
from typing import Optional

from ._abi import MAX_RANK, Dtype, FkdaTensor
from ._errors import invalid_argument

HOST = "host"
CUDA = "cuda"

MEMORY_WORDS = {HOST: "host memory", CUDA: "CUDA device memory"}


@dataclass
class View:
    """Where an array lives and how it is laid out, independent of its producer."""

    ptr: int
    shape: tuple
    byte_strides: tuple
    itemsize: int
    dtype: Optional[Dtype]  # None: no flashkda dtype matches
    dtype_name: str
    readonly: bool
    memory: str  # HOST or CUDA
    device: Optional[int]  # CUDA ordinal when the producer says
    framework: str  # "numpy", "torch", "cupy", "cuda_array_interface", "dlpack"
    owner: object  # kept alive until the call returns

    def where(self):
        if self.memory == CUDA and self.device is not None:
            return f"{MEMORY_WORDS[CUDA]} (device {self.device})"
        return MEMORY_WORDS[self.memory]


# ---------------------------------------------------------------- numpy ---


def _numpy_dtype(np, dtype):
    if dtype.name == "bfloat16" and dtype.itemsize == 2:  # ml_dtypes.bfloat16
        return Dtype.BF16
    table = {
        np.dtype(np.uint16): Dtype.BF16,  # bf16 bit patterns: numpy has no bf16
        np.dtype(np.float16): Dtype.F16,
        np.dtype(np.float32): Dtype.F32,
        np.dtype(np.int32): Dtype.I32,
        np.dtype(np.int64): Dtype.I64,
        np.dtype(np.bool_): Dtype.BOOL,
    }
    return table.get(dtype)


def _view_numpy(name, array):
    import numpy as np

    dtype = array.dtype
    if not dtype.isnative:
        raise invalid_argument(f"{name}: byte order of dtype {dtype.str} is not native")
    return View(
        ptr=array.ctypes.data,
        shape=tuple(array.shape),
        byte_strides=tuple(array.strides),
        itemsize=dtype.itemsize,
        dtype=_numpy_dtype(np, dtype),
        dtype_name=f"numpy {dtype.name}",
        readonly=not array.flags.writeable,
        memory=HOST,
        device=None,
        framework="numpy",
        owner=array,
    )


# ---------------------------------------------------------------- torch ---


def _torch_dtype(torch, dtype):
    table = {
        torch.bfloat16: Dtype.BF16,
        torch.float16: Dtype.F16,
        torch.float32: Dtype.F32,
        torch.int32: Dtype.I32,
        torch.int64: Dtype.I64,
        torch.bool: Dtype.BOOL,
    }
    uint16 = getattr(torch, "uint16", None)
    if uint16 is not None:
        table[uint16] = Dtype.BF16
    return table.get(dtype)


def _view_torch(name, torch, tensor):
    kind = tensor.device.type
    if kind == "cuda":
        memory, device = CUDA, tensor.device.index
    elif kind == "cpu":
        memory, device = HOST, None
    else:
        raise invalid_argument(f"{name}: torch device '{tensor.device}' is neither cpu nor cuda")
    itemsize = tensor.element_size()
    return View(
        ptr=tensor.data_ptr(),
        shape=tuple(tensor.shape),
        byte_strides=tuple(s * itemsize for s in tensor.stride()),
        itemsize=itemsize,
        dtype=_torch_dtype(torch, tensor.dtype),
        dtype_name=str(tensor.dtype),
        readonly=False,
        memory=memory,
        device=device,
        framework="torch",
        owner=tensor,
    )


# ------------------------------------------------- CUDA array interface ---

_TYPESTR_DTYPES = {
    "u2": Dtype.BF16,  # bf16 bit patterns, as for numpy
    "V2": Dtype.BF16,  # how bf16 producers without a bf16 typestr spell it
    "f2": Dtype.F16,
    "f4": Dtype.F32,
    "i4": Dtype.I32,
    "i8": Dtype.I64,
    "b1": Dtype.BOOL,
}


def _contiguous_byte_strides(shape, itemsize):
    strides = []
    step = itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(int(extent), 1)
    return tuple(reversed(strides))


def _view_cuda_array_interface(name, array):
    interface = array.__cuda_array_interface__
    if interface.get("mask") is not None:
        raise invalid_argument(f"{name}: masked CUDA arrays are not supported")
    typestr = interface["typestr"]
    byteorder, code = typestr[0], typestr[1:]
    if byteorder == ">" or (byteorder == "<" and sys.byteorder != "little"):
        raise invalid_argument(f"{name}: byte order of typestr '{typestr}' is not native")
    itemsize = int(code[1:])
    shape = tuple(int(extent) for extent in interface["shape"])
    strides = interface.get("strides")
    byte_strides = (
        tuple(int(s) for s in strides)
        if strides is not None
        else _contiguous_byte_strides(shape, itemsize)
    )
    ptr, readonly = interface["data"]
    device = None
    producer_device = getattr(array, "device", None)
    if producer_device is not None and isinstance(getattr(producer_device, "id", None), int):
        device = producer_device.id  # CuPy
    framework = "cupy" if type(array).__module__.split(".")[0] == "cupy" else "cuda_array_interface"
    return View(
        ptr=int(ptr or 0),
        shape=shape,
        byte_strides=byte_strides,
        itemsize=itemsize,
        dtype=_TYPESTR_DTYPES.get(code),
        dtype_name=f"typestr {typestr}",
        readonly=bool(readonly),
        memory=CUDA,
        device=device,
        framework=framework,
        owner=(array, interface),
    )


def cuda_array_interface_stream(view_):
    """The stream a __cuda_array_interface__ view's producer says its data is
    valid on, or None for other producers.

    1 and 2 are CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, valid stream handles
    for the driver; None (no synchronisation needed) becomes the legacy default.
    """
    if view_.framework != "cuda_array_interface":
        return None
    stream = view_.owner[1].get("stream")
    return int(stream) if stream else 0


# --------------------------------------------------------------- DLPack ---

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6

_DLPACK_DTYPES = {
    (_DL_BFLOAT, 16): Dtype.BF16,
    (_DL_UINT, 16): Dtype.BF16,  # bit patterns, as for numpy
    (_DL_FLOAT, 16): Dtype.F16,
    (_DL_FLOAT, 32): Dtype.F32,
    (_DL_INT, 32): Dtype.I32,
    (_DL_INT, 64): Dtype.I64,
    (_DL_BOOL, 8): Dtype.BOOL,
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _capsule_pointer(capsule):
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get_pointer(capsule, b"dltensor")


def _view_dlpack(name, array):
    device_type, device_id = array.__dlpack_device__()
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        memory, device = HOST, None
    elif device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        memory, device = CUDA, int(device_id)
    else:
        raise invalid_argument(f"{name}: DLPack device type {device_type} is neither CPU nor CUDA")
    # Without a stream argument a CUDA producer orders its work before the
    # legacy default stream, the stream this call then uses for DLPack inputs.
    capsule = array.__dlpack__()
    # Not renamed to "used_dltensor": the capsule keeps ownership and calls the
    # producer's deleter when it is collected, after the call has returned.
    tensor = _DLTensor.from_address(_capsule_pointer(capsule))
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    bits = tensor.dtype.bits
    itemsize = max(bits // 8, 1)
    if tensor.strides:
        byte_strides = tuple(tensor.strides[i] * itemsize for i in range(ndim))
    else:
        byte_strides = _contiguous_byte_strides(shape, itemsize)
    dtype = None
    if tensor.dtype.lanes == 1:
        dtype = _DLPACK_DTYPES.get((tensor.dtype.code, bits))
    return View(
        ptr=(tensor.data or 0) + tensor.byte_offset,
        shape=shape,
        byte_strides=byte_strides,
        itemsize=itemsize,
        dtype=dtype,
        dtype_name=f"DLPack code {tensor.dtype.code} bits {bits} lanes {tensor.dtype.lanes}",
        readonly=False,
        memory=memory,
        device=device,
        framework="dlpack",
        owner=(array, capsule),
    )


# ---------------------------------------------------------------- entry ---


def view(name, array):
    """Describes `array`'s memory, or raises FlashKDAError naming `name`."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(array, numpy.ndarray):
        return _view_numpy(name, array)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        return _view_torch(name, torch, array)
    if hasattr(array, "__cuda_array_interface__"):
        return _view_cuda_array_interface(name, array)
    if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
        return _view_dlpack(name, array)
    raise invalid_argument(
        f"{name}: {type(array).__module__}.{type(array).__qualname__} is not an array "
        "(expected a numpy array, a torch tensor, or an object with "
        "__cuda_array_interface__ or __dlpack__)"
    )


def tensor_of(name, view_, writable):
    """The fkda_tensor for a view; the C library checks dtype, shape and strides."""
    if view_.dtype is None:
        raise invalid_argument(
            f"{name}: dtype {view_.dtype_name} has no flashkda dtype "
            "(bf16 as bf16/uint16, f16, f32, i32, i64, bool)"
        )
    rank = len(view_.shape)
    if rank > MAX_RANK:
        raise invalid_argument(f"{name}: rank {rank} exceeds the maximum of {MAX_RANK}")
    if writable and view_.readonly:
        raise invalid_argument(f"{name}: array is read-only but is written")
    strides = []
    for axis, byte_stride in enumerate(view_.byte_strides):
        if byte_stride % view_.itemsize:
            raise invalid_argument(
                f"{name}: stride of axis {axis} ({byte_stride} bytes) is not a multiple "
                f"of the element size ({view_.itemsize} bytes)"
            )
        strides.append(byte_stride // view_.itemsize)
    tensor = FkdaTensor()
    tensor.data = view_.ptr or None
    tensor.dtype = int(view_.dtype)
    tensor.rank = rank
    for axis in range(rank):
        tensor.shape[axis] = view_.shape[axis]
        tensor.strides[axis] = strides[axis]
    return tensor


def buffer_of(name, view_):
    """(pointer, bytes) of a contiguous buffer such as a workspace."""
    size = math.prod(view_.shape) if view_.shape else 1
    if size and view_.byte_strides != _contiguous_byte_strides(view_.shape, view_.itemsize):
        # Axes of extent 1 may carry any stride.
        for extent, actual, expected in zip(
            view_.shape,
            view_.byte_strides,
            _contiguous_byte_strides(view_.shape, view_.itemsize),
        ):
            if extent != 1 and actual != expected:
                raise invalid_argument(f"{name}: buffer must be contiguous")
    if view_.readonly:
        raise invalid_argument(f"{name}: buffer is read-only but is written")
    return view_.ptr, size * view_.itemsize
