# SPDX-License-Identifier: MIT
"""Python bindings of libflashkda: Kimi Delta Attention forward passes.

A thin ctypes layer over the C ABI of include/flashkda.h: fwd (prefill, with
contiguous states or states in a pool) and decode (a few tokens per sequence on
a pool), segment transitions for context parallelism (transitions,
apply_transitions; flashkda.distributed runs a context-parallel prefill over a
torch.distributed process group), with the gate and beta forms of a plan as keywords (gate_mode:
"bounded", "softplus", "log_decay"; beta_mode: "logits", "probabilities";
GateMode and BetaMode). Host arrays (numpy, torch CPU tensors) run on the CPU reference
backend; CUDA tensors (torch, CuPy, __cuda_array_interface__, DLPack) run on
the GPU backend. numpy has no bf16 dtype: uint16 arrays are taken as bf16 bit patterns (see to_bf16 and
from_bf16), and ml_dtypes.bfloat16 arrays are accepted as they are.
With torch installed, importing flashkda registers torch.ops.flashkda.fwd and
torch.ops.flashkda.decode, the same calls as torch operators (torch.compile,
CUDA graphs).
"""

import importlib.util

from ._abi import (
    Backend,
    BetaMode,
    ChunkParallel,
    Dtype,
    GateMode,
    NullSlotRule,
    StateLayout,
    Status,
)
from ._api import (
    BuildInfo,
    DeviceInfo,
    Plan,
    apply_transitions,
    build_info,
    fwd,
    last_error,
    query_device,
    status_string,
    transitions,
    version,
    version_number,
)
from ._decode import decode
from ._errors import FlashKDAError
from ._library import LIBRARY_ENV, load_library, library_path
from .bf16 import from_bf16, to_bf16

# torch stays optional: without it the package works on numpy, CuPy and DLPack.
if importlib.util.find_spec("torch") is not None:
    from . import _torch_op  # noqa: F401  (registers torch.ops.flashkda.fwd and .decode)

__version__ = "0.5.0"

__all__ = [
    "Backend",
    "BetaMode",
    "BuildInfo",
    "ChunkParallel",
    "DeviceInfo",
    "Dtype",
    "FlashKDAError",
    "GateMode",
    "LIBRARY_ENV",
    "NullSlotRule",
    "Plan",
    "StateLayout",
    "Status",
    "apply_transitions",
    "build_info",
    "decode",
    "from_bf16",
    "fwd",
    "last_error",
    "library_path",
    "load_library",
    "query_device",
    "status_string",
    "to_bf16",
    "transitions",
    "version",
    "version_number",
]
