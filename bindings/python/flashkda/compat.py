# SPDX-License-Identifier: MIT
"""FlashKDA's Python API (the `flash_kda` package) on top of libflashkda.

    fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
        initial_state=None, final_state=None, cu_seqlens=None)
    get_workspace_size(T_total, H, N=1)

fwd takes FlashKDA's arguments with FlashKDA's defaults and refuses what
FlashKDA refuses (torch tensors only, all on one device and contiguous; bf16
q, k, v, g, beta and out; f32 A_log [H] and dt_bias [H, 128]; a numeric
lower_bound; bf16 or f32 states of one dtype; int64 cu_seqlens with B == 1),
with messages of its own. Refusals raise CompatError, which is both a
flashkda.FlashKDAError and the RuntimeError FlashKDA raises; arguments of the
wrong type raise CompatTypeError (a TypeError). Besides CUDA tensors it runs
CPU tensors, on the library's CPU backend.

register_as_flash_kda() makes `import flash_kda` and
`importlib.util.find_spec("flash_kda")` resolve to a module holding fwd and
get_workspace_size, so packages that look for FlashKDA (FLA's chunk_kda,
SGLang's flashkda backend) use libflashkda without a change. Nothing is
registered unless it is called; importing flashkda or flashkda.compat alone
changes no import.
"""

import importlib.abc
import importlib.util
import sys
import threading

import torch

from . import _api
from ._abi import Backend, BetaMode, Dtype, GateMode, NullSlotRule, StateLayout, Status
from ._errors import FlashKDAError
from ._library import library as _current_library

ALIAS = "flash_kda"

__all__ = [
    "ALIAS",
    "CompatError",
    "CompatTypeError",
    "fwd",
    "get_workspace_size",
    "register_as_flash_kda",
]


class CompatError(FlashKDAError, RuntimeError):
    """A call FlashKDA would refuse, or one the library refused (FlashKDA's
    refusals are RuntimeErrors)."""


class CompatTypeError(FlashKDAError, TypeError):
    """An argument of a type FlashKDA does not take (None for A_log, dt_bias
    or lower_bound, something that is no torch tensor)."""


def _refuse(message):
    return CompatError(Status.INVALID_ARGUMENT, f"flash_kda.fwd: {message}")


def _wrong_type(message):
    return CompatTypeError(Status.INVALID_ARGUMENT, f"flash_kda.fwd: {message}")


_REQUIRED = ("q", "k", "v", "g", "beta", "out", "A_log", "dt_bias")
_OPTIONAL = ("initial_state", "final_state", "cu_seqlens")
_BF16 = ("q", "k", "v", "g", "beta", "out")
_F32 = ("A_log", "dt_bias")


def _number(name, value):
    """A float from a number; None and non-numbers are type errors, as in FlashKDA."""
    if value is None:
        raise _wrong_type(f"{name}: expected a number, got None")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _wrong_type(f"{name}: expected a number, got {type(value).__name__}") from None


def _check(arrays, scale, lower_bound):
    """Raises, naming the argument, for every call FlashKDA's fwd refuses and
    libflashkda would take (arrays in fwd's order, as _FWD_ARRAYS names
    them); the library checks the rest (shapes of q, k, v, g, beta, out and
    the states, head size 128, lower_bound's range).

    Run when a call's argument block is built, so once per layout: what it
    reads (types, shapes, strides, dtypes, q's device, scale, lower_bound) is
    the block's key. Where the other tensors live is checked by the library at
    every call; fwd then runs this again for FlashKDA's message."""
    tensors = dict(zip(_FWD_ARRAYS, arrays))
    for name in _REQUIRED:
        if not isinstance(tensors[name], torch.Tensor):
            raise _wrong_type(f"{name}: expected a torch.Tensor, got {type(tensors[name]).__name__}")
    for name in _OPTIONAL:
        value = tensors[name]
        if value is not None and not isinstance(value, torch.Tensor):
            raise _wrong_type(
                f"{name}: expected a torch.Tensor or None, got {type(value).__name__}")
    _number("scale", scale)
    _number("lower_bound", lower_bound)

    q = tensors["q"]
    device = q.device
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if tensor.device != device:
            raise _refuse(f"{name}: on {tensor.device}, but q is on {device} "
                          "(all tensors must be on one device)")
        if name != "cu_seqlens" and not tensor.is_contiguous():
            raise _refuse(f"{name}: must be contiguous (shape {list(tensor.shape)}, "
                          f"strides {list(tensor.stride())})")

    for name in _BF16:
        if tensors[name].dtype != torch.bfloat16:
            raise _refuse(f"{name}: must be bfloat16, got {tensors[name].dtype}")
    for name in _F32:
        if tensors[name].dtype != torch.float32:
            raise _refuse(f"{name}: must be float32, got {tensors[name].dtype}")

    if q.dim() != 4:
        raise _refuse(f"q: must be [B, T, H, K], got shape {list(q.shape)}")
    batch, _, heads, dim = q.shape
    A_log, dt_bias = tensors["A_log"], tensors["dt_bias"]
    if list(A_log.shape) != [heads]:
        raise _refuse(f"A_log: must be [H] = [{heads}], got shape {list(A_log.shape)}")
    if list(dt_bias.shape) != [heads, dim]:
        raise _refuse(f"dt_bias: must be [H, K] = [{heads}, {dim}], "
                      f"got shape {list(dt_bias.shape)}")

    states = [(name, tensors[name]) for name in ("initial_state", "final_state")
              if tensors[name] is not None]
    for name, state in states:
        if state.dtype not in (torch.bfloat16, torch.float32):
            raise _refuse(f"{name}: must be bfloat16 or float32, got {state.dtype}")
    if len(states) == 2 and states[0][1].dtype != states[1][1].dtype:
        raise _refuse(f"initial_state ({states[0][1].dtype}) and final_state "
                      f"({states[1][1].dtype}) must have one dtype")

    cu_seqlens = tensors["cu_seqlens"]
    if cu_seqlens is not None:
        if cu_seqlens.dtype != torch.int64:
            raise _refuse(f"cu_seqlens: must be int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise _refuse(f"cu_seqlens: must be [N + 1] with N >= 1, "
                          f"got shape {list(cu_seqlens.shape)}")
        if batch != 1:
            raise _refuse(f"q: with cu_seqlens the batch must be 1, got B = {batch}")


# fwd's arrays in the order of flashkda.fwd's launch path, which also takes
# the pool and checkpoint arguments and the layer step's (absent here).
_FWD_ARRAYS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "out", "initial_state",
               "final_state", "cu_seqlens")
_NO_POOL = (None,) * (len(_api.FWD.tensors) - len(_FWD_ARRAYS))


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
        final_state=None, cu_seqlens=None):
    """FlashKDA's forward pass: writes `out` (and `final_state`) in place.

    q, k, g [B, T, H, 128], v and out [B, T, H, 128], beta [B, T, H]: bf16.
    A_log [H] and dt_bias [H, 128]: f32. lower_bound in [-5, 0]. States
    [N, H, 128, 128] (value axis before key axis), bf16 or f32; N is B, or
    len(cu_seqlens) - 1 with B == 1. Runs on the tensors' device, on torch's
    current stream; the workspace comes from torch's allocator. A repeated
    call of the same layout costs what flashkda.fwd costs: the checks above
    run once per layout.
    """
    arrays = (q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens)
    try:
        _api.run_derived(_api.FWD, arrays + _NO_POOL, scale, lower_bound, NullSlotRule.NEGATIVE,
                         GateMode.BOUNDED, BetaMode.LOGITS, check=_check)
    except (CompatError, CompatTypeError):
        raise
    except FlashKDAError as error:
        _check(arrays, scale, lower_bound)  # FlashKDA's refusal, where it has one, comes first
        raise CompatError(error.status, f"flash_kda.fwd: {error.message}",
                          error.status_text) from None


# Plans that answer workspace queries, by (library, heads, backend); None
# where the backend cannot be had (no GPU).
_sizing_plans = {}
_sizing_lock = threading.Lock()


def _sizing_plan(library, heads, backend):
    key = (library, heads, backend)
    with _sizing_lock:
        if key not in _sizing_plans:
            try:
                plan = _api.Plan(heads, state_dtype=Dtype.F32, state_layout=StateLayout.VK,
                                 backend=backend, library=library)
            except FlashKDAError:
                if backend == Backend.CPU:
                    raise
                plan = None
            _sizing_plans[key] = plan
        return _sizing_plans[key]


def _count(name, value, least):
    try:
        number = int(value.__index__())
    except (AttributeError, TypeError):
        raise CompatTypeError(Status.INVALID_ARGUMENT, f"get_workspace_size: {name}: expected "
                              f"an integer, got {type(value).__name__}") from None
    if number < least:
        raise CompatError(Status.INVALID_ARGUMENT,
                          f"get_workspace_size: {name}: must be >= {least}, got {number}")
    return number


def get_workspace_size(T_total, H, N=1):
    """Bytes of workspace fwd needs for T_total tokens of H heads in N
    sequences, on whichever backend the call runs (the larger of the CPU
    backend's and, where a GPU is usable, the GPU backend's need).

    fwd allocates its workspace itself; this answers callers that reserve
    memory ahead, as FlashKDA's get_workspace_size does.
    """
    T_total = _count("T_total", T_total, 0)
    H = _count("H", H, 1)
    N = _count("N", N, 0)
    library = _current_library()
    sizes = [plan.workspace_size(T_total, N)
             for plan in (_sizing_plan(library, H, Backend.CPU),
                          _sizing_plan(library, H, Backend.GPU))
             if plan is not None]
    return max(sizes)


# ------------------------------------------------------------ the alias ---


class _AliasImporter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads `flash_kda` as a module of this one's functions."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS:
            return None
        return importlib.util.spec_from_loader(ALIAS, self, origin=__file__)

    def create_module(self, spec):
        return None  # a plain module object

    def exec_module(self, module):
        module.__doc__ = (
            "FlashKDA's Python API served by libflashkda (flashkda.compat): fwd and "
            "get_workspace_size.")
        module.fwd = fwd
        module.get_workspace_size = get_workspace_size
        module.__all__ = ["fwd", "get_workspace_size"]
        module.__flashkda_compat__ = True


_importer = _AliasImporter()
_register_lock = threading.Lock()


def _is_ours(module):
    return getattr(module, "__flashkda_compat__", False) is True


def register_as_flash_kda(replace=False):
    """Makes `import flash_kda` give FlashKDA's API served by libflashkda.

    Installs a finder at the front of sys.meta_path, so `import flash_kda`
    and importlib.util.find_spec("flash_kda") resolve to it (with a proper
    __spec__), and returns the imported module. Calling it again is harmless.

    A real flash_kda that can be imported (or already is) is left alone and
    this raises RuntimeError, unless replace=True: then the alias shadows it
    from now on (a copy already imported is dropped from sys.modules; modules
    holding a reference to it keep it).
    """
    with _register_lock:
        loaded = sys.modules.get(ALIAS)
        if _importer in sys.meta_path and (loaded is None or _is_ours(loaded)):
            return importlib.import_module(ALIAS)
        if not replace:
            if loaded is not None and not _is_ours(loaded):
                where = getattr(loaded, "__file__", None) or "an unknown location"
                raise RuntimeError(
                    f"register_as_flash_kda: a flash_kda package is already imported (from "
                    f"{where}); pass replace=True to serve flash_kda from libflashkda instead")
            if loaded is None:
                try:
                    spec = importlib.util.find_spec(ALIAS)
                except (ImportError, ValueError):
                    spec = None
                if spec is not None and spec.loader is not _importer:
                    where = spec.origin or ", ".join(spec.submodule_search_locations or []) \
                        or "an unknown location"
                    raise RuntimeError(
                        f"register_as_flash_kda: a flash_kda package is installed (at {where}); "
                        "pass replace=True to serve flash_kda from libflashkda instead, or "
                        "uninstall it")
        if loaded is not None and not _is_ours(loaded):
            del sys.modules[ALIAS]
        if _importer in sys.meta_path:
            sys.meta_path.remove(_importer)
        sys.meta_path.insert(0, _importer)
        importlib.invalidate_caches()
        return importlib.import_module(ALIAS)
