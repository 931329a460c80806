#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The layer step (W1 to W4 of docs/BENCHMARKS.md) on one GPU.

For each case, in one process and one run, median ms of CUDA-graph replays
(so that Python's launch cost is out of every figure) of:

  plain    our kernel alone (flashkda.fwd / flashkda.decode), the inputs
           already convolved;
  fused    the same call doing the whole step: the convolution of the raw
           projections (with its conv states) and the output gate;
  unfused  the sequence a runtime runs without it: FLA's ShortConvolution
           for q, k and v (Triton), our plain kernel, FLA's FusedRMSNormGated.

The fused output is compared with the unfused one (relative L2) as a check
that both compute the same step. Writes layer_step.json and layer_step.md to
--out.

    PYTHONPATH=<fla-core>:bindings/python FLASHKDA_LIBRARY=build/libflashkda.so.0 \\
        python3 bench/layer_step.py --out $OUT
"""

import argparse
import json
import os
import sys

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPOSITORY, "bindings", "python"))

HEAD_DIM = 128
WIDTH = 4
SCALE = HEAD_DIM ** -0.5
LOWER_BOUND = -5.0

# id -> (kind, sequences, tokens per sequence, heads, target)
CASES = {
    "W1": ("decode", 256, 1, 32, "<= 1.05 x plain and <= 0.285 ms"),
    "W2": ("decode", 1, 1, 32, "<= 0.008 ms"),
    "W3": ("prefill", 1, 8192, 96, "<= 1.10 x plain"),
    "W4-H12": ("prefill", 1, 8192, 12, "unfused / fused >= 2"),
}


def graph_ms(step, replays=20, repeats=15):
    """Median ms of one step, from replays of a graph of `replays` steps."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    times.sort()
    return times[len(times) // 2]


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def run_case(case_id, kind, N, T, H):
    import torch
    from fla.modules import FusedRMSNormGated, ShortConvolution

    import flashkda

    torch.manual_seed(0)
    dev = "cuda"
    channels = H * HEAD_DIM
    tokens = N * T
    bf16 = torch.bfloat16

    # The layer's modules with random weights; ours read the same ones.
    convs = [ShortConvolution(channels, WIDTH, bias=False, activation="silu").to(dev, bf16) for _ in range(3)]
    for conv in convs:
        torch.nn.init.normal_(conv.weight, std=0.5)
    norm = FusedRMSNormGated(HEAD_DIM, eps=1e-5, activation="sigmoid").to(dev, bf16)
    torch.nn.init.normal_(norm.weight, std=1.0)
    conv_weight = tuple(conv.weight.detach().view(channels, WIDTH) for conv in convs)

    # Raw projections packed as a runtime's fused input projection makes them.
    projections = torch.randn(1 if kind == "prefill" else N, T if kind == "prefill" else 1,
                              3 * channels, device=dev, dtype=bf16)
    if kind == "prefill":
        projections = projections.view(1, tokens, 3 * channels)
    raw = [projections[..., i * channels:(i + 1) * channels] for i in range(3)]
    shape = (1, tokens, H, HEAD_DIM) if kind == "prefill" else (N, 1, H, HEAD_DIM)
    g = torch.randn(shape, device=dev, dtype=bf16)
    beta = torch.randn(shape[:-1], device=dev, dtype=bf16)
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.rand(H, HEAD_DIM, device=dev)
    g_out = torch.randn(shape, device=dev, dtype=bf16)
    out_plain = torch.empty(shape, device=dev, dtype=bf16)
    out_fused = torch.empty(shape, device=dev, dtype=bf16)
    # Convolved inputs for the plain kernel (what the unfused sequence hands it).
    convolved = [torch.empty(shape, device=dev, dtype=bf16) for _ in range(3)]

    result = dict(id=case_id, kind=kind, N=N, T=T, H=H)
    if kind == "decode":
        slots = N + 1
        pool = torch.randn(slots, H, HEAD_DIM, HEAD_DIM, device=dev) * 0.1
        indices = torch.arange(1, N + 1, device=dev, dtype=torch.int32)
        # Conv states: ours [slots, C, W - 1]; FLA's caches [N, C, W].
        conv_state = torch.randn(slots, 3 * channels, WIDTH - 1, device=dev, dtype=bf16)
        fla_cache = [torch.zeros(N, channels, WIDTH, device=dev, dtype=bf16) for _ in range(3)]
        for i in range(3):
            fla_cache[i][:, :, 1:] = conv_state[1:, i * channels:(i + 1) * channels]

        def plain():
            flashkda.decode(convolved[0], convolved[1], convolved[2], g, beta, SCALE, out_plain, A_log,
                            dt_bias, LOWER_BOUND, pool, indices)

        def fused():
            flashkda.decode(raw[0].view(shape), raw[1].view(shape), raw[2].view(shape), g, beta, SCALE,
                            out_fused, A_log, dt_bias, LOWER_BOUND, pool, indices, conv_weight=conv_weight,
                            conv_state=conv_state, out_gate=g_out, out_norm_weight=norm.weight)

        def unfused():
            for i in range(3):
                y, _ = convs[i](raw[i], cache=fla_cache[i], output_final_state=True)
                convolved[i].copy_(y.view(shape))
            flashkda.decode(convolved[0], convolved[1], convolved[2], g, beta, SCALE, out_plain, A_log,
                            dt_bias, LOWER_BOUND, pool, indices)
            out_plain.copy_(norm(out_plain, g_out))

        # One step each from the same pool and conv states, for the check.
        saved_pool = pool.clone()
        fused()
        pool.copy_(saved_pool)
        unfused()
        result["fused_vs_unfused_out"] = rel_l2(out_fused, out_plain)
    else:
        conv_state = None

        def plain():
            flashkda.fwd(convolved[0], convolved[1], convolved[2], g, beta, SCALE, out_plain, A_log, dt_bias,
                         LOWER_BOUND)

        def fused():
            flashkda.fwd(raw[0].view(shape), raw[1].view(shape), raw[2].view(shape), g, beta, SCALE, out_fused,
                         A_log, dt_bias, LOWER_BOUND, conv_weight=conv_weight, out_gate=g_out,
                         out_norm_weight=norm.weight)

        def unfused():
            for i in range(3):
                y, _ = convs[i](raw[i])
                convolved[i].copy_(y.view(shape))
            flashkda.fwd(convolved[0], convolved[1], convolved[2], g, beta, SCALE, out_plain, A_log, dt_bias,
                         LOWER_BOUND)
            out_plain.copy_(norm(out_plain, g_out))

        fused()
        unfused()
        result["fused_vs_unfused_out"] = rel_l2(out_fused, out_plain)

    result["plain_ms"] = graph_ms(plain)
    result["fused_ms"] = graph_ms(fused)
    result["unfused_ms"] = graph_ms(unfused)
    result["fused_over_plain"] = result["fused_ms"] / result["plain_ms"]
    result["unfused_over_fused"] = result["unfused_ms"] / result["fused_ms"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for case_id in args.cases:
        kind, N, T, H, target = CASES[case_id]
        r = run_case(case_id, kind, N, T, H)
        r["target"] = target
        results.append(r)
        print(json.dumps(r), flush=True)
    with open(os.path.join(args.out, "layer_step.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["| case | shape | plain ms | fused ms | unfused ms | fused / plain | unfused / fused | "
             "fused vs unfused out | target |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['id']} | {r['kind']} N={r['N']} T={r['T']} H={r['H']} | {r['plain_ms']:.4f} | "
                     f"{r['fused_ms']:.4f} | {r['unfused_ms']:.4f} | {r['fused_over_plain']:.3f} | "
                     f"{r['unfused_over_fused']:.2f} | {r['fused_vs_unfused_out']:.2e} | {r['target']} |")
    with open(os.path.join(args.out, "layer_step.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
