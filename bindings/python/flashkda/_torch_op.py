# SPDX-License-Identifier: MIT
"""torch.ops.flashkda.fwd and torch.ops.flashkda.decode: flashkda.fwd and
flashkda.decode as operators of torch's dispatcher.

Registered when flashkda is imported and torch is installed. Through the
dispatcher torch.compile sees a call as one node of its graph instead of an
opaque Python function (no graph break), and knows from the schema which
arguments the call writes and that it writes nothing else, so
functionalization and CUDA graphs order it correctly. The fake kernels do
nothing: the ops return nothing and what they write already exists.
"""

import torch

from ._api import fwd
from ._decode import decode

# (a!), (b!), ... mark the arguments written in place; everything else is read.
# A_log, dt_bias and lower_bound may be None where gate_mode allows it; the
# modes are the strings flashkda.fwd takes. The layer step's conv_weight,
# conv_bias and conv_state are lists of three tensors (q, k, v) or of one
# packed tensor, as flashkda.fwd takes them; conv_state is written.
_LAYER_SCHEMA = (
    "Tensor[]? conv_weight=None, Tensor[]? conv_bias=None, Tensor(z!)[]? conv_state=None, "
    "Tensor? out_gate=None, Tensor? out_norm_weight=None, float out_norm_eps=1e-05"
)
FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) out, "
    "Tensor? A_log, Tensor? dt_bias, float? lower_bound, Tensor? initial_state=None, "
    "Tensor(b!)? final_state=None, Tensor? cu_seqlens=None, *, "
    "Tensor(c!)? state_pool=None, Tensor? state_indices=None, Tensor? has_initial_state=None, "
    "Tensor? checkpoint_offsets=None, Tensor(d!)? checkpoints=None, "
    "Tensor? checkpoint_slots=None, int null_slot_rule=0, str gate_mode='bounded', "
    f"str beta_mode='logits', {_LAYER_SCHEMA}) -> ()"
)
DECODE_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) out, "
    "Tensor? A_log, Tensor? dt_bias, float? lower_bound, Tensor(b!) state_pool, "
    "Tensor state_indices, Tensor? num_accepted_tokens=None, Tensor? cu_seqlens=None, *, "
    f"int null_slot_rule=0, str gate_mode='bounded', str beta_mode='logits', {_LAYER_SCHEMA}) -> ()"
)


def _writes_only_its_outputs(*args, **kwargs):
    return None


for _name, _schema, _kernel in (("fwd", FWD_SCHEMA, fwd), ("decode", DECODE_SCHEMA, decode)):
    torch.library.define(f"flashkda::{_name}", _schema)
    torch.library.impl(f"flashkda::{_name}", ("cpu", "cuda"), _kernel)
    torch.library.register_fake(f"flashkda::{_name}", _writes_only_its_outputs)
