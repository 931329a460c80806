# SPDX-License-Identifier: MIT
"""One rank of the context-parallel tests (test_distributed.py): builds the
test's problem from its seed, runs flashkda.distributed.context_parallel_fwd
on this rank's slice over a gloo group and saves what it wrote.

    python cp_worker.py RANK WORLD_SIZE INIT_FILE CASE_JSON OUT_DIR
"""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

import flashkda
from flashkda.distributed import context_parallel_fwd

from cp_problems import build_problem


def main():
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, case, out_dir = sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        p = build_problem(case)
        device = torch.device(case.get("device", "cpu"))
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)  # the ranks share the first GPU
            torch.cuda.set_device(device)
            p = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in p.items()}
        begin, end = case["rank_offsets"][rank], case["rank_offsets"][rank + 1]
        part = slice(begin, end)
        out = torch.full((1, end - begin, p["H"], 128), float("nan"), dtype=torch.bfloat16, device=device)
        final_state = None
        if case.get("final_state"):
            final_state = torch.full_like(p["initial_state"] if p["initial_state"] is not None
                                          else torch.empty(p["N"], p["H"], 128, 128,
                                                           dtype=p["state_dtype"], device=device), float("nan"))
        pool = p["state_pool"]
        states = (dict(state_pool=pool, state_indices=p["state_indices"],
                       has_initial_state=p["has_initial_state"]) if pool is not None
                  else dict(initial_state=p["initial_state"], final_state=final_state))
        context_parallel_fwd(
            p["q"][:, part], p["k"][:, part], p["v"][:, part], p["g"][:, part], p["beta"][:, part],
            p["scale"], out, p["A_log"], p["dt_bias"], p["lower_bound"], **states,
            cu_seqlens=case.get("cu_seqlens"),
            rank_offsets=None if case.get("equal_split") else case["rank_offsets"],
            gate_mode=p["gate_mode"])
        np.save(f"{out_dir}/out{rank}.npy", out.float().cpu().numpy())
        if final_state is not None:
            np.save(f"{out_dir}/final{rank}.npy", final_state.float().cpu().numpy())
        if pool is not None:
            np.save(f"{out_dir}/pool{rank}.npy", pool.float().cpu().numpy())
    finally:
        dist.destroy_process_group()
    assert flashkda.version()


if __name__ == "__main__":
    main()
