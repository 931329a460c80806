#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What the Python binding adds to the kernel, per case, on one GPU with torch.

For each case: fkda-bench's median (the C call alone), then the module
function (flashkda.fwd for prefill cases P*, flashkda.decode for decode cases
D*), a prepared launch (Plan.prepare / Plan.prepare_decode) and the torch
operator (torch.ops.flashkda.fwd / .decode) on preallocated torch tensors of
the same shape, each timed with triton.testing.do_bench
(median; CUDA events around each call with the L2 cache flushed before it,
when triton is missing), and the host time of one call (a loop of calls with
no synchronisation, divided by their number). Overhead is a call's median
minus fkda-bench's. Prints a markdown table, and writes it with the figures
as JSON under $OUT when OUT is set.

    python3 bench/python_overhead.py [--build build] [--cases P10,P1,P4,P6,P9,D1,D3]
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
    parser.add_argument("--cases", default="P10,P1,P4,P6,P9,D1,D3",
                        help="comma-separated fkda-bench case ids: prefill P*, decode D*")
    parser.add_argument("--lower-bound", type=float, default=-5.0)
    return parser.parse_args()


def kernel_figures(build, cases, lower_bound):
    """fkda-bench's JSON entries by case id (bf16 state for prefill, as in
    docs/BENCHMARKS.md; decode cases carry their own pool dtype)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.json")
        subprocess.run([os.path.join(build, "bench", "fkda-bench"), *cases, "--state", "bf16",
                        "--lower-bound", str(lower_bound), "--json", path],
                       check=True, stdout=subprocess.DEVNULL)
        with open(path) as file:
            document = json.load(file)
    entries = document["prefill"] + document.get("serving", [])
    return {entry["id"]: entry for entry in entries}, document


class _Activations:
    """q, k, v, g, beta, A_log, dt_bias and out of `rows` x `tokens` tokens on
    the GPU, drawn as docs/BENCHMARKS.md draws them (seeded)."""

    def __init__(self, torch, rows, tokens, heads, lower_bound):
        self.generator = torch.Generator(device="cuda").manual_seed(1)

        def normal_bf16(*size):
            return torch.randn(*size, generator=self.generator, device="cuda").to(torch.bfloat16)

        self.q, self.k, self.v, self.g = (normal_bf16(rows, tokens, heads, HEAD_DIM)
                                          for _ in range(4))
        self.beta = normal_bf16(rows, tokens, heads)
        self.A_log = torch.rand(heads, generator=self.generator, device="cuda")
        self.dt_bias = torch.rand(heads, HEAD_DIM, generator=self.generator, device="cuda")
        self.out = torch.empty_like(self.v)
        self.scale = HEAD_DIM ** -0.5
        self.lower_bound = lower_bound
        self.heads = heads

    def positional(self):
        """The arguments both entry points start with, up to dt_bias."""
        return (self.q, self.k, self.v, self.g, self.beta, self.scale, self.out, self.A_log,
                self.dt_bias)

    def states(self, torch, count, dtype):
        return (0.1 * torch.randn(count, self.heads, HEAD_DIM, HEAD_DIM, device="cuda",
                                  generator=self.generator)).to(dtype)


class PrefillInputs(_Activations):
    """A prefill case with bf16 initial and final states."""

    plan_state = "bf16"

    def __init__(self, torch, entry, lower_bound):
        shape = entry["shape"]
        super().__init__(torch, shape["B"], shape["T"], shape["H"], lower_bound)
        self.initial_state = self.states(torch, shape["num_seqs"], torch.bfloat16)
        self.final_state = torch.empty_like(self.initial_state)
        self.cu_seqlens = None
        if "lengths" in shape:
            offsets = [0]
            for length in shape["lengths"]:
                offsets.append(offsets[-1] + length)
            self.cu_seqlens = torch.tensor(offsets, dtype=torch.int64, device="cuda")

    def calls(self, torch, flashkda, plan):
        positional = self.positional()
        optional = dict(initial_state=self.initial_state, final_state=self.final_state,
                        cu_seqlens=self.cu_seqlens)
        op = torch.ops.flashkda.fwd.default
        return {
            "module": lambda: flashkda.fwd(*positional, self.lower_bound, **optional),
            "prepared": plan.prepare(*positional, **optional),
            "op": lambda: op(*positional, self.lower_bound, **optional),
        }


class DecodeInputs(_Activations):
    """A decode case: one token for each of N sequences, states in a pool
    whose slots the sequences read and write (every other slot)."""

    def __init__(self, torch, entry, lower_bound):
        shape = entry["shape"]
        N = shape["N"]
        super().__init__(torch, N, 1, shape["H"], lower_bound)
        self.plan_state = shape["pool_dtype"]
        pool_dtype = torch.bfloat16 if self.plan_state == "bf16" else torch.float32
        self.state_pool = self.states(torch, 2 * N + 1, pool_dtype)
        self.state_indices = torch.arange(1, 2 * N + 1, 2, dtype=torch.int32, device="cuda")

    def calls(self, torch, flashkda, plan):
        positional = self.positional()
        pool = (self.state_pool, self.state_indices)
        op = torch.ops.flashkda.decode.default
        return {
            "module": lambda: flashkda.decode(*positional, self.lower_bound, *pool),
            "prepared": plan.prepare_decode(*positional, *pool),
            "op": lambda: op(*positional, self.lower_bound, *pool),
        }


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
    plan = flashkda.Plan(inputs.heads, backend="gpu", state_dtype=inputs.plan_state,
                         lower_bound=inputs.lower_bound)
    figures = {}
    for name, fn in inputs.calls(torch, flashkda, plan).items():
        figures[name] = {"ms": timed(fn), "host_us": host_us_per_call(torch, fn)}
    plan.close()
    return figures


CALL_NAMES = ("module", "prepared", "op")


def markdown(rows, timer_name, commit):
    lines = [
        f"Commit {commit}; {timer_name}; preallocated torch tensors; prefill with bf16 "
        "initial and final state, decode on the case's pool. module: flashkda.fwd "
        "(P*) or flashkda.decode (D*); prepared: Plan.prepare / prepare_decode; op: "
        "torch.ops.flashkda.fwd / .decode. Overhead: a call's median minus "
        f"fkda-bench's; host µs: wall time of one call in a loop of {HOST_LOOP_CALLS} "
        "without synchronisation.",
        "",
        "| case | shape | fkda-bench ms | module ms | overhead µs | prepared ms | overhead µs "
        "| op ms | overhead µs | host µs/call (module / prepared / op) | peer ms (quoted) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        cells = [row["id"], row["shape"], f"{row['kernel_ms']:.3f}"]
        for name in CALL_NAMES:
            ms = row["calls"][name]["ms"]
            cells += [f"{ms:.3f}", f"{(ms - row['kernel_ms']) * 1e3:+.1f}"]
        cells.append(" / ".join(f"{row['calls'][name]['host_us']:.1f}" for name in CALL_NAMES))
        peer, peer_ms = row["peer"]
        cells.append("—" if peer_ms is None else f"{peer_ms:.3f} ({peer})")
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
        decode = entry.get("kind") == "decode"
        if entry.get("kind") not in (None, "decode"):
            sys.exit(f"python_overhead.py: {case} is a {entry['kind']} case; "
                     "prefill (P*) and decode (D*) cases only")
        inputs = (DecodeInputs if decode else PrefillInputs)(torch, entry, arguments.lower_bound)
        peer = (("FLA", entry["peers"]["fla_ms"]) if decode
                else ("flash_kda.fwd", entry["peers"]["flashkda_ms"]))
        rows.append({
            "id": entry["id"],
            "shape": entry["shape_text"],
            "kernel_ms": entry["ms"]["median"],
            "peer": peer,
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
