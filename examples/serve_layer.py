#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""One KDA layer served the way an inference runtime drives it.

Three requests share a state pool [slots, H, 128, 128] (f32, slot 0 reserved
as the null slot). A packed prefill starts them from zeros, writes their final
states into their slots and prefix-cache checkpoints into spare slots; then
decode steps advance every request by one token, in a batch padded to a fixed
size with null slots, as for a captured CUDA graph. At the end every output,
state and checkpoint is compared with plain prefills over each request's whole
history with contiguous states.

Runs on the GPU with torch CUDA tensors when torch and a usable GPU are there
(on torch's current stream), else on the CPU backend with numpy arrays;
--cpu forces the latter. Exit status 0 when everything matches.

    FLASHKDA_LIBRARY=build/libflashkda.so.0 PYTHONPATH=bindings/python \\
        python3 examples/serve_layer.py [--cpu]
"""

import argparse
import sys

import numpy as np

import flashkda

HEADS = 4
DIM = 128
SLOTS = 9
DECODE_STEPS = 4
DECODE_BATCH = 4  # the padded batch size a graph would be captured for
LOWER_BOUND = -5.0
SCALE = DIM ** -0.5
TOLERANCE = 2e-2  # relative L2: chunked prefill against token-by-token decode, bf16 outputs


class Arrays:
    """Where the layer's tensors live: numpy on the host, or torch on the GPU."""

    def __init__(self, on_gpu):
        self.on_gpu = on_gpu
        if on_gpu:
            import torch

            self.torch = torch

    def put(self, array):
        """A host array in the layer's memory; uint16 arrays hold bf16 bits."""
        if not self.on_gpu:
            return np.ascontiguousarray(array)
        torch = self.torch
        if array.dtype == np.uint16:
            return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).cuda().view(
                torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(array)).cuda()

    def get(self, array):
        """A host copy, bf16 as uint16 bits."""
        if not self.on_gpu:
            return np.array(array)
        torch = self.torch
        if array.dtype == torch.bfloat16:
            return array.view(torch.int16).cpu().numpy().view(np.uint16)
        return array.cpu().numpy()

    def bf16_empty(self, shape):
        return self.put(np.full(shape, 0x7FC0, dtype=np.uint16))  # NaN: unwritten rows show


def rel_l2(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


class Request:
    def __init__(self, name, prompt_len, slot, rng):
        self.name, self.prompt_len, self.slot = name, prompt_len, slot
        total = prompt_len + DECODE_STEPS
        # The whole token stream: the prompt, then one token per decode step.
        self.q, self.k, self.v, self.g = (
            flashkda.to_bf16(rng.standard_normal((total, HEADS, DIM))) for _ in range(4))
        self.beta = flashkda.to_bf16(rng.standard_normal((total, HEADS)))
        self.out = np.zeros((total, HEADS, DIM), dtype=np.uint16)


def prefill(plan, arrays, requests, params, pool, checkpoint_offsets, checkpoint_slots):
    """Packs the prompts into one row and runs them, states in the pool."""
    lengths = [r.prompt_len for r in requests]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

    def packed(name):
        return arrays.put(np.concatenate([getattr(r, name)[:r.prompt_len] for r in requests])[None])

    out = arrays.bf16_empty((1, int(cu_seqlens[-1]), HEADS, DIM))
    plan.fwd(packed("q"), packed("k"), packed("v"), packed("g"), packed("beta"), SCALE, out,
             *params, cu_seqlens=arrays.put(cu_seqlens),
             state_pool=pool,
             state_indices=arrays.put(np.array([r.slot for r in requests], dtype=np.int32)),
             has_initial_state=arrays.put(np.zeros(len(requests), dtype=bool)),  # new requests
             checkpoint_offsets=arrays.put(checkpoint_offsets),
             checkpoint_slots=arrays.put(checkpoint_slots))
    out = arrays.get(out)[0]
    for r, begin in zip(requests, cu_seqlens[:-1]):
        r.out[:r.prompt_len] = out[begin:begin + r.prompt_len]


def decode_step(plan, arrays, requests, params, pool, step):
    """One token for every request, the batch padded with the null slot 0."""
    position = [r.prompt_len + step for r in requests]
    padding = DECODE_BATCH - len(requests)

    def batched(name):
        rows = [getattr(r, name)[p][None] for r, p in zip(requests, position)]
        rows += [np.zeros_like(rows[0])] * padding
        return arrays.put(np.stack(rows))  # [N, 1, H, ...]

    indices = np.array([r.slot for r in requests] + [0] * padding, dtype=np.int32)
    out = arrays.bf16_empty((DECODE_BATCH, 1, HEADS, DIM))
    plan.decode(batched("q"), batched("k"), batched("v"), batched("g"), batched("beta"), SCALE,
                out, *params, pool, arrays.put(indices))
    out = arrays.get(out)
    if out[len(requests):].any():
        raise SystemExit("serve_layer: the padded rows' output is not zero")
    for r, p, row in zip(requests, position, out):
        r.out[p] = row[0]


def whole_history(request, params, length):
    """Plain prefill over the first `length` tokens, contiguous zero initial
    state, on the CPU backend: (out, final state)."""
    out = np.zeros((1, length, HEADS, DIM), dtype=np.uint16)
    state = np.zeros((1, HEADS, DIM, DIM), dtype=np.float32)
    q, k, v, g, beta = (getattr(request, name)[:length][None]
                        for name in ("q", "k", "v", "g", "beta"))
    flashkda.fwd(q, k, v, g, beta, SCALE, out, *params, LOWER_BOUND, final_state=state)
    return out[0], state[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="numpy on the CPU backend")
    on_gpu = not parser.parse_args().cpu
    if on_gpu:
        try:
            import torch

            on_gpu = torch.cuda.is_available() and flashkda.query_device().has_kernels
        except ImportError:
            on_gpu = False
    arrays = Arrays(on_gpu)
    rng = np.random.default_rng(0)

    plan = flashkda.Plan(HEADS, backend="gpu" if on_gpu else "cpu", lower_bound=LOWER_BOUND,
                         null_slot_rule="nonpositive")
    A_log = rng.uniform(0, 1, HEADS).astype(np.float32)
    dt_bias = rng.uniform(0, 1, (HEADS, DIM)).astype(np.float32)
    params = (arrays.put(A_log), arrays.put(dt_bias))
    # Stale contents everywhere: new requests must not read them, slot 0 must
    # never be written.
    pool_host = rng.standard_normal((SLOTS, HEADS, DIM, DIM)).astype(np.float32)
    pool = arrays.put(pool_host)

    requests = [Request("a", 37, 5, rng), Request("b", 16, 2, rng), Request("c", 70, 7, rng)]
    # Prefix-cache checkpoints after 32 tokens of a, 16 of b, 32 and 64 of c,
    # into spare slots; -1 offsets and slot 0 mean none.
    checkpoint_offsets = np.array([[32, -1], [16, -1], [32, 64]], dtype=np.int32)
    checkpoint_slots = np.array([[1, 0], [4, 0], [3, 8]], dtype=np.int32)

    prefill(plan, arrays, requests, params, pool, checkpoint_offsets, checkpoint_slots)
    for step in range(DECODE_STEPS):
        decode_step(plan, arrays, requests, params, pool, step)
    final_pool = arrays.get(pool)

    host_params = (A_log, dt_bias)
    failures = []

    def check(what, actual, expected):
        error = rel_l2(actual, expected)
        print(f"  {what:<42} relative L2 {error:.2e}")
        if not error <= TOLERANCE:
            failures.append(what)

    print(f"serve_layer: {'GPU (torch)' if on_gpu else 'CPU backend (numpy)'}, {HEADS} heads, "
          f"pool of {SLOTS} f32 slots, {DECODE_STEPS} decode steps")
    for r in requests:
        total = r.prompt_len + DECODE_STEPS
        expected_out, expected_state = whole_history(r, host_params, total)
        check(f"{r.name}: prefill out ({r.prompt_len} tokens)",
              flashkda.from_bf16(r.out[:r.prompt_len]), flashkda.from_bf16(expected_out[:r.prompt_len]))
        check(f"{r.name}: decode out ({DECODE_STEPS} tokens)",
              flashkda.from_bf16(r.out[r.prompt_len:]), flashkda.from_bf16(expected_out[r.prompt_len:]))
        check(f"{r.name}: state in slot {r.slot}", final_pool[r.slot], expected_state)
    for n, r in enumerate(requests):
        for offset, slot in zip(checkpoint_offsets[n], checkpoint_slots[n]):
            if offset > 0 and slot > 0:
                _, expected_state = whole_history(r, host_params, int(offset))
                check(f"{r.name}: checkpoint after {offset} tokens in slot {slot}",
                      final_pool[slot], expected_state)
    if not np.array_equal(final_pool[0], pool_host[0]):
        failures.append("the null slot 0 was written")
    if failures:
        print(f"serve_layer: FAILED: {', '.join(failures)}")
        return 1
    print("serve_layer: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
