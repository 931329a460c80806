# SPDX-License-Identifier: MIT
"""flashkda.distributed: a context-parallel prefill over gloo, 2 and 4 ranks in
separate processes, against the same call in one process (flashkda.fwd on
all the tokens) and the fp64 recurrence."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import flashkda  # noqa: E402
from flashkda.distributed import make_layout  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from cp_problems import build_problem  # noqa: E402
from kda_testing import kda_recurrence_fp64, rel_l2  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BINDINGS = os.path.dirname(HERE)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def run_ranks(case, tmp_path):
    """Runs every rank in a process of its own; returns (out, final_state) as
    the ranks wrote them: out concatenated, final_state rows from the ranks
    that wrote them (NaN where none did)."""
    world_size = len(case["rank_offsets"]) - 1
    init_file = tmp_path / "rendezvous"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([BINDINGS, HERE, env.get("PYTHONPATH", "")])
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    processes = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "cp_worker.py"), str(rank),
                          str(world_size), str(init_file), json.dumps(case), str(tmp_path)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank in range(world_size)
    ]
    logs = []
    for process in processes:
        output, _ = process.communicate(timeout=300)
        logs.append(output.decode(errors="replace"))
    for rank, process in enumerate(processes):
        assert process.returncode == 0, f"rank {rank} failed:\n{logs[rank]}"
    out = np.concatenate([np.load(tmp_path / f"out{rank}.npy") for rank in range(world_size)], axis=1)
    final_state = None
    if case.get("final_state"):
        parts = [np.load(tmp_path / f"final{rank}.npy") for rank in range(world_size)]
        final_state = np.full_like(parts[0], np.nan)
        writers = np.zeros(parts[0].shape[0], dtype=int)
        for part in parts:
            written = ~np.isnan(part).any(axis=(1, 2, 3))
            final_state[written] = part[written]
            writers += written
        # Exactly one rank writes each sequence's final state.
        assert list(writers) == [1] * len(writers)
    return out, final_state


def single_process(case):
    p = build_problem(case)
    device = torch.device(case.get("device", "cpu"))
    moved = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in p.items()}
    out = torch.full((1, case["total"], p["H"], 128), float("nan"), dtype=torch.bfloat16, device=device)
    final_state = torch.full((p["N"], p["H"], 128, 128), float("nan"), dtype=p["state_dtype"], device=device)
    cu = case.get("cu_seqlens")
    flashkda.fwd(moved["q"], moved["k"], moved["v"], moved["g"], moved["beta"], p["scale"], out, moved["A_log"],
                 moved["dt_bias"], p["lower_bound"], initial_state=moved["initial_state"],
                 final_state=final_state,
                 cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int64, device=device),
                 gate_mode=p["gate_mode"])
    return out.float().cpu().numpy(), final_state.float().cpu().numpy(), p


CASES = {
    # One sequence cut across 2 ranks, equal slices.
    "2 ranks, one sequence": dict(seed=1, H=2, total=160, rank_offsets=[0, 80, 160],
                                  equal_split=True, final_state=True),
    # Varlen across 4 ranks: a sequence spanning three ranks, cuts inside
    # chunks, an empty sequence on a boundary, a rank inside one sequence.
    "4 ranks, varlen": dict(seed=2, H=2, total=230, rank_offsets=[0, 37, 101, 101, 230],
                            cu_seqlens=[0, 20, 150, 150, 171, 230], final_state=True),
    "4 ranks, varlen, bf16 state": dict(seed=3, H=2, total=200, rank_offsets=[0, 50, 100, 150, 200],
                                        cu_seqlens=[0, 9, 140, 200], final_state=True,
                                        state_dtype="bf16", equal_split=True),
    "2 ranks, softplus gate, no initial state": dict(seed=4, H=1, total=120, rank_offsets=[0, 70, 120],
                                                     cu_seqlens=[0, 100, 120], final_state=True,
                                                     initial_state=False, gate_mode="softplus"),
}


# The same cases with CUDA tensors: two ranks sharing one GPU over gloo
# (ranks on GPUs of their own over NCCL use the same code, with the
# collective on device memory).
GPU_CASES = {f"{name}, CUDA": dict(case, device="cuda") for name, case in CASES.items()
             if len(case["rank_offsets"]) == 3}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", sorted(CASES) + [pytest.param(n, marks=needs_cuda) for n in sorted(GPU_CASES)])
def test_context_parallel_matches_one_process(name, tmp_path):
    case = CASES.get(name) or GPU_CASES[name]
    out, final_state = run_ranks(case, tmp_path)
    expected_out, expected_state, p = single_process(case)
    assert np.isfinite(out).all()
    bf16_state = case.get("state_dtype") == "bf16"
    # Same library on the same inputs: only the composition's rounding differs.
    assert rel_l2(out, expected_out) < 2e-3
    assert rel_l2(final_state, expected_state) < (5e-3 if bf16_state else 1e-3)
    # And both are as accurate as the library is.
    initial = None if p["initial_state"] is None else p["initial_state"].float().numpy()
    ref_out, ref_state = kda_recurrence_fp64(
        p["q"].float().numpy(), p["k"].float().numpy(), p["v"].float().numpy(),
        p["g"].float().numpy(), p["beta"].float().numpy(), p["A_log"].numpy(), p["dt_bias"].numpy(),
        p["scale"], -5.0 if p["lower_bound"] is None else p["lower_bound"], initial_state=initial,
        cu_seqlens=case.get("cu_seqlens"), gate_mode=p["gate_mode"])
    print(f"{name}: context-parallel out {rel_l2(out, ref_out):.2e} state {rel_l2(final_state, ref_state):.2e}; "
          f"one process out {rel_l2(expected_out, ref_out):.2e} state {rel_l2(expected_state, ref_state):.2e}")
    assert rel_l2(out, ref_out) < 3e-3
    assert rel_l2(final_state, ref_state) < (2e-3 if bf16_state else 1e-3)


def test_broken_order_is_detected(tmp_path):
    """The check above fails when a rank applies the earlier ranks'
    transitions without their E (a dropped E): the same comparison, on the
    composition done by hand in one process."""
    case = CASES["4 ranks, varlen"]
    p = build_problem(case)
    cu = case["cu_seqlens"]
    # Sequence 1 spans ranks 0..3: its state entering rank 2 from ranks 0, 1.
    n, begin = 1, cu[1]
    pieces = [(begin, 37), (37, 101)]
    ms, es = [], []
    for lo, hi in pieces:
        m = torch.empty(1, p["H"], 128, 128)
        e = torch.empty(1, p["H"], 128, 128)
        flashkda.transitions(p["k"][:, lo:hi], p["v"][:, lo:hi], p["g"][:, lo:hi], p["beta"][:, lo:hi],
                             p["A_log"], p["dt_bias"], p["lower_bound"], m, e)
        ms.append(m)
        es.append(e)
    initial = p["initial_state"][n:n + 1].clone()
    _, expected = kda_recurrence_fp64(
        p["q"][:, begin:101].float().numpy(), p["k"][:, begin:101].float().numpy(),
        p["v"][:, begin:101].float().numpy(), p["g"][:, begin:101].float().numpy(),
        p["beta"][:, begin:101].float().numpy(), p["A_log"].numpy(), p["dt_bias"].numpy(),
        p["scale"], -5.0, initial_state=initial.numpy())

    def entering(order, drop_e=False):
        m = torch.stack([ms[i] for i in order])
        e = torch.stack([es[i] * (0 if drop_e else 1) for i in order])
        state = torch.full_like(initial, float("nan"))
        flashkda.apply_transitions(m, e, state, initial)
        return state.numpy()

    assert rel_l2(entering([0, 1]), expected) < 1e-3
    assert rel_l2(entering([1, 0]), expected) > 1e-2  # wrong composition order
    assert rel_l2(entering([0, 1], drop_e=True), expected) > 1e-2  # dropped E


def test_layout_pieces():
    layout = make_layout(0, 4, 2, cu_seqlens=[0, 20, 150, 150, 171, 230],
                         rank_offsets=[0, 37, 101, 101, 230])
    assert [(p.seq, p.begin, p.end) for p in layout.pieces(0)] == [(0, 0, 20), (1, 20, 37)]
    assert [(p.seq, p.begin, p.end) for p in layout.pieces(1)] == [(1, 0, 64)]
    assert layout.pieces(2) == []
    assert [(p.seq, p.begin, p.end) for p in layout.pieces(3)] == [(1, 0, 49), (2, 49, 49), (3, 49, 70),
                                                                   (4, 70, 129)]
    assert layout.ranks_before(3, layout.pieces(3)[0]) == [0, 1]
    with pytest.raises(flashkda.FlashKDAError, match="cu_seqlens"):
        make_layout(10, 2, 0, cu_seqlens=[0, 5, 30])
    with pytest.raises(flashkda.FlashKDAError, match="q: rank 1"):
        make_layout(10, 2, 1, rank_offsets=[0, 12, 20])


def test_context_parallel_pool(tmp_path):
    """States in a pool: each rank's copy gets the final states of the
    sequences whose last token it holds, and no other slot changes; padding
    sequences have zero output and touch no slot."""
    case = dict(seed=5, H=2, total=180, rank_offsets=[0, 45, 90, 135, 180],
                cu_seqlens=[0, 60, 100, 170, 180], equal_split=True,
                state_indices=[3, -1, 0, 5], has_initial_state=[1, 1, 0, 1])
    out, _ = run_ranks(case, tmp_path)
    p = build_problem(case)
    pools = [np.load(tmp_path / f"pool{rank}.npy") for rank in range(4)]
    original = p["state_pool"].float().numpy()
    expected_pool = p["state_pool"].clone()
    expected_out = torch.full((1, case["total"], p["H"], 128), float("nan"), dtype=torch.bfloat16)
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], p["scale"], expected_out, p["A_log"],
                 p["dt_bias"], p["lower_bound"], cu_seqlens=torch.tensor(case["cu_seqlens"]),
                 state_pool=expected_pool, state_indices=torch.tensor(case["state_indices"]),
                 has_initial_state=torch.tensor(case["has_initial_state"], dtype=torch.bool))
    assert np.isfinite(out).all()
    assert rel_l2(out, expected_out.float().numpy()) < 2e-3
    assert (out[:, 60:100] == 0).all()  # sequence 1 is padding
    cu, ranks = case["cu_seqlens"], case["rank_offsets"]
    for n, slot in enumerate(case["state_indices"]):
        if slot < 0:
            continue
        owner = next(r for r in range(4) if ranks[r] < cu[n + 1] <= ranks[r + 1])
        assert rel_l2(pools[owner][slot], expected_pool[slot].float().numpy()) < 1e-3, n
        for rank in range(4):
            if rank != owner:
                assert np.array_equal(pools[rank][slot], original[slot])
    untouched = [s for s in range(original.shape[0]) if s not in case["state_indices"]]
    for rank in range(4):
        assert np.array_equal(pools[rank][untouched], original[untouched])
