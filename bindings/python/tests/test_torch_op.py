# SPDX-License-Identifier: MIT
"""torch.ops.flashkda.fwd: schema, opcheck, torch.compile and CUDA graphs.

The CPU tests run wherever torch is installed (scripts/install-deps.sh
installs it for CI); the CUDA ones need a device:
    PYTHONPATH=bindings/python FLASHKDA_LIBRARY=build/libflashkda.so.0 \\
        python3 -m pytest -q -p no:cacheprovider bindings/python/tests/test_torch_op.py
"""

import numpy as np
import pytest

import flashkda
from kda_testing import assert_accurate, make_problem

torch = pytest.importorskip("torch", reason="torch is not installed")
from torch._dynamo.utils import counters  # noqa: E402
from test_torch_cuda import to_device as to_torch, to_host_bits  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")


class TorchCall:
    """The op's arguments for a Problem, on `device`, outputs poisoned."""

    def __init__(self, problem, device):
        self.problem = problem
        self.inputs = {name: to_torch(getattr(problem, name), device) for name in INPUTS}
        self.out = torch.full(problem.out.shape, float("nan"), dtype=torch.bfloat16,
                              device=device)
        self.final_state = None
        if problem.final_state is not None:
            self.final_state = torch.full(problem.final_state.shape, float("nan"), device=device,
                                          dtype=to_torch(problem.final_state[:1], "cpu").dtype)

    def args(self):
        i = self.inputs
        return (i["q"], i["k"], i["v"], i["g"], i["beta"], self.problem.scale, self.out,
                i["A_log"], i["dt_bias"], self.problem.lower_bound)

    def kwargs(self):
        arguments = dict(initial_state=self.inputs["initial_state"], final_state=self.final_state,
                         cu_seqlens=self.inputs["cu_seqlens"])
        # The defaults stay implicit, as FlashKDA's callers leave them.
        if (self.problem.gate_mode, self.problem.beta_mode) != ("bounded", "logits"):
            arguments.update(self.problem.modes())
        return arguments

    def poison(self):
        self.out.fill_(float("nan"))
        if self.final_state is not None:
            self.final_state.fill_(float("nan"))

    def check(self):
        if self.out.is_cuda:
            torch.cuda.synchronize()
        self.problem.out[...] = to_host_bits(self.out)
        if self.final_state is not None:
            self.problem.final_state[...] = to_host_bits(self.final_state)
        assert_accurate(self.problem)


CASES = {
    "batched_f32_state": dict(batch=2, seq_len=37, heads=2),
    "batched_bf16_state": dict(batch=1, seq_len=40, heads=2, state_dtype=np.uint16),
    "varlen_i32": dict(seq_lens=[11, 0, 30], heads=2, cu_seqlens_dtype=np.int32),
    "without_states": dict(batch=1, seq_len=24, heads=1, with_initial_state=False,
                           with_final_state=False),
    # Gate and beta forms: None for A_log, dt_bias and lower_bound, f32 g and beta.
    "softplus_varlen": dict(seq_lens=[11, 0, 30], heads=2, gate_mode="softplus",
                            with_dt_bias=False),
    "log_decay_f32_g": dict(batch=2, seq_len=19, heads=2, gate_mode="log_decay",
                            g_dtype=np.float32),
    "probabilities_f32_beta": dict(batch=1, seq_len=24, heads=2, beta_mode="probabilities",
                                   beta_dtype=np.float32, with_A_log=False, with_dt_bias=False),
}


@pytest.mark.parametrize("op, written", [
    ("fwd", {"out", "final_state", "state_pool", "checkpoints", "conv_state"}),
    ("decode", {"out", "state_pool", "conv_state"}),
])
def test_schema_declares_exactly_the_written_arguments(op, written):
    schema = getattr(torch.ops.flashkda, op).default._schema
    assert {argument.name for argument in schema.arguments
            if argument.alias_info is not None and argument.alias_info.is_write} == written
    assert len(schema.returns) == 0


@pytest.mark.parametrize("case", CASES)
def test_op_matches_the_recurrence_on_cpu(rng, case):
    call = TorchCall(make_problem(rng, **CASES[case]), "cpu")
    torch.ops.flashkda.fwd(*call.args(), **call.kwargs())
    call.check()


@pytest.mark.parametrize("case", CASES)
def test_opcheck_on_cpu(rng, case):
    call = TorchCall(make_problem(rng, **CASES[case]), "cpu")
    torch.library.opcheck(torch.ops.flashkda.fwd.default, call.args(), call.kwargs())


def test_op_errors_are_flashkda_errors(rng):
    call = TorchCall(make_problem(rng, batch=1, seq_len=20, heads=2), "cpu")
    args = list(call.args())
    args[1] = args[1][:, :-1]  # k one token short
    with pytest.raises(flashkda.FlashKDAError) as caught:
        torch.ops.flashkda.fwd(*args, **call.kwargs())
    assert caught.value.message.startswith("k:")


class DecodeCall:
    """One decode step on a pool of 10 slots, as numpy arrays and as torch tensors."""

    def __init__(self, rng, device, **form):
        problem = make_problem(rng, batch=4, seq_len=1, heads=2, with_initial_state=False,
                               with_final_state=False, **form)
        self.numpy = dict(q=problem.q, k=problem.k, v=problem.v, g=problem.g, beta=problem.beta,
                          scale=problem.scale, out=problem.out, A_log=problem.A_log,
                          dt_bias=problem.dt_bias, lower_bound=problem.lower_bound,
                          state_pool=rng.standard_normal((10, 2, 128, 128)).astype(np.float32),
                          state_indices=np.array([7, -1, 2, 5], dtype=np.int64))
        if form:
            self.numpy.update(problem.modes())
        # clone(): on the CPU from_numpy shares memory, and the pool is written.
        self.torch = {name: to_torch(value, device).clone() if isinstance(value, np.ndarray)
                      else value for name, value in self.numpy.items()}

    def expected(self):
        """out and the pool from flashkda.decode on the numpy copies."""
        flashkda.decode(**self.numpy)
        return self.numpy["out"], self.numpy["state_pool"]


# make_problem's keywords of decode calls in other gate and beta forms.
DECODE_FORMS = {
    "default": {},
    "softplus_probabilities": dict(gate_mode="softplus", beta_mode="probabilities",
                                   beta_dtype=np.float32),
    "log_decay_f32_g": dict(gate_mode="log_decay", g_dtype=np.float32),
}


@pytest.mark.parametrize("form", DECODE_FORMS)
def test_decode_op_equals_flashkda_decode_on_cpu(rng, form):
    call = DecodeCall(rng, "cpu", **DECODE_FORMS[form])
    torch.ops.flashkda.decode(**call.torch)
    out, pool = call.expected()
    np.testing.assert_array_equal(to_host_bits(call.torch["out"]), out)
    np.testing.assert_array_equal(to_host_bits(call.torch["state_pool"]), pool)


@pytest.mark.parametrize("form", DECODE_FORMS)
def test_opcheck_decode_on_cpu(rng, form):
    call = DecodeCall(rng, "cpu", **DECODE_FORMS[form])
    torch.library.opcheck(torch.ops.flashkda.decode.default, (), call.torch)


def test_op_form_errors_name_the_argument(rng):
    call = TorchCall(make_problem(rng, batch=1, seq_len=20, heads=2), "cpu")
    args = list(call.args())
    with pytest.raises(flashkda.FlashKDAError) as caught:
        torch.ops.flashkda.fwd(*args, **call.kwargs(), gate_mode="log_decay")
    assert caught.value.message.startswith("A_log:")
    with pytest.raises(flashkda.FlashKDAError) as caught:
        torch.ops.flashkda.fwd(*args, **call.kwargs(), beta_mode="odds")
    assert caught.value.message.startswith("beta_mode:")


def test_schema_takes_the_forms_as_keywords():
    for op in (torch.ops.flashkda.fwd, torch.ops.flashkda.decode):
        arguments = {argument.name: argument for argument in op.default._schema.arguments}
        for name, default in (("gate_mode", "bounded"), ("beta_mode", "logits")):
            assert arguments[name].kwarg_only and arguments[name].default_value == default
        for name in ("A_log", "dt_bias", "lower_bound"):
            assert isinstance(arguments[name].type, torch.OptionalType), name


def test_decode_compiles_without_graph_break_on_cpu(rng):
    call = DecodeCall(rng, "cpu")

    def step(state_pool, **arguments):
        torch.ops.flashkda.decode(state_pool=state_pool, **arguments)
        return arguments["out"].float() + 1.0

    torch._dynamo.reset()
    counters.clear()
    arguments = dict(call.torch)
    pool = arguments.pop("state_pool")
    result = torch.compile(step, fullgraph=True, backend="aot_eager")(pool, **arguments)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    out, expected_pool = call.expected()
    np.testing.assert_array_equal(to_host_bits(result),
                                  flashkda.from_bf16(out).astype(np.float32) + np.float32(1.0))
    np.testing.assert_array_equal(to_host_bits(pool), expected_pool)


def attention_step(q, k, v, g, beta, A_log, dt_bias, initial_state):
    """A module-like function: torch ops around the call, outputs made inside."""
    out = torch.empty_like(v)
    final_state = torch.empty_like(initial_state)
    torch.ops.flashkda.fwd(q * 1.0, k, v, g, beta, q.shape[-1] ** -0.5, out, A_log, dt_bias,
                           -5.0, initial_state=initial_state, final_state=final_state)
    return out.float() * 2.0, final_state


def compiled_matches_eager(device, backend, rng):
    problem = make_problem(rng, batch=1, seq_len=48, heads=2)
    inputs = {name: to_torch(getattr(problem, name), device) for name in INPUTS if name != "cu_seqlens"}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attention_step, fullgraph=True, backend=backend)
    for _ in range(2):
        compiled_out, compiled_state = compiled(**inputs)
    eager_out, eager_state = attention_step(**inputs)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.equal(compiled_out, eager_out)
    assert torch.equal(compiled_state, eager_state)
    problem.out[...] = to_host_bits((eager_out / 2.0).to(torch.bfloat16))
    problem.final_state[...] = to_host_bits(eager_state)
    assert_accurate(problem)


def test_compiles_without_graph_break_on_cpu(rng):
    # aot_eager runs what the registration decides (dynamo, the fake kernel,
    # functionalization of the written arguments) without inductor's C++
    # compilation of the surrounding ops, minutes on a 2-core CI machine; the
    # CUDA test below compiles with inductor.
    compiled_matches_eager("cpu", "aot_eager", rng)


# ----------------------------------------------------------------- CUDA ---


@needs_cuda
@pytest.mark.parametrize("case", CASES)
def test_opcheck_on_cuda(rng, case):
    call = TorchCall(make_problem(rng, **CASES[case]), "cuda")
    torch.library.opcheck(torch.ops.flashkda.fwd.default, call.args(), call.kwargs())


@needs_cuda
def test_compiles_with_inductor_without_graph_break_on_cuda(rng):
    compiled_matches_eager("cuda", "inductor", rng)


@needs_cuda
def test_cuda_graph_replay_equals_eager(rng):
    call = TorchCall(make_problem(rng, batch=1, seq_len=200, heads=4), "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: loads the kernels outside the capture
        torch.ops.flashkda.fwd(*call.args(), **call.kwargs())
    torch.cuda.current_stream().wait_stream(side)
    eager_out, eager_state = call.out.clone(), call.final_state.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.flashkda.fwd(*call.args(), **call.kwargs())
    call.poison()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(call.out, eager_out)
    assert torch.equal(call.final_state, eager_state)
    call.check()


def cloned(arguments):
    return {name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in arguments.items()}


@needs_cuda
def test_decode_op_equals_flashkda_decode_on_cuda(rng):
    call = DecodeCall(rng, "cuda")
    reference = cloned(call.torch)
    torch.ops.flashkda.decode(**call.torch)
    flashkda.decode(**reference)
    torch.cuda.synchronize()
    assert torch.equal(call.torch["out"], reference["out"])
    assert torch.equal(call.torch["state_pool"], reference["state_pool"])
    assert not torch.equal(call.torch["state_pool"], to_torch(call.numpy["state_pool"], "cuda"))


@needs_cuda
def test_opcheck_decode_on_cuda(rng):
    call = DecodeCall(rng, "cuda")
    torch.library.opcheck(torch.ops.flashkda.decode.default, (), call.torch)


@needs_cuda
def test_prepared_decode_graph_replay_equals_eager(rng):
    call = DecodeCall(rng, "cuda")
    reference = cloned(call.torch)
    arguments = dict(call.torch)
    lower_bound = arguments.pop("lower_bound")
    with flashkda.Plan(2, backend="gpu", lower_bound=lower_bound) as plan:
        launch = plan.prepare_decode(**arguments)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a copy of the pool: replay starts from the original
            plan.decode(**cloned(arguments))
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            launch()
        graph.replay()
    flashkda.decode(**reference)
    torch.cuda.synchronize()
    assert torch.equal(call.torch["out"], reference["out"])
    assert torch.equal(call.torch["state_pool"], reference["state_pool"])
