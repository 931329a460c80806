# SPDX-License-Identifier: MIT
"""The layer step around the recurrence (fkda_layer_step) through flashkda.fwd,
flashkda.decode, Plan and the torch operators on the CPU backend, against the
whole step in float64: the causal depthwise convolution with SiLU of the raw
projections from the conv states, the recurrence of kda_testing, and
RMSNorm(o) * w * sigmoid(g_out)."""

import numpy as np
import pytest

import flashkda
from flashkda import FlashKDAError
from kda_testing import (
    BF16_NAN,
    HEAD_DIM,
    is_null_slot,
    kda_recurrence_fp64,
    make_problem,
    rel_l2,
    sigmoid,
    widened,
)

torch = pytest.importorskip("torch", reason="torch is not installed")
from test_torch_cuda import to_device  # noqa: E402

def _library_reads_the_layer_step():
    """Whether the loaded library reads fkda_layer_step: one that does
    refuses an output gate without its RMSNorm weight."""
    zeros = np.zeros((1, 1, 1, HEAD_DIM), np.uint16)
    try:
        flashkda.fwd(zeros, zeros, zeros, zeros, np.zeros((1, 1, 1), np.uint16), 1.0,
                     zeros.copy(), None, None, -5.0, out_gate=zeros)
    except FlashKDAError:
        return True
    return False


# The tests that need the library to compute the layer step are expected to
# fail, strictly, with a library that does not read it yet.
needs_layer_step = pytest.mark.xfail(
    not _library_reads_the_layer_step(), strict=True,
    reason="the loaded library does not read fkda_layer_step: its CPU implementation "
           "(branch issue19cpu) is not in this build")

# fkda_fwd rounds the convolved q, k and v to bf16 and gates the bf16 output
# of the recurrence; the fp64 step rounds nothing. fkda_decode stays in f32.
FWD_TOLERANCE = 8e-3
DECODE_TOLERANCE = 5e-3
DECODE_POOL_TOLERANCE = 1e-5


# ------------------------------------------------------- the fp64 step ---


def sequences(batch, seq_len, cu_seqlens):
    """(batch row, first token, end) of every sequence."""
    if cu_seqlens is None:
        return [(row, 0, seq_len) for row in range(batch)]
    offsets = [int(x) for x in cu_seqlens]
    return [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]


def convolve_fp64(raw, weight, bias, states, cu_seqlens, rows, reads):
    """One projection's convolution with SiLU, in float64.

    raw [B, T, H, K] (bf16 bits); weight [C, W]; bias [C] or None; states
    [rows, C, Wc] or None; rows[n]: sequence n's row of the states (None:
    padding, left unconvolved); reads[n]: whether it starts from its row
    (else from zeros). Returns (x' [B, T, H, K], the states after the call)."""
    x = widened(raw)
    batch, seq_len, heads, dim = x.shape
    channels = heads * dim
    weight = widened(weight)
    width = weight.shape[1]
    bias = np.zeros(channels) if bias is None else widened(bias)
    state_width = width - 1 if states is None else states.shape[2]
    after = None if states is None else widened(states).copy()
    convolved = np.zeros_like(x)
    for n, (row, begin, end) in enumerate(sequences(batch, seq_len, cu_seqlens)):
        if rows[n] is None or end == begin:
            continue
        history = np.zeros((channels, state_width))
        if after is not None and reads[n]:
            history = after[rows[n]].copy()
        tokens = x[row, begin:end].reshape(end - begin, channels).T  # [C, L]
        window = np.concatenate([history, tokens], axis=1)
        lead = state_width - (width - 1)  # columns of the state the first token does not see
        for t in range(end - begin):
            taps = window[:, lead + t: lead + t + width]
            pre = bias + np.sum(weight * taps, axis=1)
            convolved[row, begin + t] = (pre * sigmoid(pre)).reshape(heads, dim)
        if after is not None:
            after[rows[n]] = window[:, -state_width:]
    return convolved, after


def gate_fp64(out, gate, weight, eps):
    """RMSNorm over each head's V outputs, times w, times sigmoid(g_out)."""
    inverse_rms = 1.0 / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + eps)
    return out * inverse_rms * widened(weight) * sigmoid(widened(gate))


# ------------------------------------------------------------ problems ---


class Layer:
    """A layer step's arrays for H heads: weights, biases and conv states of
    q, k and v (None where absent), the output gate and the RMSNorm weight."""

    def __init__(self, rng, heads, rows, *, width=4, state_width=3, dtype=np.float32,
                 state_dtype=np.float32, with_bias=True, with_states=True, with_gate=True,
                 norm_dtype=np.float32, batch=1, seq_len=1, conv=True):
        channels = heads * HEAD_DIM

        def values(shape, scale, kind, mean=0.0):
            data = mean + scale * rng.standard_normal(shape)
            return flashkda.to_bf16(data) if kind == np.uint16 else data.astype(kind)

        self.width = width
        self.weights = self.biases = self.states = None
        if conv:
            self.weights = tuple(values((channels, width), 0.5, dtype) for _ in range(3))
            if with_bias:
                self.biases = tuple(values(channels, 0.2, dtype) for _ in range(3))
            if with_states:
                self.states = tuple(values((rows, channels, state_width), 1.0, state_dtype)
                                    for _ in range(3))
        self.gate = self.norm_weight = None
        if with_gate:
            self.gate = flashkda.to_bf16(rng.standard_normal((batch, seq_len, heads, HEAD_DIM)))
            self.norm_weight = values(HEAD_DIM, 0.3, norm_dtype, mean=1.0)
        self.eps = 1e-5

    def keywords(self):
        return dict(conv_weight=self.weights, conv_bias=self.biases, conv_state=self.states,
                    out_gate=self.gate, out_norm_weight=self.norm_weight)

    def reference(self, q, k, v, cu_seqlens, rows, reads):
        """(q, k, v) convolved, and the conv states after the call: sequence
        n's conv state is row rows[n] (None: padding), read where reads[n]."""
        if self.weights is None:
            return (widened(q), widened(k), widened(v)), None
        results = [convolve_fp64(raw, self.weights[i],
                                 None if self.biases is None else self.biases[i],
                                 None if self.states is None else self.states[i],
                                 cu_seqlens, rows, reads)
                   for i, raw in enumerate((q, k, v))]
        return tuple(r[0] for r in results), (
            None if self.states is None else tuple(r[1] for r in results))

    def gated(self, out):
        if self.gate is None:
            return out
        return gate_fp64(out, self.gate, self.norm_weight, self.eps)


def as_torch(array):
    """A CPU tensor holding a copy of a numpy array (bf16 bits as bfloat16)."""
    return to_device(array, "cpu").clone()


def assert_close(name, actual, expected, tolerance):
    actual = widened(actual)
    assert not np.isnan(actual).any(), f"{name}: some elements were not written"
    error = rel_l2(actual, expected)
    assert error <= tolerance, f"{name}: relative L2 error {error:.2e}"


def assert_conv_states(layer, expected):
    """The conv states hold raw inputs (or their old values): exactly."""
    for name, actual, wanted in zip("qkv", layer.states, expected):
        np.testing.assert_array_equal(widened(actual), wanted, err_msg=f"conv_state_{name}")


FWD_CASES = {
    "batched_f32_bias_states": dict(
        problem=dict(batch=2, seq_len=37, heads=2),
        layer=dict(width=4, state_width=3)),
    "varlen_bf16_without_initial_state": dict(
        problem=dict(seq_lens=[11, 0, 30], heads=2, with_initial_state=False),
        layer=dict(width=3, state_width=3, dtype=np.uint16, state_dtype=np.uint16,
                   with_bias=False, norm_dtype=np.uint16)),
    "width_2_convolution_only": dict(
        problem=dict(batch=1, seq_len=24, heads=1),
        layer=dict(width=2, state_width=1, with_gate=False)),
    "convolution_without_states": dict(
        problem=dict(batch=2, seq_len=19, heads=2),
        layer=dict(width=4, with_states=False, with_gate=False)),
    "output_gate_only": dict(
        problem=dict(seq_lens=[5, 17], heads=2),
        layer=dict(conv=False)),
}


def fwd_problem(rng, case):
    spec = FWD_CASES[case]
    problem = make_problem(rng, **spec["problem"])
    num_seqs = problem.final_state.shape[0]
    layer = Layer(rng, problem.q.shape[2], num_seqs, batch=problem.q.shape[0],
                  seq_len=problem.q.shape[1], **spec["layer"])
    return problem, layer


def fwd_reference(problem, layer, rows, reads, initial_state):
    (q, k, v), states = layer.reference(problem.q, problem.k, problem.v, problem.cu_seqlens,
                                        rows, reads)
    out, final_state = kda_recurrence_fp64(
        q, k, v, widened(problem.g), widened(problem.beta), problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, initial_state=initial_state,
        cu_seqlens=problem.cu_seqlens, **problem.modes())
    return layer.gated(out), final_state, states


@needs_layer_step
@pytest.mark.parametrize("case", FWD_CASES)
def test_fwd_layer_step_matches_the_fp64_step(rng, case):
    problem, layer = fwd_problem(rng, case)
    num_seqs = problem.final_state.shape[0]
    reads = [problem.initial_state is not None] * num_seqs
    expected_out, expected_state, expected_conv = fwd_reference(
        problem, layer, list(range(num_seqs)), reads,
        problem.state_as_f64(problem.initial_state))
    problem.poison_outputs()
    flashkda.fwd(**problem.arguments(), lower_bound=problem.lower_bound, **layer.keywords())
    assert_close("out", flashkda.from_bf16(problem.out), expected_out, FWD_TOLERANCE)
    assert_close("final_state", problem.final_state, expected_state, FWD_TOLERANCE)
    if expected_conv is not None:
        assert_conv_states(layer, expected_conv)


@needs_layer_step
def test_fwd_layer_step_on_a_pool(rng):
    """Conv state rows are pool slots: has_initial_state 0 starts the
    convolution from zeros too, a padding sequence touches nothing."""
    problem = make_problem(rng, seq_lens=[13, 20, 9], heads=2, with_initial_state=False,
                           with_final_state=False)
    slots = np.array([3, -1, 0], dtype=np.int64)
    has_initial_state = np.array([True, True, False])
    pool = rng.standard_normal((5, 2, HEAD_DIM, HEAD_DIM)).astype(np.float32) * 0.1
    layer = Layer(rng, 2, 5, batch=1, seq_len=problem.q.shape[1])
    untouched = [s.copy() for s in layer.states]
    (q, k, v), expected_conv = layer.reference(problem.q, problem.k, problem.v,
                                               problem.cu_seqlens, [3, None, 0],
                                               [True, True, False])
    initial = np.stack([pool[3], np.zeros_like(pool[0]), np.zeros_like(pool[0])])
    out, final_state = kda_recurrence_fp64(
        q, k, v, widened(problem.g), widened(problem.beta), problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, initial_state=initial, cu_seqlens=problem.cu_seqlens)
    out = layer.gated(out)
    out[0, 13:33] = 0.0  # the padding sequence's rows
    expected_pool = pool.astype(np.float64)
    expected_pool[3], expected_pool[0] = final_state[0], final_state[2]

    problem.out[...] = BF16_NAN
    flashkda.fwd(problem.q, problem.k, problem.v, problem.g, problem.beta, problem.scale,
                 problem.out, problem.A_log, problem.dt_bias, problem.lower_bound,
                 cu_seqlens=problem.cu_seqlens, state_pool=pool, state_indices=slots,
                 has_initial_state=has_initial_state, **layer.keywords())
    assert_close("out", flashkda.from_bf16(problem.out), out, FWD_TOLERANCE)
    assert not flashkda.from_bf16(problem.out)[0, 13:33].any(), "padding rows are not zero"
    assert_close("state_pool", pool, expected_pool, FWD_TOLERANCE)
    assert_conv_states(layer, expected_conv)
    for name, before, after in zip("qkv", untouched, layer.states):
        for slot in (1, 2, 4):
            np.testing.assert_array_equal(after[slot], before[slot],
                                          err_msg=f"conv_state_{name} slot {slot}")


DECODE_CASES = {
    "batched_two_tokens": dict(batch=4, seq_len=2, seq_lens=None, slots=[5, -1, 2, 0]),
    "packed_lengths_0_to_3": dict(batch=None, seq_len=None, seq_lens=[1, 3, 0, 2],
                                  slots=[1, 4, 3, -1]),
}


@needs_layer_step
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("state_dtype", [np.float32, np.uint16], ids=["f32", "bf16"])
def test_decode_layer_step_matches_the_fp64_step(rng, case, state_dtype):
    spec = DECODE_CASES[case]
    shape = (dict(seq_lens=spec["seq_lens"]) if spec["seq_lens"]
             else dict(batch=spec["batch"], seq_len=spec["seq_len"]))
    problem = make_problem(rng, heads=2, with_initial_state=False, with_final_state=False,
                           **shape)
    slots = np.array(spec["slots"], dtype=np.int32)
    pool = rng.standard_normal((6, 2, HEAD_DIM, HEAD_DIM)).astype(np.float32) * 0.1
    batch, seq_len = problem.q.shape[:2]
    layer = Layer(rng, 2, 6, width=4, state_width=4, state_dtype=state_dtype, batch=batch,
                  seq_len=seq_len)
    rows = [None if is_null_slot(s, "negative") else int(s) for s in slots]
    (q, k, v), expected_conv = layer.reference(problem.q, problem.k, problem.v,
                                               problem.cu_seqlens, rows, [True] * len(slots))
    initial = np.stack([pool[s] if s is not None else np.zeros_like(pool[0]) for s in rows])
    out, final_state = kda_recurrence_fp64(
        q, k, v, widened(problem.g), widened(problem.beta), problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, initial_state=initial, cu_seqlens=problem.cu_seqlens)
    out = layer.gated(out)
    expected_pool = pool.astype(np.float64)
    for n, (row, begin, end) in enumerate(sequences(batch, seq_len, problem.cu_seqlens)):
        if rows[n] is None:
            out[row, begin:end] = 0.0
        elif end > begin:
            expected_pool[rows[n]] = final_state[n]

    problem.out[...] = BF16_NAN
    flashkda.decode(problem.q, problem.k, problem.v, problem.g, problem.beta, problem.scale,
                    problem.out, problem.A_log, problem.dt_bias, problem.lower_bound, pool,
                    slots, cu_seqlens=problem.cu_seqlens, **layer.keywords())
    assert_close("out", flashkda.from_bf16(problem.out), out, DECODE_TOLERANCE)
    assert_close("state_pool", pool, expected_pool, DECODE_POOL_TOLERANCE)
    assert_conv_states(layer, expected_conv)


@needs_layer_step
def test_prefill_then_decode_carries_the_conv_state(rng):
    """fwd on a pool leaves the conv state decode continues from: prefill of
    T tokens then decode of one equals the fp64 step over T + 1 tokens."""
    heads, total = 2, 21
    problem = make_problem(rng, batch=1, seq_len=total, heads=heads, with_initial_state=False,
                           with_final_state=False)
    layer = Layer(rng, heads, 2, width=4, state_width=3, batch=1, seq_len=total)
    for state in layer.states:
        state[...] = 0.0
    (q, k, v), _ = layer.reference(problem.q, problem.k, problem.v, None, [1], [True])
    out, _ = kda_recurrence_fp64(q, k, v, widened(problem.g), widened(problem.beta),
                                 problem.A_log, problem.dt_bias, problem.scale,
                                 problem.lower_bound)
    expected_last = layer.gated(out)[:, -1:]

    pool = np.zeros((2, heads, HEAD_DIM, HEAD_DIM), np.float32)
    slots = np.array([1], dtype=np.int64)
    arrays = {name: getattr(problem, name) for name in ("q", "k", "v", "g", "beta")}
    out_prefill = np.empty((1, total - 1, heads, HEAD_DIM), np.uint16)
    out_step = np.empty((1, 1, heads, HEAD_DIM), np.uint16)
    common = dict(scale=problem.scale, A_log=problem.A_log, dt_bias=problem.dt_bias,
                  lower_bound=problem.lower_bound, state_pool=pool, state_indices=slots)
    gate = layer.gate
    flashkda.fwd(*(arrays[n][:, :-1] for n in ("q", "k", "v", "g", "beta")), out=out_prefill,
                 **common, conv_weight=layer.weights, conv_bias=layer.biases,
                 conv_state=layer.states, out_gate=gate[:, :-1],
                 out_norm_weight=layer.norm_weight, has_initial_state=np.array([False]))
    flashkda.decode(*(arrays[n][:, -1:] for n in ("q", "k", "v", "g", "beta")), out=out_step,
                    **common, conv_weight=layer.weights, conv_bias=layer.biases,
                    conv_state=layer.states, out_gate=gate[:, -1:],
                    out_norm_weight=layer.norm_weight)
    assert_close("out", flashkda.from_bf16(out_step), expected_last, FWD_TOLERANCE)


# ------------------------------------------------ packed and per-projection ---


def packed(layer, states=True):
    """The layer's weights as torch's [3*H*K, 1, W], biases [3*H*K] and conv
    states [rows, 3*H*K, Wc] (or the three arrays), the packed forms flashkda
    splits."""
    return dict(conv_weight=np.concatenate(layer.weights)[:, None, :],
                conv_bias=np.concatenate(layer.biases),
                conv_state=(np.concatenate(layer.states, axis=1) if states
                            else tuple(s.copy() for s in layer.states)),
                out_gate=layer.gate, out_norm_weight=layer.norm_weight)


@needs_layer_step
@pytest.mark.parametrize("seq_lens", [[35], [9, 26]], ids=["one_row", "two_rows"])
def test_packed_and_per_projection_forms_give_identical_results(rng, seq_lens):
    """Packed weights, biases and conv states (one conv pool of 3*H*K
    channels, whose three views interleave), and q, k and v as views into
    one buffer of projections."""
    problem = make_problem(rng, seq_lens=seq_lens, heads=2)
    rows = len(seq_lens)
    layer = Layer(rng, 2, rows, batch=1, seq_len=problem.q.shape[1])
    packed_keywords = packed(layer, states=True)
    # q, k and v as views into one [1, T, 3*H*K] buffer of projections.
    projections = np.concatenate([x.reshape(1, x.shape[1], -1)
                                  for x in (problem.q, problem.k, problem.v)], axis=2)
    channels = 2 * HEAD_DIM
    views = [projections[..., i * channels:(i + 1) * channels].reshape(problem.q.shape)
             for i in range(3)]
    assert not views[1].flags.c_contiguous

    states_before = [s.copy() for s in layer.states]
    flashkda.fwd(**problem.arguments(), lower_bound=problem.lower_bound, **layer.keywords())
    separate = (problem.out.copy(), problem.final_state.copy(), [s.copy() for s in layer.states])
    assert not np.array_equal(separate[2][0], states_before[0]), "conv_state_q was not updated"
    problem.poison_outputs()
    arguments = dict(problem.arguments(), q=views[0], k=views[1], v=views[2])
    flashkda.fwd(**arguments, lower_bound=problem.lower_bound, **packed_keywords)
    np.testing.assert_array_equal(problem.out, separate[0])
    np.testing.assert_array_equal(problem.final_state, separate[1])
    states = np.split(packed_keywords["conv_state"], 3, axis=1)
    for name, state, expected in zip("qkv", states, separate[2]):
        np.testing.assert_array_equal(state, expected, err_msg=f"conv_state {name}")


@needs_layer_step
def test_torch_tensors_packed_and_per_projection(rng):
    problem = make_problem(rng, batch=1, seq_len=33, heads=2, with_initial_state=False)
    layer = Layer(rng, 2, 1, dtype=np.uint16, state_dtype=np.uint16, norm_dtype=np.uint16,
                  batch=1, seq_len=33)
    inputs = {n: as_torch(getattr(problem, n)) for n in ("q", "k", "v", "g", "beta")}
    gate_parameters = dict(A_log=torch.from_numpy(problem.A_log),
                           dt_bias=torch.from_numpy(problem.dt_bias))
    weights = [as_torch(w) for w in layer.weights]
    states = [as_torch(s) for s in layer.states]
    packed_weight = torch.cat(weights).unsqueeze(1)  # [3*H*K, 1, W], torch's Conv1d weight
    packed_state = torch.cat([as_torch(s) for s in layer.states], dim=1)
    results = []
    for conv_weight, conv_bias, conv_state in (
            (tuple(weights), tuple(as_torch(b) for b in layer.biases), tuple(states)),
            (packed_weight, torch.cat([as_torch(b) for b in layer.biases]), packed_state)):
        out = torch.empty(problem.out.shape, dtype=torch.bfloat16)
        final_state = torch.empty(problem.final_state.shape)
        flashkda.fwd(*inputs.values(), problem.scale, out, gate_parameters["A_log"],
                     gate_parameters["dt_bias"], problem.lower_bound, final_state=final_state,
                     conv_weight=conv_weight, conv_bias=conv_bias, conv_state=conv_state,
                     out_gate=as_torch(layer.gate), out_norm_weight=as_torch(layer.norm_weight))
        results.append((out, final_state))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(torch.cat(states, dim=1), packed_state)
    assert not torch.equal(packed_state, torch.cat([as_torch(s) for s in layer.states], dim=1))


# ------------------------------------------------------- torch operators ---


def torch_layer_call(rng):
    """A forward call with a layer step as the op's (args, kwargs)."""
    problem = make_problem(rng, batch=1, seq_len=21, heads=2)
    layer = Layer(rng, 2, 1, batch=1, seq_len=21)
    args = [as_torch(getattr(problem, n)) for n in ("q", "k", "v", "g", "beta")]
    out = torch.empty(problem.out.shape, dtype=torch.bfloat16)
    args += [problem.scale, out, as_torch(problem.A_log), as_torch(problem.dt_bias),
             problem.lower_bound]
    kwargs = dict(initial_state=as_torch(problem.initial_state),
                  final_state=torch.empty(problem.final_state.shape),
                  conv_weight=[as_torch(w) for w in layer.weights],
                  conv_bias=[torch.cat([as_torch(b) for b in layer.biases])],
                  conv_state=[as_torch(s) for s in layer.states],
                  out_gate=as_torch(layer.gate), out_norm_weight=as_torch(layer.norm_weight),
                  out_norm_eps=1e-4)
    return args, kwargs


def test_fwd_op_with_a_layer_step_equals_flashkda_fwd(rng):
    args, kwargs = torch_layer_call(rng)
    reference_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    reference_kwargs = {n: ([t.clone() for t in v] if isinstance(v, list)
                            else v.clone() if isinstance(v, torch.Tensor) else v)
                        for n, v in kwargs.items()}
    torch.ops.flashkda.fwd(*args, **kwargs)
    flashkda.fwd(*reference_args, **reference_kwargs)
    assert torch.equal(args[6], reference_args[6])
    assert torch.equal(kwargs["final_state"], reference_kwargs["final_state"])
    for state, expected in zip(kwargs["conv_state"], reference_kwargs["conv_state"]):
        assert torch.equal(state, expected)


def test_opcheck_fwd_with_a_layer_step(rng):
    args, kwargs = torch_layer_call(rng)
    torch.library.opcheck(torch.ops.flashkda.fwd.default, tuple(args), kwargs)


def torch_decode_call(rng):
    """A decode step of 3 sequences (one padding) on a pool of 4 slots with a
    layer step: (the op's arguments but the pool and the conv states, the
    conv states as tensors)."""
    problem = make_problem(rng, batch=3, seq_len=1, heads=2, with_initial_state=False,
                           with_final_state=False)
    layer = Layer(rng, 2, 4, batch=3, seq_len=1)
    arguments = {name: as_torch(getattr(problem, name))
                 for name in ("q", "k", "v", "g", "beta", "out", "A_log", "dt_bias")}
    arguments.update(scale=problem.scale, lower_bound=problem.lower_bound,
                     state_indices=torch.tensor([2, -1, 0]),
                     conv_weight=[torch.cat([as_torch(w) for w in layer.weights])],
                     out_gate=as_torch(layer.gate), out_norm_weight=as_torch(layer.norm_weight))
    return arguments, [as_torch(s) for s in layer.states]


def test_opcheck_decode_with_a_layer_step(rng):
    arguments, states = torch_decode_call(rng)
    torch.library.opcheck(torch.ops.flashkda.decode.default, (),
                          dict(arguments, state_pool=torch.randn(4, 2, HEAD_DIM, HEAD_DIM) * 0.1,
                               conv_state=states))


def test_schema_takes_the_layer_step_as_keywords():
    for op in (torch.ops.flashkda.fwd, torch.ops.flashkda.decode):
        arguments = {argument.name: argument for argument in op.default._schema.arguments}
        for name in ("conv_weight", "conv_bias", "conv_state", "out_gate", "out_norm_weight"):
            assert arguments[name].kwarg_only and isinstance(arguments[name].type,
                                                             torch.OptionalType), name
        assert arguments["out_norm_eps"].default_value == pytest.approx(1e-5)


# ------------------------------------------------------------ the plans ---


def test_a_convolution_runs_on_a_layer_step_plan(rng, block_builds):
    problem, layer = fwd_problem(rng, "batched_f32_bias_states")
    flashkda.fwd(**problem.arguments(), lower_bound=problem.lower_bound, **layer.keywords())
    flashkda.fwd(**problem.arguments(), lower_bound=problem.lower_bound)
    flashkda.fwd(**problem.arguments(), lower_bound=problem.lower_bound,
                 out_gate=layer.gate, out_norm_weight=layer.norm_weight)
    assert [block.plan.layer_step for block in block_builds] == [True, False, False]
    with_conv, without = block_builds[0].plan, block_builds[1].plan
    assert with_conv.workspace_size(74, 2) > without.workspace_size(74, 2)


@needs_layer_step
def test_plan_fwd_takes_the_convolution_with_layer_step(rng):
    problem, layer = fwd_problem(rng, "batched_f32_bias_states")
    arguments = problem.arguments()
    states_before = [s.copy() for s in layer.states]
    with flashkda.Plan(2, backend="cpu", lower_bound=problem.lower_bound) as plan:
        assert not plan.layer_step
        with pytest.raises(FlashKDAError) as caught:
            plan.fwd(**arguments, **layer.keywords())
        assert caught.value.message.startswith("layer.conv_weight_q:")
    flashkda.fwd(**arguments, lower_bound=problem.lower_bound, **layer.keywords())
    expected_out, expected_states = problem.out.copy(), [s.copy() for s in layer.states]
    problem.poison_outputs()
    with flashkda.Plan(2, backend="cpu", lower_bound=problem.lower_bound,
                       layer_step=True) as plan:
        assert plan.layer_step
        plan.fwd(**arguments, **dict(layer.keywords(), conv_state=tuple(states_before)))
    np.testing.assert_array_equal(problem.out, expected_out)
    for state, expected in zip(states_before, expected_states):
        np.testing.assert_array_equal(state, expected)


# --------------------------------------------------------------- errors ---


def test_binding_errors_name_the_argument(rng):
    problem, layer = fwd_problem(rng, "batched_f32_bias_states")
    arguments = dict(problem.arguments(), lower_bound=problem.lower_bound)
    cases = [
        (dict(conv_weight=np.zeros((3 * 256 + 1, 4), np.float32)), "conv_weight:"),
        (dict(conv_weight=layer.weights[:2]), "conv_weight:"),
        (dict(conv_weight=layer.weights, conv_state=np.zeros((2, 256), np.float32)),
         "conv_state:"),
        (dict(conv_weight=layer.weights, conv_bias=[b.astype(np.float64) for b in layer.biases]),
         "conv_bias_q:"),
        (dict(conv_weight=layer.weights, out_norm_eps="small"), "out_norm_eps:"),
    ]
    for keywords, expected in cases:
        with pytest.raises(FlashKDAError) as caught:
            flashkda.fwd(**arguments, **keywords)
        assert caught.value.message.startswith(expected), (keywords.keys(), caught.value.message)


@needs_layer_step
def test_library_errors_name_the_argument(rng):
    problem, layer = fwd_problem(rng, "batched_f32_bias_states")
    arguments = dict(problem.arguments(), lower_bound=problem.lower_bound)
    slots = np.array([0, 1, 2], np.int32)
    pool = np.zeros((3, 2, HEAD_DIM, HEAD_DIM), np.float32)
    decode_arguments = dict(arguments, q=problem.q[:, :1], k=problem.k[:, :1],
                            v=problem.v[:, :1], g=problem.g[:, :1], beta=problem.beta[:, :1],
                            out=problem.out[:, :1], state_pool=pool, state_indices=slots[:2])
    for name in ("initial_state", "final_state", "cu_seqlens"):
        decode_arguments.pop(name)
    cases = [
        (flashkda.fwd, arguments, dict(conv_weight=layer.weights,
                                       conv_bias=[b.astype(np.uint16) for b in layer.biases]),
         "layer.conv_bias_q:"),
        (flashkda.fwd, arguments, dict(conv_weight=layer.weights,
                                       conv_state=tuple(s[:1] for s in layer.states)),
         "layer.conv_state_q:"),
        (flashkda.fwd, arguments, dict(conv_bias=layer.biases), "layer.conv_bias_"),
        (flashkda.fwd, arguments, dict(out_gate=layer.gate), "layer.out_norm_weight:"),
        (flashkda.fwd, arguments, dict(out_gate=layer.gate, out_norm_weight=layer.norm_weight,
                                       out_norm_eps=0.0), "layer.out_norm_eps:"),
        (flashkda.decode, decode_arguments, dict(conv_weight=[np.zeros((256, 5), np.float32)] * 3),
         "layer.conv_weight_q:"),
    ]
    for call, base, keywords, expected in cases:
        with pytest.raises(FlashKDAError) as caught:
            call(**base, **keywords)
        assert caught.value.message.startswith(expected), (keywords.keys(), caught.value.message)


def test_the_layer_step_keys_the_argument_blocks(rng, block_builds):
    problem, layer = fwd_problem(rng, "output_gate_only")
    arguments = dict(problem.arguments(), lower_bound=problem.lower_bound, **layer.keywords())
    for eps in (1e-5, 1e-5, 1e-3):
        flashkda.fwd(**arguments, out_norm_eps=eps)
    assert len(block_builds) == 2
    assert [b.args.layer.out_norm_eps for b in block_builds] == pytest.approx([1e-5, 1e-3])


@needs_layer_step
def test_prepared_launches_take_the_layer_step(rng):
    problem, layer = fwd_problem(rng, "batched_f32_bias_states")
    states_before = [s.copy() for s in layer.states]
    flashkda.fwd(**problem.arguments(), lower_bound=problem.lower_bound, **layer.keywords())
    expected_out, expected_states = problem.out.copy(), [s.copy() for s in layer.states]
    assert not np.array_equal(expected_states[0], states_before[0]), "conv_state_q was not updated"
    problem.poison_outputs()
    for state, before in zip(layer.states, states_before):
        state[...] = before
    with flashkda.Plan(2, backend="cpu", lower_bound=problem.lower_bound,
                       layer_step=True) as plan:
        launch = plan.prepare(**problem.arguments(), **layer.keywords(), out_norm_eps=1e-5)
        launch()
    np.testing.assert_array_equal(problem.out, expected_out)
    for state, expected in zip(layer.states, expected_states):
        np.testing.assert_array_equal(state, expected)


@needs_layer_step
def test_decode_with_conv_states_compiles_without_graph_break(rng):
    from torch._dynamo.utils import counters

    inputs, states = torch_decode_call(rng)
    del inputs["out"]
    initial_state_q = states[0].clone()
    pool = torch.randn(4, 2, HEAD_DIM, HEAD_DIM) * 0.1

    def step(state_pool, conv_q, conv_k, conv_v, **arguments):
        out = torch.empty_like(arguments["v"])
        torch.ops.flashkda.decode(out=out, state_pool=state_pool,
                                  conv_state=[conv_q, conv_k, conv_v], **arguments)
        return out.float() * 2.0

    eager_pool, eager_states = pool.clone(), [s.clone() for s in states]
    expected = step(eager_pool, *eager_states, **inputs)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    result = compiled(pool, *states, **inputs)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.equal(result, expected)
    assert torch.equal(pool, eager_pool)
    for state, eager in zip(states, eager_states):
        assert torch.equal(state, eager)
    assert not torch.equal(states[0], initial_state_q)
