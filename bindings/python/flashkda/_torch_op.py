"""torch.ops.flashkda.fwd: flashkda.fwd as an operator of torch's dispatcher.

Registered when flashkda is imported and torch is installed. Through the
dispatcher torch.compile sees the call as one node of its graph instead of
an opaque Python function (no graph break), and knows from the schema that
the call writes `out` and `final_state` and nothing else, so functionalization
and CUDA graphs order it correctly. The fake kernel does nothing: the op
returns nothing and the outputs it writes already exist with their shapes.
"""

import torch

from ._api import fwd

# (a!) and (b!) mark the arguments written in place; everything else is read.
SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) out, "
    "Tensor A_log, Tensor dt_bias, float lower_bound, Tensor? initial_state=None, "
    "Tensor(b!)? final_state=None, Tensor? cu_seqlens=None) -> ()"
)

torch.library.define("flashkda::fwd", SCHEMA)
torch.library.impl("flashkda::fwd", ("cpu", "cuda"), fwd)


@torch.library.register_fake("flashkda::fwd")
def _writes_only_its_outputs(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                             initial_state=None, final_state=None, cu_seqlens=None):
    return None
