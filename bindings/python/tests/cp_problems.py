# SPDX-License-Identifier: MIT
"""Random problems of the context-parallel tests, rebuilt identically in
every rank's process from a case description (test_distributed.py)."""

import numpy as np
import torch


def build_problem(case):
    """torch CPU tensors of one packed row of case["total"] tokens: slow
    decays (g ~ N(-6, 1) at lower_bound -5, or the softplus gate), initial
    state ~ N(0, 1)."""
    rng = np.random.default_rng(case["seed"])
    heads, total = case["H"], case["total"]
    cu = case.get("cu_seqlens") or [0, total]
    num_seqs = len(cu) - 1

    def bf16(*shape, mean=0.0, std=1.0):
        return torch.from_numpy(rng.normal(mean, std, shape).astype(np.float32)).to(torch.bfloat16)

    softplus = case.get("gate_mode") == "softplus"
    problem = dict(H=heads, N=num_seqs, scale=128 ** -0.5)
    problem["q"] = bf16(1, total, heads, 128)
    problem["k"] = bf16(1, total, heads, 128)
    problem["v"] = bf16(1, total, heads, 128)
    problem["g"] = bf16(1, total, heads, 128, mean=0.0 if softplus else -6.0)
    problem["beta"] = bf16(1, total, heads)
    if softplus:
        problem["A_log"] = torch.from_numpy(np.log(rng.uniform(1, 16, heads)).astype(np.float32))
        x = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), (heads, 128)))
        problem["dt_bias"] = torch.from_numpy(np.log(np.expm1(x)).astype(np.float32))
        problem["lower_bound"] = None
        problem["gate_mode"] = "softplus"
    else:
        problem["A_log"] = torch.from_numpy(rng.uniform(0, 1, heads).astype(np.float32))
        problem["dt_bias"] = torch.from_numpy(rng.uniform(0, 1, (heads, 128)).astype(np.float32))
        problem["lower_bound"] = -5.0
        problem["gate_mode"] = "bounded"
    state_dtype = torch.bfloat16 if case.get("state_dtype") == "bf16" else torch.float32
    problem["state_dtype"] = state_dtype
    initial = rng.normal(0, 1, (num_seqs, heads, 128, 128)).astype(np.float32)
    problem["initial_state"] = (torch.from_numpy(initial).to(state_dtype)
                                if case.get("initial_state", True) else None)
    problem["state_pool"] = None
    if "state_indices" in case:
        slots = max(case["state_indices"]) + 2
        pool = rng.normal(0, 1, (slots, heads, 128, 128)).astype(np.float32)
        problem["state_pool"] = torch.from_numpy(pool).to(state_dtype)
        problem["state_indices"] = case["state_indices"]
        problem["has_initial_state"] = case["has_initial_state"]
    return problem
