# SPDX-License-Identifier: MIT
"""torch CUDA tensors on the GPU backend. Skipped without torch or a CUDA device.

On a GPU machine:
    PYTHONPATH=bindings/python FLASHKDA_LIBRARY=build/libflashkda.so.0 \
        python3 -m pytest -q -p no:cacheprovider bindings/python/tests/test_torch_cuda.py
"""

import numpy as np
import pytest

import flashkda
from flashkda import FlashKDAError, Status
from kda_testing import BF16_NAN, assert_accurate, make_problem, rel_l2

torch = pytest.importorskip("torch", reason="torch is not installed")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch sees no CUDA device"
)

INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")


def to_device(array, device="cuda"):
    if array is None:
        return None
    if array.dtype == np.uint16:
        return torch.from_numpy(flashkda.from_bf16(array)).to(device=device, dtype=torch.bfloat16)
    return torch.from_numpy(array).to(device)


def to_host_bits(tensor):
    """A bf16 tensor's bit patterns, or an f32 tensor's values, as numpy."""
    tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


class DeviceProblem:
    """A Problem's inputs on the GPU, outputs poisoned there."""

    def __init__(self, problem, device="cuda"):
        self.problem = problem
        self.tensors = {name: to_device(getattr(problem, name), device) for name in INPUTS}
        self.out = torch.empty(problem.out.shape, dtype=torch.bfloat16, device=device)
        self.final_state = None
        if problem.final_state is not None:
            dtype = torch.bfloat16 if problem.final_state.dtype == np.uint16 else torch.float32
            self.final_state = torch.empty(problem.final_state.shape, dtype=dtype, device=device)
        self.poison()

    def poison(self):
        self.out.fill_(float("nan"))
        if self.final_state is not None:
            self.final_state.fill_(float("nan"))

    def arguments(self):
        return dict(scale=self.problem.scale, out=self.out, final_state=self.final_state,
                    **self.tensors)

    def fetch(self):
        """Copies the device outputs into the numpy Problem for checking."""
        torch.cuda.synchronize()
        self.problem.out[...] = to_host_bits(self.out)
        if self.final_state is not None:
            self.problem.final_state[...] = to_host_bits(self.final_state)
        return self.problem


def run_fwd(device_problem, **overrides):
    arguments = device_problem.arguments()
    arguments.update(overrides)
    flashkda.fwd(lower_bound=device_problem.problem.lower_bound, **arguments)


@pytest.mark.parametrize("state_dtype", [np.float32, np.uint16], ids=["f32_state", "bf16_state"])
def test_batched_forward_matches_recurrence(rng, state_dtype):
    device_problem = DeviceProblem(make_problem(rng, batch=2, seq_len=77, heads=4,
                                                state_dtype=state_dtype))
    run_fwd(device_problem)
    assert_accurate(device_problem.fetch())


@pytest.mark.parametrize("offsets_dtype", [np.int64, np.int32])
def test_varlen_forward_matches_recurrence(rng, offsets_dtype):
    device_problem = DeviceProblem(make_problem(rng, seq_lens=[300, 77, 0, 700], heads=4,
                                                cu_seqlens_dtype=offsets_dtype))
    run_fwd(device_problem)
    assert_accurate(device_problem.fetch())


def test_without_states(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=50, heads=2,
                                                with_initial_state=False,
                                                with_final_state=False))
    run_fwd(device_problem)
    assert_accurate(device_problem.fetch())


def test_gpu_agrees_with_the_cpu_backend(rng):
    problem = make_problem(rng, batch=1, seq_len=200, heads=4)
    device_problem = DeviceProblem(problem)
    run_fwd(device_problem)
    gpu_out = flashkda.from_bf16(to_host_bits(device_problem.out))
    gpu_state = to_host_bits(device_problem.final_state)
    problem.poison_outputs()
    flashkda.fwd(lower_bound=problem.lower_bound, **problem.arguments())
    assert rel_l2(gpu_out, flashkda.from_bf16(problem.out)) <= 1e-3
    assert rel_l2(gpu_state, problem.final_state) <= 1e-3


def test_strided_views_give_the_contiguous_result(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=2, seq_len=40, heads=2))
    run_fwd(device_problem)
    contiguous = device_problem.out.clone()

    def wider_heads(tensor):
        wide = torch.randn(tensor.shape[:2] + (4,) + tensor.shape[3:], device="cuda",
                           dtype=tensor.dtype)
        view = wide[:, :, 1:3]
        view.copy_(tensor)
        return view

    strided = {name: wider_heads(device_problem.tensors[name]) for name in ("q", "k", "v", "g")}
    out_view = wider_heads(torch.full_like(device_problem.out, float("nan")))
    run_fwd(device_problem, out=out_view, **strided)
    torch.cuda.synchronize()
    assert torch.equal(out_view, contiguous)


def test_launches_on_the_current_stream_and_captures_in_a_graph(rng):
    problem = make_problem(rng, batch=1, seq_len=64, heads=2)
    device_problem = DeviceProblem(problem)
    with flashkda.Plan(2, backend="gpu") as plan:
        workspace = torch.empty(plan.workspace_size(64, 1), dtype=torch.uint8, device="cuda")
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            plan.fwd(workspace=workspace, **device_problem.arguments())  # warm-up
        torch.cuda.current_stream().wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        # Capture fails if the launch goes to any stream but torch's current one.
        with torch.cuda.graph(graph):
            plan.fwd(workspace=workspace, **device_problem.arguments())
        device_problem.poison()
        graph.replay()
    assert_accurate(device_problem.fetch())


def test_explicit_stream_with_a_binding_workspace(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=90, heads=2))
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with flashkda.Plan(2, backend="gpu") as plan:
        plan.fwd(stream=side_stream, **device_problem.arguments())
    side_stream.synchronize()
    assert_accurate(device_problem.fetch())


def test_plan_reuse_and_workspace(rng):
    first = DeviceProblem(make_problem(rng, batch=1, seq_len=100, heads=2))
    second = DeviceProblem(make_problem(rng, seq_lens=[33, 90], heads=2, lower_bound=-3.0))
    with flashkda.Plan(2, backend=flashkda.Backend.GPU) as plan:
        assert plan.backend == flashkda.Backend.GPU
        size = max(plan.workspace_size(100, 1), plan.workspace_size(123, 2))
        workspace = torch.empty(size, dtype=torch.uint8, device="cuda")
        plan.fwd(workspace=workspace, **first.arguments())
        plan.set_lower_bound(-3.0)
        plan.fwd(workspace=workspace, **second.arguments())
        assert_accurate(second.fetch())
        plan.lower_bound = -5.0
        first.poison()
        plan.fwd(**first.arguments())  # workspace allocated by the binding
        assert_accurate(first.fetch())


def test_workspace_too_small(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=100, heads=2))
    with flashkda.Plan(2, backend="gpu") as plan:
        needed = plan.workspace_size(100, 1)
        if needed == 0:
            pytest.skip("this build needs no workspace for the case")
        small = torch.empty(needed - 16, dtype=torch.uint8, device="cuda")
        with pytest.raises(FlashKDAError) as caught:
            plan.fwd(workspace=small, **device_problem.arguments())
        assert caught.value.status == Status.WORKSPACE_TOO_SMALL
        assert caught.value.message.startswith("workspace")
        host_workspace = np.empty(needed, dtype=np.uint8)
        with pytest.raises(FlashKDAError) as caught:
            plan.fwd(workspace=host_workspace, **device_problem.arguments())
        assert caught.value.message.startswith("workspace:")


def test_host_and_device_mixed(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=20, heads=2))
    with pytest.raises(FlashKDAError) as caught:
        run_fwd(device_problem, k=device_problem.tensors["k"].cpu())
    assert caught.value.status == Status.INVALID_ARGUMENT
    assert caught.value.message.startswith("k:")


def test_cpu_plan_with_device_tensors(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=20, heads=2))
    with flashkda.Plan(2, backend="cpu") as plan:
        with pytest.raises(FlashKDAError) as caught:
            plan.fwd(**device_problem.arguments())
    assert caught.value.status == Status.INVALID_ARGUMENT
    assert caught.value.message.startswith("q:")


def test_wrong_dtype(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=20, heads=2))
    with pytest.raises(FlashKDAError) as caught:
        run_fwd(device_problem, v=device_problem.tensors["v"].to(torch.float16))
    assert caught.value.message.startswith("v:")
    with pytest.raises(FlashKDAError) as caught:
        run_fwd(device_problem, g=device_problem.tensors["g"].to(torch.float64))
    assert caught.value.message.startswith("g:")


def test_misaligned_rows(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=20, heads=2))
    q = device_problem.tensors["q"]
    padded = torch.zeros(q.shape[:3] + (q.shape[3] + 8,), dtype=q.dtype, device="cuda")
    shifted = padded[..., 1:q.shape[3] + 1]
    shifted.copy_(q)
    with pytest.raises(FlashKDAError) as caught:
        run_fwd(device_problem, q=shifted)
    assert caught.value.message.startswith("q:")


def test_query_device_matches_torch():
    info = flashkda.query_device(0)
    assert info.driver_loaded and info.driver_version > 0
    assert info.device_count == torch.cuda.device_count()
    assert (info.cc_major, info.cc_minor) == torch.cuda.get_device_capability(0)
    assert info.name == torch.cuda.get_device_name(0)
    if info.cc_major in (8, 9):
        assert info.has_kernels


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=40, heads=2), "cuda:1")
    with torch.cuda.device(0):
        run_fwd(device_problem)
    assert_accurate(device_problem.fetch())
    mixed = DeviceProblem(make_problem(rng, batch=1, seq_len=40, heads=2), "cuda:1")
    with pytest.raises(FlashKDAError) as caught:
        run_fwd(mixed, k=mixed.tensors["k"].to("cuda:0"))
    assert caught.value.message.startswith("k:")


class CudaArrayInterfaceOnly:
    """A producer known only by __cuda_array_interface__ (bf16 spelled <u2)."""

    def __init__(self, tensor):
        self._tensor = tensor
        typestr = {torch.bfloat16: "<u2", torch.float32: "<f4", torch.int64: "<i8",
                   torch.int32: "<i4"}[tensor.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": typestr,
            "data": (tensor.data_ptr(), False),
            "strides": tuple(s * tensor.element_size() for s in tensor.stride()),
            "version": 3,
            "stream": torch.cuda.current_stream().cuda_stream or 1,
        }


class DLPackOnly:
    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, stream=None):
        return self._tensor.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


@pytest.mark.parametrize("wrapper", [CudaArrayInterfaceOnly, DLPackOnly])
def test_other_producers(rng, wrapper):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=40, heads=2))
    arguments = device_problem.arguments()
    for name, value in list(arguments.items()):
        if isinstance(value, torch.Tensor):
            arguments[name] = wrapper(value)
    torch.cuda.synchronize()
    flashkda.fwd(lower_bound=device_problem.problem.lower_bound, **arguments)
    assert_accurate(device_problem.fetch())


def test_poison_value_is_a_nan():
    assert np.isnan(flashkda.from_bf16(np.array([BF16_NAN])))[0]


# ------------------------------------------------------------- hot path ---


def test_hot_path_across_layouts(rng, block_builds):
    shapes = [dict(batch=1, seq_len=300, heads=4), dict(batch=1, seq_len=300, heads=4),
              dict(batch=2, seq_len=129, heads=4), dict(seq_lens=[100, 3, 250], heads=4),
              dict(batch=1, seq_len=300, heads=4, state_dtype=np.uint16)]
    for shape in shapes:
        device_problem = DeviceProblem(make_problem(rng, **shape))
        run_fwd(device_problem)
        assert_accurate(device_problem.fetch())
    assert len(block_builds) == len(shapes) - 1


def test_hot_path_never_synchronises_the_host(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=512, heads=4))
    run_fwd(device_problem)
    torch.cuda.synchronize()
    device_problem.poison()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            run_fwd(device_problem)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_accurate(device_problem.fetch())


def warmed_up_graph(launch):
    """`launch` run once on a side stream, then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    return graph


def test_fwd_captured_in_a_graph(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=256, heads=4))
    graph = warmed_up_graph(lambda: run_fwd(device_problem))
    device_problem.poison()
    graph.replay()
    assert_accurate(device_problem.fetch())


def test_prepared_launch_captured_in_a_graph_reads_refilled_inputs(rng):
    device_problem = DeviceProblem(make_problem(rng, batch=1, seq_len=256, heads=4))
    fresh = make_problem(rng, batch=1, seq_len=256, heads=4)
    with flashkda.Plan(4, backend="gpu") as plan:
        launch = plan.prepare(**device_problem.arguments())
        graph = warmed_up_graph(launch)
        for name in INPUTS:
            if device_problem.tensors[name] is not None:
                device_problem.tensors[name].copy_(to_device(getattr(fresh, name)))
        device_problem.poison()
        graph.replay()
    device_problem.problem = fresh
    assert_accurate(device_problem.fetch())
