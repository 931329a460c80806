# SPDX-License-Identifier: MIT
"""The hot path on the CPU backend: shared plans, cached argument blocks and
prepared launches, against the fp64 recurrence."""

import ctypes
import dataclasses
import gc
import os
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import flashkda
from flashkda import FlashKDAError, _api, _launch, _library, _plans
from kda_testing import BF16_NAN, HEAD_DIM, assert_accurate, make_problem


def descriptor(**changes):
    base = _plans.Descriptor(library=_library.library(), device=None, num_heads=3,
                             head_dim_k=HEAD_DIM, head_dim_v=HEAD_DIM,
                             state_dtype=int(flashkda.Dtype.F32),
                             state_layout=int(flashkda.StateLayout.VK),
                             backend=int(flashkda.Backend.CPU), lower_bound=-4.5,
                             null_slot_rule=int(flashkda.NullSlotRule.NEGATIVE),
                             gate_mode=int(flashkda.GateMode.BOUNDED),
                             beta_mode=int(flashkda.BetaMode.LOGITS))
    return dataclasses.replace(base, **changes)


def run(problem, **overrides):
    arguments = dict(problem.arguments(), lower_bound=problem.lower_bound)
    arguments.update(overrides)
    flashkda.fwd(**arguments)


# ------------------------------------------------------------ plan cache ---


def test_same_descriptor_same_plan():
    plan = _plans.cached_plan(descriptor())
    assert _plans.cached_plan(descriptor()) is plan
    assert plan.get_lower_bound() == -4.5 and plan.backend == flashkda.Backend.CPU


@pytest.mark.parametrize("change", [
    dict(device=0), dict(num_heads=4), dict(state_dtype=int(flashkda.Dtype.BF16)),
    dict(state_layout=int(flashkda.StateLayout.KV)), dict(backend=int(flashkda.Backend.AUTO)),
    dict(lower_bound=-1.0), dict(null_slot_rule=int(flashkda.NullSlotRule.NONPOSITIVE)),
    dict(gate_mode=int(flashkda.GateMode.SOFTPLUS), lower_bound=-5.0),
    dict(beta_mode=int(flashkda.BetaMode.PROBABILITIES)), dict(layer_step=1),
], ids=lambda change: next(iter(change)))
def test_any_other_field_another_plan(change):
    assert _plans.cached_plan(descriptor(**change)) is not _plans.cached_plan(descriptor())


def test_another_library_another_plan():
    other = _library._open(flashkda.library_path(), "loaded again by the test")
    plan = _plans.cached_plan(descriptor(library=other))
    assert plan is not _plans.cached_plan(descriptor())
    assert plan._library is other


def test_rejected_descriptor_is_not_cached():
    for _ in range(2):
        with pytest.raises(FlashKDAError) as caught:
            _plans.cached_plan(descriptor(head_dim_k=64))
        assert caught.value.status == flashkda.Status.UNSUPPORTED
    assert descriptor(head_dim_k=64) not in _plans._plans


def test_plan_cache_is_safe_under_threads(monkeypatch):
    created = []
    original = _api.Plan.__init__

    def counting(self, *args, **kwargs):
        created.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(_api.Plan, "__init__", counting)
    wanted = descriptor(lower_bound=-3.25, num_heads=7)
    start = threading.Barrier(8)
    seen = [[] for _ in range(8)]

    def worker(results):
        start.wait()
        for _ in range(200):
            results.append(_plans.cached_plan(wanted))

    threads = [threading.Thread(target=worker, args=(results,)) for results in seen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(created) == 1
    assert all(plan is created[0] for results in seen for plan in results)


# -------------------------------------------------------- argument blocks ---


def test_same_layout_reuses_the_block_with_new_pointers(rng, block_builds):
    first = make_problem(rng, batch=1, seq_len=24, heads=2)
    second = make_problem(rng, batch=1, seq_len=24, heads=2)
    run(first)
    for problem in (second, first):
        problem.poison_outputs()
        run(problem)
        assert_accurate(problem)
    assert len(block_builds) == 1


def test_layout_changes_rebuild_the_block(rng, block_builds):
    problems = [
        make_problem(rng, batch=1, seq_len=24, heads=2),
        make_problem(rng, batch=1, seq_len=31, heads=2),  # shape
        make_problem(rng, batch=2, seq_len=31, heads=2),
        make_problem(rng, batch=1, seq_len=31, heads=2, state_dtype=np.uint16),  # dtype
        make_problem(rng, seq_lens=[9, 22], heads=2),  # cu_seqlens present
        make_problem(rng, batch=1, seq_len=24, heads=2, with_initial_state=False),
    ]
    for problem in problems:
        problem.poison_outputs()
        run(problem)
        assert_accurate(problem)
    assert len(block_builds) == len(problems)
    # Strides: the same values as a view with a wider head axis.
    problem = problems[0]
    wide = np.zeros(problem.q.shape[:2] + (4, HEAD_DIM), dtype=np.uint16)
    q_view = wide[:, :, 1:3]
    q_view[...] = problem.q
    problem.poison_outputs()
    run(problem, q=q_view)
    assert_accurate(problem)
    assert len(block_builds) == len(problems) + 1


def test_lower_bound_changes_take_effect(rng, block_builds):
    problem = make_problem(rng, batch=1, seq_len=40, heads=2)
    results = {}
    for lower_bound in (-5.0, -0.5, -5.0):
        problem.lower_bound = lower_bound
        problem.poison_outputs()
        run(problem)
        assert_accurate(problem)
        results.setdefault(lower_bound, []).append(problem.out.copy())
    assert not np.array_equal(results[-5.0][0], results[-0.5][0])
    np.testing.assert_array_equal(results[-5.0][0], results[-5.0][1])
    assert len(block_builds) == 2


def test_scale_changes_take_effect(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=1)
    run(problem)
    assert_accurate(problem)
    problem.scale = 0.5 * HEAD_DIM ** -0.5
    problem.poison_outputs()
    run(problem)
    assert_accurate(problem)


def test_errors_still_name_the_argument_after_caching(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    run(problem)
    problem.out.flags.writeable = False
    with pytest.raises(FlashKDAError) as caught:
        run(problem)
    assert caught.value.message.startswith("out:")
    problem.out.flags.writeable = True
    with pytest.raises(FlashKDAError) as caught:
        run(problem, scale=float("inf"))
    assert caught.value.message.startswith("scale:")
    with pytest.raises(FlashKDAError) as caught:
        run(problem, lower_bound=[-5.0])
    assert caught.value.message.startswith("lower_bound:")
    with pytest.raises(FlashKDAError) as caught:
        run(problem, k=problem.k[:, :-1])
    assert caught.value.message.startswith("k:")


def test_cached_blocks_keep_no_array_alive(rng):
    problem = make_problem(rng, batch=1, seq_len=22, heads=2)
    run(problem)
    watched = [weakref.ref(getattr(problem, name)) for name in ("q", "out", "final_state")]
    del problem
    gc.collect()
    assert all(reference() is None for reference in watched)


def test_threads_running_the_same_layout(rng):
    problems = [make_problem(rng, batch=1, seq_len=33, heads=2) for _ in range(4)]
    failures = []
    start = threading.Barrier(len(problems))

    def worker(problem):
        try:
            start.wait()
            for _ in range(5):
                problem.poison_outputs()
                run(problem)
                assert_accurate(problem)
        except Exception as error:  # reported below, with the thread's problem
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(problem,)) for problem in problems]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def test_closed_plan_drops_its_blocks(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    plan = flashkda.Plan(2, backend="cpu")
    plan.fwd(**problem.arguments())
    plan.close()
    with pytest.raises(FlashKDAError) as caught:
        plan.fwd(**problem.arguments())
    assert caught.value.message.startswith("plan:")


def test_plan_dies_on_del_without_the_collector(rng):
    # A plan in a reference cycle would wait for the collector, which runs
    # on any thread; without one it goes the moment its last name does.
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        plan = flashkda.Plan(2, backend="cpu")
        plan.fwd(**problem.arguments())  # caches an argument block in the plan
        assert [r for r in gc.get_referrers(plan) if isinstance(r, _launch.ArgumentBlock)] == []
        watched = weakref.ref(plan)
        del plan
        assert watched() is None

        # A prepared launch holds its plan, and only that.
        plan = flashkda.Plan(2, backend="cpu")
        launch = plan.prepare(**problem.arguments())
        watched = weakref.ref(plan)
        del plan
        assert watched() is not None
        launch()
        del launch
        assert watched() is None
    finally:
        if was_enabled:
            gc.enable()


def test_a_destroy_between_failure_and_message_keeps_the_message():
    library = _library.library()
    collected = flashkda.Plan(3, backend="cpu")
    with flashkda.Plan(2, backend="cpu") as plan:
        size = ctypes.c_size_t()
        status = library.cdll.fkda_plan_workspace_size(plan._live_handle(), -1, 1, ctypes.byref(size))
        assert status != 0
        collected.close()  # what a collector may do right here
        assert library.cdll.fkda_last_error().decode().startswith("total_tokens:")


def test_plan_fwd_caches_per_plan(rng, block_builds):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    with flashkda.Plan(2, backend="cpu") as plan, flashkda.Plan(2, backend="cpu") as other:
        for _ in range(3):
            plan.fwd(**problem.arguments())
        other.fwd(**problem.arguments())
    assert len(block_builds) == 2


# ------------------------------------------------------ prepared launches ---


def test_prepared_launch_reads_the_arrays_at_every_call(rng):
    problem = make_problem(rng, batch=1, seq_len=36, heads=2)
    fresh = make_problem(rng, batch=1, seq_len=36, heads=2)
    with flashkda.Plan(2, backend="cpu") as plan:
        launch = plan.prepare(**problem.arguments())
        problem.poison_outputs()
        launch()
        assert_accurate(problem)
        for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"):
            getattr(problem, name)[...] = getattr(fresh, name)
        problem.poison_outputs()
        launch()
        assert_accurate(problem)


def test_prepared_launch_keeps_its_arrays_alive(rng):
    problem = make_problem(rng, batch=1, seq_len=18, heads=1)
    plan = flashkda.Plan(1, backend="cpu")
    # Copies that only the launch refers to once the names below are gone.
    arguments = {name: value.copy() if isinstance(value, np.ndarray) else value
                 for name, value in problem.arguments().items()}
    out, final_state = arguments["out"], arguments["final_state"]
    launch = plan.prepare(**arguments)
    del arguments, plan
    gc.collect()
    # Freed memory of the same sizes would be handed out again here.
    junk = [np.full_like(getattr(problem, name), 0xFF) for name in ("q", "k", "v", "g")]
    out[...] = BF16_NAN
    launch()
    problem.out, problem.final_state = out, final_state
    assert_accurate(problem)
    del junk


def test_prepared_launch_of_a_closed_plan(rng):
    problem = make_problem(rng, batch=1, seq_len=18, heads=1)
    plan = flashkda.Plan(1, backend="cpu")
    launch = plan.prepare(**problem.arguments())
    plan.close()
    with pytest.raises(FlashKDAError) as caught:
        launch()
    assert caught.value.message.startswith("plan:")


def test_prepared_decode_equals_decode(rng):
    problem = make_problem(rng, batch=3, seq_len=2, heads=2, with_initial_state=False,
                           with_final_state=False)
    pool = rng.standard_normal((6, 2, HEAD_DIM, HEAD_DIM)).astype(np.float32)
    indices = np.array([4, 0, 2], dtype=np.int32)
    arguments = dict(q=problem.q, k=problem.k, v=problem.v, g=problem.g, beta=problem.beta,
                     scale=problem.scale, A_log=problem.A_log, dt_bias=problem.dt_bias,
                     state_indices=indices)
    before = pool.copy()
    expected_pool, expected_out = pool.copy(), np.empty_like(problem.out)
    flashkda.decode(lower_bound=problem.lower_bound, out=expected_out, state_pool=expected_pool,
                    **arguments)
    with flashkda.Plan(2, backend="cpu", lower_bound=problem.lower_bound) as plan:
        launch = plan.prepare_decode(out=problem.out, state_pool=pool, **arguments)
        problem.poison_outputs()
        launch()
    np.testing.assert_array_equal(problem.out, expected_out)
    np.testing.assert_array_equal(pool, expected_pool)
    assert not np.array_equal(pool[4], before[4]), "the step wrote no slot"


def test_prepared_launch_reports_failures(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    with flashkda.Plan(2, backend="cpu") as plan:
        size = plan.workspace_size(20, 1)
        if size == 0:
            pytest.skip("the CPU backend needs no workspace for the case")
        launch = plan.prepare(workspace=np.empty(size - 8, np.uint8), **problem.arguments())
        with pytest.raises(FlashKDAError) as caught:
            launch()
    assert caught.value.status == flashkda.Status.WORKSPACE_TOO_SMALL
    assert caught.value.message.startswith("workspace")


def test_prepare_names_bad_arguments(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    with flashkda.Plan(2, backend="cpu") as plan:
        with pytest.raises(FlashKDAError) as caught:
            plan.prepare(**dict(problem.arguments(), beta=[0.0]))
    assert caught.value.message.startswith("beta:")


# ---------------------------------------------------------- torch on CPU ---


def test_torch_cpu_tensors_take_the_torch_path(rng, block_builds):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    problem = make_problem(rng, batch=1, seq_len=21, heads=2)

    def as_torch(array):
        if array.dtype == np.uint16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    tensors = {name: as_torch(getattr(problem, name))
               for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state",
                            "out", "final_state")}
    assert isinstance(_launch.producer_of(tensors["q"]), _launch._TorchTensors)
    for length in (21, 21, 13):
        arguments = {name: tensor[:, :length] if name in ("q", "k", "v", "g", "beta", "out")
                     else tensor for name, tensor in tensors.items()}
        problem.poison_outputs()
        flashkda.fwd(scale=problem.scale, lower_bound=problem.lower_bound, **arguments)
    assert len(block_builds) == 2
    truncated = dataclasses.replace(
        problem, out=problem.out[:, :13],
        **{name: getattr(problem, name)[:, :13] for name in ("q", "k", "v", "g", "beta")})
    assert_accurate(truncated)


def test_the_package_works_without_torch(tmp_path):
    script = (
        "import sys\n"
        "sys.modules['torch'] = None  # import torch now raises ImportError\n"
        "import numpy as np, flashkda\n"
        "K = 128\n"
        "x = flashkda.to_bf16(np.ones((1, 3, 1, K)))\n"
        "out = np.empty((1, 3, 1, K), np.uint16)\n"
        "flashkda.fwd(x, x, x, x, flashkda.to_bf16(np.ones((1, 3, 1))), K ** -0.5, out,\n"
        "             np.zeros(1, np.float32), np.zeros((1, K), np.float32), -5.0)\n"
        "assert np.isfinite(flashkda.from_bf16(out)).all()\n"
        "assert sys.modules['torch'] is None\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
               FLASHKDA_LIBRARY=os.path.abspath(flashkda.library_path()))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path)
