#!/usr/bin/env python3
"""What the Python binding adds to the kernel, per case, on one GPU with torch.

For each case: fkda-bench's median (the C call alone), then flashkda.fwd,
a prepared launch (Plan.prepare) and torch.ops.flashkda.fwd on preallocated
torch tensors of the same shape, each timed with triton.testing.do_bench
(median; CUDA events around each call with the L2 cache flushed before it,
when triton is missing), and the host time of one call (a loop of calls with
no synchronisation, divided by their number). Overhead is a call's median
minus fkda-bench's. Prints a markdown table, and writes it with the figures
as JSON under $OUT when OUT is set.

    python3 bench/python_overhead.py [--build build] [--cases P10,P1,P4,P6,P9]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPOSITORY, "bindings", "python"))

HEAD_DIM = 128
HOST_LOOP_CALLS = 200


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build",
                        help="build directory with libflashkda.so.0 and bench/fkda-bench")
    parser.add_argument("--cases", default="P10,P1,P4,P6,P9",
                        help="comma-separated fkda-bench case ids")
    parser.add_argument("--lower-bound", type=float, default=-5.0)
    return parser.parse_args()


def kernel_figures(build, cases, lower_bound):
    """fkda-bench's JSON entries by case id (bf16 state, as in BENCHMARKS.md)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.json")
        subprocess.run([os.path.join(build, "bench", "fkda-bench"), *cases, "--state", "bf16",
                        "--lower-bound", str(lower_bound), "--json", path],
                       check=True, stdout=subprocess.DEVNULL)
        with open(path) as file:
            document = json.load(file)
    return {entry["id"]: entry for entry in document["prefill"]}, document


class Inputs:
    """Random inputs of one case on the GPU, as BENCHMARKS.md draws them."""

    def __init__(self, torch, shape, lower_bound):
        B, T, H = shape["B"], shape["T"], shape["H"]
        device = torch.device("cuda")
        generator = torch.Generator(device=device).manual_seed(1)

        def normal(*size):
            return torch.randn(*size, generator=generator, device=device).to(torch.bfloat16)

        self.q, self.k, self.v, self.g = (normal(B, T, H, HEAD_DIM) for _ in range(4))
        self.beta = normal(B, T, H)
        self.A_log = torch.rand(H, generator=generator, device=device)
        self.dt_bias = torch.rand(H, HEAD_DIM, generator=generator, device=device)
        num_seqs = shape["num_seqs"]
        self.initial_state = (0.1 * torch.randn(num_seqs, H, HEAD_DIM, HEAD_DIM, device=device,
                                                generator=generator)).to(torch.bfloat16)
        self.final_state = torch.empty_like(self.initial_state)
        self.out = torch.empty_like(self.v)
        self.cu_seqlens = None
        if "lengths" in shape:
            offsets = [0]
            for length in shape["lengths"]:
                offsets.append(offsets[-1] + length)
            self.cu_seqlens = torch.tensor(offsets, dtype=torch.int64, device=device)
        self.scale = HEAD_DIM ** -0.5
        self.lower_bound = lower_bound
        self.heads = H

    def positional(self):
        return (self.q, self.k, self.v, self.g, self.beta, self.scale, self.out, self.A_log,
                self.dt_bias, self.lower_bound)

    def optional(self):
        return dict(initial_state=self.initial_state, final_state=self.final_state,
                    cu_seqlens=self.cu_seqlens)


def device_timer(torch):
    """A function timing a callable on the GPU: median ms."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        def timed(fn):
            try:
                return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
            except TypeError:  # triton releases without return_mode
                return float(do_bench(fn, warmup=25, rep=200, quantiles=[0.5]))
        return timed, "triton.testing.do_bench (median)"

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")

    def timed(fn):
        for _ in range(10):
            fn()
        times = []
        for _ in range(100):
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    return timed, "CUDA events around each call, L2 flushed before it (median of 100)"


def host_us_per_call(torch, fn):
    """Wall time of one call as the host sees it: nothing waits for the GPU
    inside the loop, so this is the Python, ctypes and launch cost."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_LOOP_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_LOOP_CALLS * 1e6


def measure(torch, flashkda, inputs, timed):
    positional, optional = inputs.positional(), inputs.optional()
    plan = flashkda.Plan(inputs.heads, backend="gpu", state_dtype="bf16",
                         lower_bound=inputs.lower_bound)
    prepared = plan.prepare(*positional[:9], **optional)
    op = torch.ops.flashkda.fwd.default
    calls = {
        "flashkda.fwd": lambda: flashkda.fwd(*positional, **optional),
        "prepared": prepared,
        "torch.ops.flashkda.fwd": lambda: op(*positional, **optional),
    }
    figures = {}
    for name, fn in calls.items():
        figures[name] = {"ms": timed(fn), "host_us": host_us_per_call(torch, fn)}
    plan.close()
    return figures


def markdown(rows, timer_name, commit):
    lines = [
        f"Commit {commit}; {timer_name}; bf16 state, initial and final state present, "
        "preallocated torch tensors. Overhead: a call's median minus fkda-bench's; "
        f"host µs: wall time of one call in a loop of {HOST_LOOP_CALLS} without synchronisation.",
        "",
        "| case | shape | fkda-bench ms | flashkda.fwd ms | overhead µs | prepared ms | "
        "overhead µs | torch.ops.flashkda.fwd ms | overhead µs | host µs/call (fwd / prepared / op) "
        "| flash_kda.fwd ms (quoted) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        cells = [row["id"], row["shape"], f"{row['kernel_ms']:.3f}"]
        for name in ("flashkda.fwd", "prepared", "torch.ops.flashkda.fwd"):
            ms = row["calls"][name]["ms"]
            cells += [f"{ms:.3f}", f"{(ms - row['kernel_ms']) * 1e3:+.1f}"]
        cells.append(" / ".join(f"{row['calls'][name]['host_us']:.1f}"
                                for name in ("flashkda.fwd", "prepared", "torch.ops.flashkda.fwd")))
        quoted = row["flashkda_ms"]
        cells.append("—" if quoted is None else f"{quoted:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    arguments = parse_arguments()
    build = os.path.abspath(arguments.build)
    os.environ.setdefault("FLASHKDA_LIBRARY", os.path.join(build, "libflashkda.so.0"))
    import torch

    import flashkda

    if not torch.cuda.is_available():
        sys.exit("python_overhead.py: torch sees no CUDA device")
    cases = [case.strip() for case in arguments.cases.split(",") if case.strip()]
    kernels, document = kernel_figures(build, cases, arguments.lower_bound)
    timed, timer_name = device_timer(torch)
    rows = []
    for case in cases:
        entry = kernels[case.upper()]
        inputs = Inputs(torch, entry["shape"], arguments.lower_bound)
        rows.append({
            "id": entry["id"],
            "shape": entry["shape_text"],
            "kernel_ms": entry["ms"]["median"],
            "flashkda_ms": entry["peers"]["flashkda_ms"],
            "calls": measure(torch, flashkda, inputs, timed),
        })
        del inputs
        torch.cuda.empty_cache()
    commit = document.get("commit") or "unknown"
    table = markdown(rows, timer_name, commit)
    print(table)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "python_overhead.md"), "w") as file:
            file.write(table)
        with open(os.path.join(out_dir, "python_overhead.json"), "w") as file:
            json.dump({"commit": commit, "timer": timer_name, "device": document.get("device"),
                       "torch": torch.__version__, "rows": rows}, file, indent=2)
        print(f"wrote {out_dir}/python_overhead.md and python_overhead.json")


if __name__ == "__main__":
    main()
