# SPDX-License-Identifier: MIT
"""Plans shared by the calls that derive them from their arguments.

flashkda.fwd() and flashkda.decode() need a plan for every call; creating one costs a C call and
a destroy. Plans only hold configuration (their lower_bound, gate and beta
modes are part of the key, so a shared plan is never re-bounded), and fkda_fwd on one plan from
several threads is safe, so one plan per descriptor serves every thread.
"""

import threading
from dataclasses import dataclass
from typing import Optional

# Far more descriptors than a process uses; the oldest goes first. Blocks
# still holding an evicted plan keep it alive until they are dropped.
_MAX_PLANS = 64

_lock = threading.Lock()
_plans = {}


@dataclass(frozen=True)
class Descriptor:
    library: object  # the _library.Library the plan is created in
    device: Optional[int]  # CUDA ordinal of the arrays; None for host arrays
    num_heads: int
    head_dim_k: int
    head_dim_v: int
    state_dtype: int
    state_layout: int
    backend: int
    lower_bound: float
    null_slot_rule: int
    gate_mode: int
    beta_mode: int
    layer_step: int = 0


def cached_plan(descriptor):
    """The plan for `descriptor`, created on first use. Raises FlashKDAError
    naming the field when the C library rejects the descriptor."""
    plan = _plans.get(descriptor)
    if plan is not None:
        return plan
    from ._api import Plan

    with _lock:
        plan = _plans.get(descriptor)
        if plan is None:
            plan = Plan(
                descriptor.num_heads,
                head_dim_k=descriptor.head_dim_k,
                head_dim_v=descriptor.head_dim_v,
                state_dtype=descriptor.state_dtype,
                state_layout=descriptor.state_layout,
                backend=descriptor.backend,
                lower_bound=descriptor.lower_bound,
                null_slot_rule=descriptor.null_slot_rule,
                gate_mode=descriptor.gate_mode,
                beta_mode=descriptor.beta_mode,
                layer_step=descriptor.layer_step,
                library=descriptor.library,
            )
            if len(_plans) >= _MAX_PLANS:
                del _plans[next(iter(_plans))]
            _plans[descriptor] = plan
        return plan
