#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""libflashkda behind FLA's `flash_kda` backend, on one GPU.

Two steps, each in its own process (FLA caches whether flash_kda exists):

  tests  registers flashkda.compat as flash_kda, then runs FLA's FlashKDA
         backend tests (pytest `-k flash_kda` on FLA's tests/ops/test_kda.py)
         and records every test's outcome.
  time   times one fla.ops.kda.chunk_kda call per case under
         torch.inference_mode(), as FLA's FlashKDA backend takes it (bounded
         gate, l2-normalised q and k in the kernel, beta logits, f32 states
         with the value axis first), twice: with the alias (FLA hands the call
         to flash_kda.fwd, counted to prove it) and with FLA_FLASH_KDA=0 (FLA's
         Triton chunk_kda). Median ms from triton.testing.do_bench, and how far
         the two outputs are apart.

Each step writes a JSON file under --out; `summary` merges them into
fla_compat.md there. scripts/fla_compat_check.sh runs all three.

    PYTHONPATH=<fla-core>:bindings/python FLASHKDA_LIBRARY=build/libflashkda.so.0 \\
        python3 bench/fla_compat.py tests --test-file .fla-wheels/test_kda.py --out $OUT
"""

import argparse
import json
import os
import platform
import sys
import time

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPOSITORY, "bindings", "python"))

HEAD_DIM = 128
LOWER_BOUND = -5.0

# name -> (batch, tokens per sequence or varlen lengths, heads); the prefill
# cases of bench/cases.json that FLA's FlashKDA backend takes.
CASES = {
    "P1": (1, 8192, 96),
    "P4": (1, 8192, 8),
    "P6": (4, 2048, 32),
    "P7": (1, [1300, 547, 2048, 963, 271, 3063], 96),
    "P10": (1, 512, 32),
    "P11": (1, 8192, 12),
}


def environment():
    import torch

    import flashkda

    info = dict(python=platform.python_version(), torch=torch.__version__,
                library=flashkda.library_path(), library_version=flashkda.version())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
        info["fla_path"] = os.path.dirname(fla.__file__)
    except ImportError as error:
        info["fla"] = f"not importable: {error}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["kernels"] = flashkda.build_info().architectures
    return info


def write(out, name, payload):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
    print(f"wrote {path}")


# ---------------------------------------------------------------- tests ---


class Outcomes:
    """A pytest plugin that keeps each test's outcome and duration."""

    def __init__(self):
        self.tests = {}

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] += report.duration
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = str(report.longrepr)[-2000:]
        elif report.skipped:
            entry["outcome"] = "skipped"
            entry["message"] = str(report.longrepr)[-500:]

    def pytest_collectreport(self, report):
        if report.failed:
            self.tests[report.nodeid or "collection"] = {
                "outcome": "error", "seconds": 0.0, "message": str(report.longrepr)[-4000:]}


def run_tests(args):
    import pytest

    from flashkda import compat

    compat.register_as_flash_kda()
    import flash_kda  # noqa: F401  (the alias)

    calls = {"n": 0}
    forward = compat.fwd

    def counted(*a, **k):
        calls["n"] += 1
        return forward(*a, **k)

    # FLA's backend calls flash_kda.fwd; the tests wrap it again to check dispatch.
    flash_kda.fwd = counted
    outcomes = Outcomes()
    started = time.time()
    status = pytest.main([args.test_file, "-k", args.select, "-q", "-rA", "-p", "no:cacheprovider",
                          f"--rootdir={os.path.dirname(os.path.abspath(args.test_file))}"],
                         plugins=[outcomes])
    counts = {}
    for entry in outcomes.tests.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    result = dict(environment=environment(), test_file=os.path.abspath(args.test_file),
                  select=args.select, pytest_status=int(status), counts=counts,
                  flash_kda_fwd_calls=calls["n"], seconds=round(time.time() - started, 1),
                  tests=outcomes.tests)
    write(args.out, "fla_tests.json", result)
    print(json.dumps(dict(counts=counts, flash_kda_fwd_calls=calls["n"]), indent=2))
    return 0 if status == 0 and counts.get("passed", 0) > 0 else 1


# ----------------------------------------------------------------- time ---


def make_inputs(case, seed=0):
    import torch

    batch, lengths, heads = CASES[case]
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cu_seqlens = None
    if isinstance(lengths, list):
        tokens, num_seqs = sum(lengths), len(lengths)
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int64, device="cuda")
    else:
        tokens, num_seqs = lengths, batch

    def normal(*shape, dtype=torch.bfloat16, std=1.0):
        values = torch.randn(*shape, generator=generator, device="cuda") * std
        return values.to(dtype)

    shape = (batch, tokens, heads, HEAD_DIM)
    return dict(
        q=normal(*shape), k=normal(*shape), v=normal(*shape), g=normal(*shape),
        beta=normal(batch, tokens, heads),
        A_log=torch.log(torch.empty(heads, device="cuda").uniform_(1, 16, generator=generator)),
        dt_bias=normal(heads * HEAD_DIM, dtype=torch.float32),
        initial_state=normal(num_seqs, heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, std=0.1),
        cu_seqlens=cu_seqlens,
    )


def chunk_kda_call(inputs):
    from fla.ops.kda import chunk_kda

    def call():
        return chunk_kda(
            q=inputs["q"], k=inputs["k"], v=inputs["v"], g=inputs["g"], beta=inputs["beta"],
            A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], scale=HEAD_DIM ** -0.5,
            initial_state=inputs["initial_state"], output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
            state_v_first=True, cu_seqlens=inputs["cu_seqlens"])

    return call


def median_ms(call, warmup_ms, rep_ms):
    import triton.testing

    return float(triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms,
                                         return_mode="median"))


def relative_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_timing(args):
    import torch

    from flashkda import compat

    compat.register_as_flash_kda()
    import flash_kda

    forward = compat.fwd
    calls = {"n": 0}

    def counted(*a, **k):
        calls["n"] += 1
        return forward(*a, **k)

    results = dict(environment=environment(), cases={},
                   method="triton.testing.do_bench median, warmup "
                          f"{args.warmup_ms} ms, rep {args.rep_ms} ms, under torch.inference_mode()")
    for case in args.cases.split(","):
        inputs = make_inputs(case)
        call = chunk_kda_call(inputs)
        entry = dict(shape=CASES[case])
        def run_path(flash_kda_flag):
            """One counted call (its result, and how often it reached
            flash_kda.fwd), then the path's median ms."""
            os.environ["FLA_FLASH_KDA"] = flash_kda_flag
            flash_kda.fwd = counted
            calls["n"] = 0
            result = call()
            torch.cuda.synchronize()
            reached = calls["n"]
            flash_kda.fwd = forward
            return result, reached, median_ms(call, args.warmup_ms, args.rep_ms)

        with torch.inference_mode():
            # The alias path: FLA must hand the call to flash_kda.fwd.
            (out_alias, state_alias), entry["alias_calls_flash_kda_fwd"], entry["flashkda_ms"] = run_path("1")
            # FLA's own path, FlashKDA's backend switched off as FLA documents.
            (out_triton, state_triton), entry["triton_calls_flash_kda_fwd"], entry["triton_ms"] = run_path("0")
            os.environ["FLA_FLASH_KDA"] = "1"

        entry["speedup"] = entry["triton_ms"] / entry["flashkda_ms"]
        entry["out_rel_rms_vs_triton"] = relative_rms(out_alias, out_triton)
        entry["state_rel_rms_vs_triton"] = relative_rms(state_alias, state_triton)
        entry["finite"] = bool(torch.isfinite(out_alias.float()).all()
                               and torch.isfinite(state_alias).all())
        results["cases"][case] = entry
        print(case, json.dumps(entry))
        write(args.out, "fla_timing.json", results)  # after each case: partial results survive
        del inputs, out_alias, out_triton, state_alias, state_triton
        torch.cuda.empty_cache()
    ok = all(e["alias_calls_flash_kda_fwd"] == 1 and e["triton_calls_flash_kda_fwd"] == 0
             and e["finite"] for e in results["cases"].values())
    return 0 if ok else 1


# -------------------------------------------------------------- summary ---


def summary(args):
    lines = ["# libflashkda as FLA's flash_kda backend", ""]
    tests_path = os.path.join(args.out, "fla_tests.json")
    timing_path = os.path.join(args.out, "fla_timing.json")
    environment_info = None
    if os.path.exists(tests_path):
        with open(tests_path) as handle:
            tests = json.load(handle)
        environment_info = tests["environment"]
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(tests["counts"].items()))
        lines += [f"FLA's tests (`{os.path.basename(tests['test_file'])} -k {tests['select']}`): "
                  f"{counts or 'none collected'}; flash_kda.fwd called {tests['flash_kda_fwd_calls']} "
                  f"times; {tests['seconds']} s.", ""]
        for nodeid, entry in sorted(tests["tests"].items()):
            lines.append(f"- {entry['outcome']}: {nodeid}")
            message = entry.get("message", "").strip().splitlines()
            errors = [line for line in message if line.startswith("E ")] or message[-1:]
            if entry["outcome"] in ("failed", "error") and errors:
                lines.append("  " + " / ".join(line[1:].strip() for line in errors[:3])[:400])
        lines.append("")
    else:
        lines += ["FLA's tests: no result (the step did not finish).", ""]
    if os.path.exists(timing_path):
        with open(timing_path) as handle:
            timing = json.load(handle)
        environment_info = environment_info or timing["environment"]
        lines += [f"chunk_kda, one call ({timing['method']}):", "",
                  "| case | shape | flash_kda = libflashkda ms | FLA Triton ms | Triton / ours "
                  "| out rel. RMS vs Triton | state rel. RMS | flash_kda.fwd calls (alias / Triton) |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for case, e in timing["cases"].items():
            lines.append(
                f"| {case} | {e['shape']} | {e['flashkda_ms']:.3f} | {e['triton_ms']:.3f} | "
                f"{e['speedup']:.2f} | {e['out_rel_rms_vs_triton']:.1e} | "
                f"{e['state_rel_rms_vs_triton']:.1e} | {e['alias_calls_flash_kda_fwd']} / "
                f"{e['triton_calls_flash_kda_fwd']} |")
        lines.append("")
    else:
        lines += ["Timing: no result (the step did not finish).", ""]
    if environment_info:
        lines += ["Environment: " + ", ".join(f"{k} {v}" for k, v in environment_info.items()), ""]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "fla_compat.md"), "w") as handle:
        handle.write(text)
    print(text)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("tests", "time", "summary"))
    parser.add_argument("--out", default=os.environ.get("OUT", "fla_compat_out"))
    parser.add_argument("--test-file", default=os.path.join(REPOSITORY, ".fla-wheels", "test_kda.py"),
                        help="FLA's tests/ops/test_kda.py")
    parser.add_argument("--select", default="flash_kda",
                        help="pytest -k expression choosing FLA's FlashKDA backend tests")
    parser.add_argument("--cases", default="P1,P11", help=f"of {', '.join(CASES)}")
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    args = parser.parse_args()
    step = {"tests": run_tests, "time": run_timing, "summary": summary}[args.step]
    sys.exit(step(args))


if __name__ == "__main__":
    main()
