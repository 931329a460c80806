# SPDX-License-Identifier: MIT
"""ctypes mirrors of include/flashkda.h: constants, structs and prototypes.

Everything here follows the header field for field; tests/test_abi.py compares
the layouts with a compiled C program and the prototypes with the header.
"""

import ctypes
import enum

MAX_RANK = 6

# C enums are passed as int.
c_enum = ctypes.c_int


class Status(enum.IntEnum):
    SUCCESS = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED = 2
    NO_DEVICE = 3
    DRIVER = 4
    UNSUPPORTED_ARCH = 5
    WORKSPACE_TOO_SMALL = 6
    LAUNCH_FAILED = 7
    OUT_OF_MEMORY = 8
    INTERNAL = 9


class Dtype(enum.IntEnum):
    INVALID = 0
    BF16 = 1
    F16 = 2
    F32 = 3
    I32 = 4
    I64 = 5
    BOOL = 6


class Backend(enum.IntEnum):
    AUTO = 0
    CPU = 1
    GPU = 2


class StateLayout(enum.IntEnum):
    VK = 0
    KV = 1


class NullSlotRule(enum.IntEnum):
    NEGATIVE = 0
    NONPOSITIVE = 1


class GateMode(enum.IntEnum):
    """How a token's decay is formed from g (fkda_gate_mode, 0.3)."""

    BOUNDED = 0  # lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
    SOFTPLUS = 1  # -exp(A_log) * softplus(g + dt_bias)
    LOG_DECAY = 2  # g is the log-decay itself


class BetaMode(enum.IntEnum):
    """How beta becomes the delta rule's step size (fkda_beta_mode, 0.3)."""

    LOGITS = 0  # sigmoid(beta)
    PROBABILITIES = 1  # beta as it is, clamped into [0, 1]


class ChunkParallel(enum.IntEnum):
    """Whether GPU prefill cuts long sequences into parallel segments
    (fkda_chunk_parallel, 0.4; fkda_plan_desc.chunk_parallel)."""

    AUTO = 0
    OFF = 1
    ON = 2


class FkdaTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_RANK),
        ("strides", ctypes.c_int64 * MAX_RANK),
    ]


class FkdaPlanDesc(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_heads", ctypes.c_int32),
        ("head_dim_k", ctypes.c_int32),
        ("head_dim_v", ctypes.c_int32),
        ("state_dtype", ctypes.c_int32),
        ("state_layout", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("lower_bound", ctypes.c_float),
        ("null_slot_rule", ctypes.c_int32),
        ("debug_checks", ctypes.c_int32),
        ("gate_mode", ctypes.c_int32),
        ("beta_mode", ctypes.c_int32),
        ("vsplit", ctypes.c_int32),
        ("chunk_parallel", ctypes.c_int32),
        ("window_slots", ctypes.c_int64),
        ("segment_chunks", ctypes.c_int64),
        ("layer_step", ctypes.c_int32),
    ]

    @classmethod
    def initialized(cls):
        """The values of FKDA_PLAN_DESC_INIT."""
        return cls(
            struct_size=ctypes.sizeof(cls),
            num_heads=0,
            head_dim_k=128,
            head_dim_v=128,
            state_dtype=Dtype.F32,
            state_layout=StateLayout.VK,
            backend=Backend.AUTO,
            lower_bound=-5.0,
            null_slot_rule=NullSlotRule.NEGATIVE,
            debug_checks=0,
            gate_mode=GateMode.BOUNDED,
            beta_mode=BetaMode.LOGITS,
            vsplit=0,
            chunk_parallel=ChunkParallel.AUTO,
            window_slots=0,
            segment_chunks=0,
            layer_step=0,
        )


DEFAULT_SCALE = 0.08838834764831845  # 128^-0.5, the _INIT macros' scale
DEFAULT_OUT_NORM_EPS = 1e-5  # FKDA_LAYER_STEP_INIT's out_norm_eps

# Tensor fields before and after `scale` (the 0.2 pool fields follow it).
FWD_TENSOR_FIELDS = (
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "out",
    "initial_state", "final_state", "cu_seqlens",
)
FWD_POOL_TENSOR_FIELDS = (
    "state_pool", "state_indices", "has_initial_state",
    "checkpoint_offsets", "checkpoints", "checkpoint_slots",
)
DECODE_TENSOR_FIELDS = (
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "out",
    "state_pool", "state_indices", "num_accepted_tokens", "cu_seqlens",
)
TRANSITION_TENSOR_FIELDS = (
    "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "transition_m", "transition_e",
)
APPLY_TENSOR_FIELDS = ("transition_m", "transition_e", "initial_state", "final_state")
# The tensors of fkda_layer_step (0.5), the member `layer` of the fwd and decode args.
LAYER_TENSOR_FIELDS = (
    "conv_weight_q", "conv_weight_k", "conv_weight_v",
    "conv_bias_q", "conv_bias_k", "conv_bias_v",
    "conv_state_q", "conv_state_k", "conv_state_v",
    "out_gate", "out_norm_weight",
)


def _tensor_fields(names):
    return [(name, FkdaTensor) for name in names]


class FkdaLayerStep(ctypes.Structure):
    _fields_ = _tensor_fields(LAYER_TENSOR_FIELDS) + [
        ("out_norm_eps", ctypes.c_float),
        ("reserved", ctypes.c_int32),
    ]

    @classmethod
    def initialized(cls):
        """The values of FKDA_LAYER_STEP_INIT: every tensor absent."""
        return cls(out_norm_eps=DEFAULT_OUT_NORM_EPS)


class FkdaFwdArgs(ctypes.Structure):
    _fields_ = (
        [("struct_size", ctypes.c_size_t)]
        + _tensor_fields(FWD_TENSOR_FIELDS)
        + [("scale", ctypes.c_float)]
        + _tensor_fields(FWD_POOL_TENSOR_FIELDS)
        + [("layer", FkdaLayerStep)]
    )

    @classmethod
    def initialized(cls):
        """The values of FKDA_FWD_ARGS_INIT: every tensor absent."""
        return cls(struct_size=ctypes.sizeof(cls), scale=DEFAULT_SCALE,
                   layer=FkdaLayerStep.initialized())


class FkdaDecodeArgs(ctypes.Structure):
    _fields_ = (
        [("struct_size", ctypes.c_size_t)]
        + _tensor_fields(DECODE_TENSOR_FIELDS)
        + [("scale", ctypes.c_float), ("layer", FkdaLayerStep)]
    )

    @classmethod
    def initialized(cls):
        """The values of FKDA_DECODE_ARGS_INIT: every tensor absent."""
        return cls(struct_size=ctypes.sizeof(cls), scale=DEFAULT_SCALE,
                   layer=FkdaLayerStep.initialized())


def tensor_offset(struct, name):
    """Byte offset in `struct` of the fkda_tensor field `name`, also one of
    the member `layer` (LAYER_TENSOR_FIELDS)."""
    if name in LAYER_TENSOR_FIELDS:
        return struct.layer.offset + getattr(FkdaLayerStep, name).offset
    return getattr(struct, name).offset


def set_tensor(args, name, tensor):
    """Sets the fkda_tensor field `name` of an argument struct (see tensor_offset)."""
    setattr(args.layer if name in LAYER_TENSOR_FIELDS else args, name, tensor)


class FkdaTransitionArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + _tensor_fields(TRANSITION_TENSOR_FIELDS)

    @classmethod
    def initialized(cls):
        """The values of FKDA_TRANSITION_ARGS_INIT: every tensor absent."""
        return cls(struct_size=ctypes.sizeof(cls))


class FkdaApplyArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + _tensor_fields(APPLY_TENSOR_FIELDS)

    @classmethod
    def initialized(cls):
        """The values of FKDA_APPLY_ARGS_INIT: every tensor absent."""
        return cls(struct_size=ctypes.sizeof(cls))


class FkdaDeviceInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("driver_loaded", ctypes.c_int32),
        ("driver_version", ctypes.c_int32),
        ("device_count", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("cc_major", ctypes.c_int32),
        ("cc_minor", ctypes.c_int32),
        ("has_kernels", ctypes.c_int32),
        ("name", ctypes.c_char * 256),
    ]

    @classmethod
    def initialized(cls):
        """The values of FKDA_DEVICE_INFO_INIT."""
        return cls(struct_size=ctypes.sizeof(cls), device=-1)


class FkdaLaunchReport(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("vsplit", ctypes.c_int64),
        ("windows", ctypes.c_int64),
        ("slots_per_window", ctypes.c_int64),
        ("chunk_parallel", ctypes.c_int64),
        ("segment_chunks", ctypes.c_int64),
    ]

    @classmethod
    def initialized(cls):
        """The values of FKDA_LAUNCH_REPORT_INIT."""
        return cls(struct_size=ctypes.sizeof(cls))


class FkdaBuildInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("cuda_version", ctypes.c_int32),
        ("min_driver_version", ctypes.c_int32),
        ("architectures", ctypes.c_char * 64),
    ]

    @classmethod
    def initialized(cls):
        """The values of FKDA_BUILD_INFO_INIT."""
        return cls(struct_size=ctypes.sizeof(cls))


plan_handle = ctypes.c_void_p
stream_handle = ctypes.c_void_p

# name -> (restype, argtypes), in header order.
PROTOTYPES = {
    "fkda_status_string": (ctypes.c_char_p, [c_enum]),
    "fkda_last_error": (ctypes.c_char_p, []),
    "fkda_version": (ctypes.c_uint32, []),
    "fkda_version_string": (ctypes.c_char_p, []),
    "fkda_plan_create": (c_enum, [ctypes.POINTER(FkdaPlanDesc), ctypes.POINTER(plan_handle)]),
    "fkda_plan_destroy": (c_enum, [plan_handle]),
    "fkda_plan_get_backend": (c_enum, [plan_handle, ctypes.POINTER(c_enum)]),
    "fkda_set_lower_bound": (c_enum, [plan_handle, ctypes.c_float]),
    "fkda_get_lower_bound": (c_enum, [plan_handle, ctypes.POINTER(ctypes.c_float)]),
    "fkda_plan_workspace_size": (
        c_enum,
        [plan_handle, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "fkda_fwd": (
        c_enum,
        [plan_handle, ctypes.POINTER(FkdaFwdArgs), ctypes.c_void_p, ctypes.c_size_t, stream_handle],
    ),
    "fkda_plan_decode_workspace_size": (
        c_enum,
        [plan_handle, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "fkda_decode": (
        c_enum,
        [plan_handle, ctypes.POINTER(FkdaDecodeArgs), ctypes.c_void_p, ctypes.c_size_t,
         stream_handle],
    ),
    "fkda_plan_transitions_workspace_size": (
        c_enum,
        [plan_handle, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "fkda_transitions": (
        c_enum,
        [plan_handle, ctypes.POINTER(FkdaTransitionArgs), ctypes.c_void_p, ctypes.c_size_t,
         stream_handle],
    ),
    "fkda_apply_transitions": (
        c_enum,
        [plan_handle, ctypes.POINTER(FkdaApplyArgs), ctypes.c_void_p, ctypes.c_size_t,
         stream_handle],
    ),
    "fkda_query_device": (c_enum, [ctypes.c_int32, ctypes.POINTER(FkdaDeviceInfo)]),
    "fkda_plan_get_launch_report": (c_enum, [plan_handle, ctypes.POINTER(FkdaLaunchReport)]),
    "fkda_get_build_info": (c_enum, [ctypes.POINTER(FkdaBuildInfo)]),
}


def declare(cdll):
    """Sets restype and argtypes of every function on a loaded CDLL."""
    for name, (restype, argtypes) in PROTOTYPES.items():
        function = getattr(cdll, name)
        function.restype = restype
        function.argtypes = argtypes
    return cdll
