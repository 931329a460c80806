# SPDX-License-Identifier: MIT
"""The layer step's arguments (fkda_layer_step, include/flashkda.h): the
convolution of q, k and v from their raw projections and the gated RMSNorm
of the output, as fwd and decode take them.

The convolution's weights, biases and states come as three arrays (q, k, v)
or as one packed array of 3*H*K channels, which is split here into three
views (no copy, so states are still updated in place):

    conv_weight  [3*H*K, W], or torch's [3*H*K, 1, W]   channels on axis 0
    conv_bias    [3*H*K]                                 channels on axis 0
    conv_state   [rows, 3*H*K, Wc]                       channels on axis 1

A weight of three arrays may be [H*K, 1, W] each too. The three views of a
packed conv state interleave; the library takes them as the channel blocks
of that one tensor.
"""

from ._abi import LAYER_TENSOR_FIELDS
from ._errors import invalid_argument

ABSENT = (None,) * len(LAYER_TENSOR_FIELDS)

# Which axis of each packed array holds the 3*H*K channels.
_CHANNEL_AXIS = {"conv_weight": 0, "conv_bias": 0, "conv_state": 1}


def arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight):
    """The layer step's arrays in LAYER_TENSOR_FIELDS order."""
    if conv_weight is None and conv_bias is None and conv_state is None \
            and out_gate is None and out_norm_weight is None:
        return ABSENT
    weights = tuple(_as_matrix(w) for w in _projections("conv_weight", conv_weight))
    return (weights + _projections("conv_bias", conv_bias)
            + _projections("conv_state", conv_state) + (out_gate, out_norm_weight))


def _projections(name, value):
    """(q, k, v) of one of the convolution's arguments, or three Nones."""
    if value is None:
        return (None, None, None)
    if isinstance(value, (tuple, list)):
        if len(value) == 3:
            return tuple(value)
        if len(value) != 1:
            raise invalid_argument(
                f"{name}: expected three arrays (q, k, v) or one packed array, "
                f"got a sequence of {len(value)}")
        value = value[0]
    if name == "conv_weight":
        value = _as_matrix(value)
    return _split(name, value)


def _split(name, packed):
    axis = _CHANNEL_AXIS[name]
    shape = getattr(packed, "shape", None)
    if shape is None:
        raise invalid_argument(
            f"{name}: {type(packed).__name__} has no shape to split into q, k and v; "
            "pass three arrays")
    if len(shape) <= axis:
        raise invalid_argument(
            f"{name}: a packed array of rank {len(shape)} has no channel axis {axis}")
    channels = int(shape[axis])
    if channels % 3:
        raise invalid_argument(
            f"{name}: {channels} channels on axis {axis} do not split into q, k and v "
            "(expected 3*H*K)")
    third = channels // 3
    lead = (slice(None),) * axis
    try:
        return tuple(packed[lead + (slice(i * third, (i + 1) * third),)] for i in range(3))
    except TypeError:
        raise invalid_argument(
            f"{name}: {type(packed).__name__} cannot be sliced into q, k and v; "
            "pass three arrays") from None


def _as_matrix(weight):
    """torch's [C, 1, W] convolution weight as the [C, W] view the library takes."""
    shape = getattr(weight, "shape", None)
    if shape is not None and len(shape) == 3 and shape[1] == 1:
        return weight[:, 0]
    return weight
