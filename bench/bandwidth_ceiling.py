#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What one GPU's memory can move: the ceilings the decode figures compare to.

Decode at large batches reads every state of its pool and writes it back in
place. Its ceiling is therefore not only a device-to-device copy (read one
buffer, write another) but also an in-place update (read and rewrite the same
bytes). For each size, median over repeats of CUDA-event timings, as TB/s of
bytes read plus bytes written:

  copy            dst.copy_(src)
  inplace_torch   x.mul_(1.0000001): torch's vectorised elementwise kernel
  inplace_vec16   a kernel of 16-byte loads, four in flight per thread, each
                  rewritten where it was read (needs CuPy)

    python3 bench/bandwidth_ceiling.py [--mib 512 2048]
"""

import argparse
import statistics


INPLACE_VEC16 = r"""
extern "C" __global__ void inplace_vec16(float4* data, long long count) {
    // Each thread takes four 16-byte vectors a grid stride apart, so that
    // four loads are in flight before the first store.
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x;
         base < count; base += 4 * stride) {
        float4 v[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            long long at = base + i * stride;
            if (at < count) v[i] = data[at];
        }
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            long long at = base + i * stride;
            if (at < count) {
                v[i].x *= 1.0000001f; v[i].y *= 1.0000001f;
                v[i].z *= 1.0000001f; v[i].w *= 1.0000001f;
                data[at] = v[i];
            }
        }
    }
}
"""


def median_ms(step, repeats):
    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    vec16 = None
    try:
        import cupy

        vec16 = cupy.RawKernel(INPLACE_VEC16, "inplace_vec16")
    except ImportError:
        pass
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name(0)}")
    print("| MiB | kernel | median ms | TB/s (read + write) |")
    print("|---:|---|---:|---:|")
    for mib in args.mib:
        nbytes = mib << 20
        src = torch.rand(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        steps = {
            "copy": lambda: dst.copy_(src),
            "inplace_torch": lambda: src.mul_(1.0000001),
        }
        if vec16 is not None:
            import cupy

            data = cupy.from_dlpack(src)
            count = nbytes // 16
            blocks = multiprocessors * 8
            steps["inplace_vec16"] = lambda: vec16(
                (blocks,), (256,), (data, cupy.int64(count)))
        for name, step in steps.items():
            ms = median_ms(step, args.repeats)
            print(f"| {mib} | {name} | {ms:.4f} | {2 * nbytes / ms / 1e9:.2f} |")
        del src, dst


if __name__ == "__main__":
    main()
