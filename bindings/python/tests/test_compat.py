# SPDX-License-Identifier: MIT
"""flashkda.compat: FlashKDA's Python API on libflashkda, and the opt-in
`flash_kda` alias.

What touches sys.modules and sys.meta_path runs in a child interpreter, so
this process keeps no alias. The forward passes run on the CPU backend with
torch CPU tensors.
"""

import inspect
import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest

import flashkda
from flashkda import Plan

torch = pytest.importorskip("torch", reason="torch is not installed")
from flashkda import compat  # noqa: E402  (imports torch)

PYTHON_BINDINGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_DIM = 128


def run_child(code, extra_path=()):
    """Runs `code` in a fresh interpreter that finds this flashkda (and
    `extra_path` first); returns the JSON object it prints last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        list(extra_path) + [PYTHON_BINDINGS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------ the alias ---


def test_plain_import_registers_nothing():
    state = run_child("""
        import importlib.util, json, sys
        import flashkda
        after_flashkda = importlib.util.find_spec("flash_kda") is None
        import flashkda.compat
        after_compat = importlib.util.find_spec("flash_kda") is None
        try:
            import flash_kda
            imported = True
        except ImportError:
            imported = False
        print(json.dumps(dict(after_flashkda=after_flashkda, after_compat=after_compat,
                              imported=imported, in_modules="flash_kda" in sys.modules,
                              finders=[type(f).__name__ for f in sys.meta_path])))
    """)
    assert state["after_flashkda"], "import flashkda made flash_kda findable"
    assert state["after_compat"], "import flashkda.compat made flash_kda findable"
    assert not state["imported"] and not state["in_modules"]
    assert "_AliasImporter" not in state["finders"]


def test_alias_resolves_for_import_and_find_spec():
    state = run_child("""
        import importlib, importlib.util, json, sys
        import flashkda.compat as compat
        returned = compat.register_as_flash_kda()
        # FLA's probe: a spec, before and after the import.
        spec = importlib.util.find_spec("flash_kda")
        import flash_kda
        spec_after = importlib.util.find_spec("flash_kda")
        again = compat.register_as_flash_kda()
        del sys.modules["flash_kda"]
        reimported = importlib.import_module("flash_kda")
        from flash_kda import fwd, get_workspace_size
        print(json.dumps(dict(
            spec_name=spec.name, spec_origin=spec.origin,
            module_spec_name=flash_kda.__spec__.name,
            spec_after_name=spec_after.name,
            name=flash_kda.__name__,
            returned_is_module=returned is flash_kda,
            again_is_module=again is flash_kda,
            reimported_spec=reimported.__spec__.name,
            fwd_is_compat=fwd is compat.fwd and flash_kda.fwd is compat.fwd,
            size_is_compat=get_workspace_size is compat.get_workspace_size,
            finders=sum(type(f).__name__ == "_AliasImporter" for f in sys.meta_path),
        )))
    """)
    assert state["spec_name"] == "flash_kda"
    assert state["spec_origin"].endswith("compat.py")
    assert state["module_spec_name"] == "flash_kda"
    assert state["spec_after_name"] == "flash_kda"
    assert state["name"] == "flash_kda"
    assert state["returned_is_module"] and state["again_is_module"]
    assert state["reimported_spec"] == "flash_kda"
    assert state["fwd_is_compat"] and state["size_is_compat"]
    assert state["finders"] == 1, "registering twice installed two finders"


@pytest.fixture
def real_flash_kda(tmp_path):
    """A directory holding a stand-in for an installed FlashKDA package."""
    package = tmp_path / "flash_kda"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    return str(tmp_path)


def test_refuses_an_installed_flash_kda(real_flash_kda):
    state = run_child("""
        import importlib, importlib.util, json, sys
        import flashkda.compat as compat
        try:
            compat.register_as_flash_kda()
            refusal = None
        except RuntimeError as error:
            refusal = str(error)
        import flash_kda
        still_real = getattr(flash_kda, "REAL", False)
        spec_real = importlib.util.find_spec("flash_kda").origin
        # Already imported: refused too.
        try:
            compat.register_as_flash_kda()
            refusal_loaded = None
        except RuntimeError as error:
            refusal_loaded = str(error)
        replaced = compat.register_as_flash_kda(replace=True)
        import flash_kda as after
        print(json.dumps(dict(
            refusal=refusal, refusal_loaded=refusal_loaded, still_real=still_real,
            spec_real=spec_real, replaced_is_ours=after is replaced and after.fwd is compat.fwd,
            spec_after=importlib.util.find_spec("flash_kda").origin,
        )))
    """, extra_path=[real_flash_kda])
    assert state["refusal"] is not None, "registered over an installed flash_kda"
    assert os.path.join(real_flash_kda, "flash_kda") in state["refusal"]
    assert "replace=True" in state["refusal"]
    assert state["still_real"], "the refusal disturbed the installed flash_kda"
    assert state["spec_real"].startswith(real_flash_kda)
    assert state["refusal_loaded"] is not None and "already imported" in state["refusal_loaded"]
    assert state["replaced_is_ours"]
    assert state["spec_after"].endswith("compat.py")


# ---------------------------------------------------------------- fwd ---


def test_signature_and_defaults_are_flash_kdas():
    parameters = inspect.signature(compat.fwd).parameters
    assert list(parameters) == ["q", "k", "v", "g", "beta", "scale", "out", "A_log", "dt_bias",
                                "lower_bound", "initial_state", "final_state", "cu_seqlens"]
    defaults = {name: p.default for name, p in parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults == {"initial_state": None, "final_state": None, "cu_seqlens": None}
    assert inspect.signature(compat.get_workspace_size).parameters["N"].default == 1


def make_inputs(seed, *, batch=2, seq_len=37, heads=3, seq_lens=None, state_dtype=torch.float32):
    """FlashKDA's argument set as torch CPU tensors (outputs NaN-filled)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, dtype=torch.bfloat16, std=1.0):
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    cu_seqlens = None
    if seq_lens is not None:
        batch, seq_len = 1, sum(seq_lens)
        cu_seqlens = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)), dtype=torch.int64)
    num_seqs = batch if seq_lens is None else len(seq_lens)
    shape = (batch, seq_len, heads, HEAD_DIM)
    state_shape = (num_seqs, heads, HEAD_DIM, HEAD_DIM)
    return dict(
        q=normal(*shape), k=normal(*shape), v=normal(*shape), g=normal(*shape),
        beta=normal(batch, seq_len, heads),
        scale=HEAD_DIM ** -0.5,
        out=torch.full(shape, float("nan"), dtype=torch.bfloat16),
        A_log=torch.rand(heads, generator=generator),
        dt_bias=torch.rand(heads, HEAD_DIM, generator=generator),
        lower_bound=-4.0,
        initial_state=normal(*state_shape, dtype=state_dtype, std=0.1),
        final_state=torch.full(state_shape, float("nan"), dtype=state_dtype),
        cu_seqlens=cu_seqlens,
    )


def copy_inputs(inputs):
    """A copy of every tensor in the same layout (strides included)."""

    def copy(tensor):
        twin = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device=tensor.device)
        return twin.copy_(tensor)

    return {name: copy(value) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}


CASES = {
    "batched_f32_state": dict(),
    "batched_bf16_state": dict(state_dtype=torch.bfloat16),
    "varlen": dict(seq_lens=[5, 40, 16, 1]),
}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def on_device(inputs, device):
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_compat_fwd_equals_flashkda_fwd(case, device):
    inputs = on_device(make_inputs(zlib_seed(case), **CASES[case]), device)
    ours = copy_inputs(inputs)
    # Called as FLA calls it: the gate arguments and the states by keyword.
    compat.fwd(ours["q"], ours["k"], ours["v"], ours["g"], ours["beta"], ours["scale"], ours["out"],
               A_log=ours["A_log"], dt_bias=ours["dt_bias"], lower_bound=ours["lower_bound"],
               initial_state=ours["initial_state"], final_state=ours["final_state"],
               cu_seqlens=ours["cu_seqlens"])
    reference = copy_inputs(inputs)
    flashkda.fwd(**reference)
    for name in ("out", "final_state"):
        assert not torch.isnan(ours[name].float()).any(), f"{name} not written"
        assert ours[name].float().abs().max() > 0, f"{name} all zero"
        assert torch.equal(ours[name], reference[name]), f"{name} differs from flashkda.fwd"


def test_without_states():
    inputs = make_inputs(7, batch=1, seq_len=20, heads=2)
    inputs.update(initial_state=None, final_state=None)
    ours, reference = copy_inputs(inputs), copy_inputs(inputs)
    compat.fwd(**ours)
    flashkda.fwd(**reference)
    assert torch.equal(ours["out"], reference["out"])
    assert not torch.isnan(ours["out"].float()).any()


def zlib_seed(text):
    return zlib.crc32(text.encode())


def _strided(tensor):
    """The same values in a non-contiguous layout libflashkda takes (a padded head axis)."""
    batch, seq_len, heads, dim = tensor.shape
    view = torch.zeros(batch, seq_len, heads + 1, dim, dtype=tensor.dtype)[:, :, :heads]
    return view.copy_(tensor)


# (what changes, whether flashkda.fwd takes it, exception, words of the message).
REFUSALS = {
    "beta_f32": (lambda a: a.update(beta=a["beta"].float()), True, compat.CompatError,
                 "beta: must be bfloat16"),
    "cu_seqlens_int32": (lambda a: a.update(cu_seqlens=a["cu_seqlens"].int()), True,
                         compat.CompatError, "cu_seqlens: must be int64"),
    "q_not_contiguous": (lambda a: a.update(q=_strided(a["q"])), True, compat.CompatError,
                         "q: must be contiguous"),
    "A_log_none": (lambda a: a.update(A_log=None), True, compat.CompatTypeError,
                   "A_log: expected a torch.Tensor"),
    "dt_bias_none": (lambda a: a.update(dt_bias=None), True, compat.CompatTypeError,
                     "dt_bias: expected a torch.Tensor"),
    "lower_bound_none": (lambda a: a.update(lower_bound=None), True, compat.CompatTypeError,
                         "lower_bound: expected a number"),
    "numpy_q": (lambda a: a.update(q=flashkda.to_bf16(a["q"].float().numpy())), None,
                compat.CompatTypeError, "q: expected a torch.Tensor"),
    "dt_bias_flat": (lambda a: a.update(dt_bias=a["dt_bias"].reshape(-1)), None,
                     compat.CompatError, "dt_bias: must be [H, K]"),
    "mixed_state_dtypes": (lambda a: a.update(final_state=a["final_state"].bfloat16()), None,
                           compat.CompatError, "must have one dtype"),
    "batch_with_cu_seqlens": (lambda a: a.update(cu_seqlens=torch.tensor([0, 37], dtype=torch.int64)),
                              None, compat.CompatError, "batch must be 1"),
    "k_wrong_shape": (lambda a: a.update(k=a["k"][:, :-1].contiguous()), False,
                      compat.CompatError, "k"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refuses_what_flash_kda_refuses(case):
    change, flashkda_takes_it, error_type, words = REFUSALS[case]
    varlen = "cu_seqlens" in case and case != "batch_with_cu_seqlens"
    inputs = make_inputs(zlib_seed(case), **(dict(seq_lens=[10, 27]) if varlen else {}))
    change(inputs)
    if flashkda_takes_it:
        # libflashkda itself takes the call: the refusal is compat's own.
        flashkda.fwd(**copy_inputs(inputs))
    with pytest.raises(error_type) as caught:
        compat.fwd(**copy_inputs(inputs))
    assert words in str(caught.value)
    assert str(caught.value).startswith("flash_kda.fwd: ")
    assert isinstance(caught.value, flashkda.FlashKDAError)
    # FlashKDA raises RuntimeError for refused values and TypeError for wrong types.
    assert isinstance(caught.value, RuntimeError if error_type is compat.CompatError else TypeError)


# ------------------------------------------------------ workspace size ---


@pytest.mark.parametrize("case", CASES)
def test_workspace_size_is_enough_for_the_call(case):
    inputs = make_inputs(zlib_seed("ws" + case), **CASES[case])
    batch, seq_len, heads, _ = inputs["q"].shape
    num_seqs = inputs["initial_state"].shape[0]
    size = compat.get_workspace_size(batch * seq_len, heads, num_seqs)
    state_dtype = "bf16" if inputs["initial_state"].dtype == torch.bfloat16 else "f32"
    with Plan(heads, backend="cpu", state_dtype=state_dtype,
              lower_bound=inputs["lower_bound"]) as plan:
        assert size >= plan.workspace_size(batch * seq_len, num_seqs) > 0
        exact = copy_inputs(inputs)
        # A workspace of exactly get_workspace_size bytes, as a caller that preallocates passes it.
        plan.fwd(exact["q"], exact["k"], exact["v"], exact["g"], exact["beta"], exact["scale"],
                 exact["out"], exact["A_log"], exact["dt_bias"], exact["initial_state"],
                 exact["final_state"], exact["cu_seqlens"],
                 workspace=torch.empty(size, dtype=torch.uint8))
        # One byte less than the plan needs is refused: the call does check.
        short = copy_inputs(inputs)
        with pytest.raises(flashkda.FlashKDAError, match="workspace"):
            plan.fwd(short["q"], short["k"], short["v"], short["g"], short["beta"],
                     short["scale"], short["out"], short["A_log"], short["dt_bias"],
                     short["initial_state"], short["final_state"], short["cu_seqlens"],
                     workspace=torch.empty(plan.workspace_size(batch * seq_len, num_seqs) - 1,
                                           dtype=torch.uint8))
    reference = copy_inputs(inputs)
    flashkda.fwd(**reference)
    assert torch.equal(exact["out"], reference["out"])


def test_workspace_size_covers_the_gpu_backend():
    try:
        gpu_plan = Plan(4, backend="gpu")
    except flashkda.FlashKDAError as error:
        pytest.skip(f"no GPU plan here: {error}")
    with gpu_plan, Plan(4, backend="cpu") as cpu_plan:
        for tokens, seqs in ((1, 1), (4096, 1), (8192, 7), (100_000, 64)):
            size = compat.get_workspace_size(tokens, 4, seqs)
            assert size >= gpu_plan.workspace_size(tokens, seqs)
            assert size >= cpu_plan.workspace_size(tokens, seqs)


def test_workspace_size_arguments():
    assert compat.get_workspace_size(64, 2) == compat.get_workspace_size(64, 2, 1)
    assert compat.get_workspace_size(10_000, 8, 3) >= compat.get_workspace_size(1_000, 8, 3)
    with pytest.raises(compat.CompatError, match="H: must be >= 1"):
        compat.get_workspace_size(64, 0)
    with pytest.raises(compat.CompatTypeError, match="T_total: expected an integer"):
        compat.get_workspace_size(64.5, 2)


def test_checks_once_per_layout(block_builds, monkeypatch):
    checked = []
    original = compat._check

    def counting(*args):
        checked.append(args)
        return original(*args)

    monkeypatch.setattr(compat, "_check", counting)
    inputs = make_inputs(11, batch=1, seq_len=16, heads=2)
    for _ in range(3):
        compat.fwd(**copy_inputs(inputs))
    assert len(block_builds) == 1 and len(checked) == 1
    # flashkda.fwd on the same layout keeps its own block: compat's refusals
    # never ride on a block built without them.
    flashkda.fwd(**copy_inputs(inputs))
    assert len(block_builds) == 2 and len(checked) == 1
    # A new layout is checked again.
    compat.fwd(**copy_inputs(make_inputs(12, batch=1, seq_len=32, heads=2)))
    assert len(block_builds) == 3 and len(checked) == 2
