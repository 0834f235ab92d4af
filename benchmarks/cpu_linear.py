"""The linear layers of a decode step on the CPU: MKL's sgemm (F.linear) against troupe's
C++ linear for a few rows (kernels/cpu_kernels.cpp, linear_few_rows_f32), and against one
read of the weights at the machine's measured memory bandwidth.

Shapes (the defaults): SmolLM2-135M's 30 layers (q/k/v fused 960 x 576, o 576 x 576,
gate/up fused 3072 x 576, down 576 x 1536) and its LM head (49152 x 576), fp32, random
weights, for a batch of 1 to 64 decode rows. The CPU backend takes the C++ linear up to
16 rows (actors/layers/attention.py), where this table shows it ahead.

    python benchmarks/cpu_linear.py
    python benchmarks/cpu_linear.py --rows 1,8 --repeats 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":
    # run as a script, this folder would come first on sys.path; the checkout's root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F

from actors.config import cache_dir
from kernels.cpu_kernels import load_native_kernels

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of SmolLM2-135M's linears


def median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,64", help="comma-separated decode batch sizes")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    native = load_native_kernels(os.path.join(cache_dir(), "kernels"))
    if native is None:
        sys.exit("the C++ kernels did not build (no C++ compiler?)")
    weights = [torch.randn(out_features, in_features) for _ in range(args.layers)
               for out_features, in_features in LAYER_SHAPES] + [torch.randn(args.vocab_size, 576)]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    big = torch.ones(weight_bytes // 4)  # written: untouched pages all map one zero page
    bandwidth = big.numel() * 4 / (median_ms(lambda: big.sum(), args.repeats) / 1e3)
    floor_ms = weight_bytes / bandwidth * 1e3
    print(f"torch threads {torch.get_num_threads()}; weights {weight_bytes / 2**20:.0f} MiB; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s: one read of the weights {floor_ms:.1f} ms")
    print(f"{'rows':>5} {'F.linear ms':>12} {'C++ ms':>8} {'speed-up':>9} {'C++ / read':>11}")
    for num_rows in (int(r) for r in args.rows.split(",")):
        inputs = {n: torch.randn(num_rows, n) for n in {w.shape[1] for w in weights}}

        def step(linear):
            return lambda: [linear(inputs[w.shape[1]], w) for w in weights]

        sgemm = median_ms(step(F.linear), args.repeats)
        cpp = median_ms(step(native.linear_few_rows), args.repeats)
        print(f"{num_rows:>5} {sgemm:>12.1f} {cpp:>8.1f} {sgemm / cpp:>8.2f}x {cpp / floor_ms:>10.2f}x")


if __name__ == "__main__":
    main()
