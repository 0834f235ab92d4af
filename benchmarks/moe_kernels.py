"""One MoE layer's experts on the CPU (kernels/moe_cpu.cpp) against a dense SwiGLU MLP with
the same active parameters, at decode batches: issue 38's target is an MoE decode step at
batch 64 costing at most 1.5x the dense model's.

Shapes (the defaults): a scaled-down Qwen3-MoE layer, hidden 1024, 32 experts of
moe_intermediate 256, top-8 (router: softmax top-8 of random logits, renormalised); the
dense MLP has intermediate 8 x 256 = 2048, so each token multiplies as many weights in both
(the MoE layer holds 4x as many, and at batch 64 reads them all). Each figure is one pass
over --layers such layers with weights of their own (4: 384 MiB of fp32 experts, past any
cache), median of --repeats, in ms per layer; MoE and dense run in turn and a ratio is the
median of the pairs' ratios.

Columns: MoE (fp32: the experts packed in moe_cpu.cpp's panels; GGUF: the file's blocks);
dense, as troupe's dense MLP runs it today (the same ops through the same call with one
expert and top-1: fp32 rows by the few-rows kernel up to 16 rows, else sgemm; GGUF by the
file's blocks for one row and gguf_gemm.cpp's int8 tiles from 2 on, where the CPU has VNNI;
int8 by int8_gemm.cpp); for fp32 also the dense MLP through the packed kernel, and the
reference's per-expert loop in torch (Hugging Face's way).

--clock thread (with --threads 1) times the CPU time of the calling thread, where the
kernels run: other processes on a shared machine then no longer count (they still share
the memory bandwidth and the L3).

    python benchmarks/moe_kernels.py --threads 1 --clock thread
    python benchmarks/moe_kernels.py --batches 1,16,64 --formats fp32,Q4_0 --experts 64
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

from kernels.fused_moe_ref import fused_experts_ref, route
from kernels.gguf_linear import Q4_0, Q8_0
from kernels.moe_cpu import FEW_ROWS, ExpertWeights, fp32_experts, gguf_experts, int8_experts, moe_cpu_kernels

FORMATS = {"fp32": None, "Q8_0": Q8_0, "Q4_0": Q4_0, "int8": "int8"}


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def paired_ms(first, second, repeats: int, clock=time.perf_counter) -> tuple[float, float, float]:
    """Medians of first's and second's times and of their ratio, the two run in turn (a
    shared machine's load drifts: pairs see the same load)."""
    first(), second()
    times: list[tuple[float, float]] = []
    for _ in range(repeats):
        pair = []
        for run in (first, second):
            start = clock()
            run()
            pair.append(clock() - start)
        times.append((pair[0], pair[1]))
    return (statistics.median(a for a, _ in times) * 1e3, statistics.median(b for _, b in times) * 1e3,
            statistics.median(a / b for a, b in times))


def median_ms(run, repeats: int, clock=time.perf_counter) -> float:
    return paired_ms(run, lambda: None, repeats, clock)[0]


def as_format(w13: torch.Tensor, w2: torch.Tensor, fmt: str, packed: bool = True,
              gguf_tiles: bool | None = None) -> ExpertWeights:
    kind = FORMATS[fmt]
    if kind is None:
        return fp32_experts(w13, w2, packed)
    if kind == "int8":
        return int8_experts(w13, w2)
    import gguf

    def blocks(weight: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType(kind)))

    return gguf_experts(torch.stack([blocks(w) for w in w13]), kind, torch.stack([blocks(w) for w in w2]), kind,
                        w13.shape[2], w2.shape[2], tiles=gguf_tiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64", help="comma-separated decode batch sizes")
    parser.add_argument("--formats", default="fp32,Q8_0,Q4_0", help=f"comma-separated, of {','.join(FORMATS)}")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=256, help="each expert's (moe_intermediate_size)")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--few-rows", type=int, default=FEW_ROWS,
                        help="float32 projections of up to this many rows take the few-rows kernel, else sgemm")
    parser.add_argument("--threads", type=int, default=None, help="torch's (and the kernels') threads")
    parser.add_argument("--clock", choices=CLOCKS, default="wall")
    parser.add_argument("--gguf-tiles", choices=["auto", "off"], default="auto",
                        help="off: GGUF weights as blocks alone (dot products, dequantized sgemm past 32 rows)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        sys.exit("--clock thread needs --threads 1: other threads' time would not count")
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = moe_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels did not build (no C++ compiler?)")
    hidden, inter, num_experts, top_k = args.hidden, args.intermediate, args.experts, args.top_k
    g = torch.Generator().manual_seed(0)
    moe = [(torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5,
            torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5) for _ in range(args.layers)]
    dense = [(torch.randn(1, 2 * top_k * inter, hidden, generator=g) / hidden ** 0.5,
              torch.randn(1, hidden, top_k * inter, generator=g) / (top_k * inter) ** 0.5) for _ in range(args.layers)]
    print(f"torch threads {torch.get_num_threads()}, {args.clock} clock; hidden {hidden}, {num_experts} experts of "
          f"intermediate {inter}, top-{top_k}; dense intermediate {top_k * inter}; {args.layers} layers; ms per layer, "
          f"median of {args.repeats}")
    print(f"{'format':>6} {'batch':>5} {'MoE ms':>8} {'dense ms':>9} {'MoE/dense':>10} {'dense packed ms':>16} "
          f"{'MoE/packed':>11} {'torch loop ms':>14}")
    for fmt in args.formats.split(","):
        tiles = None if args.gguf_tiles == "auto" else False
        moe_weights = [as_format(w13, w2, fmt, gguf_tiles=tiles) for w13, w2 in moe]
        dense_weights = [as_format(w13, w2, fmt, packed=False, gguf_tiles=tiles) for w13, w2 in dense]
        dense_packed = [as_format(w13, w2, fmt) for w13, w2 in dense] if fmt == "fp32" else []
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, hidden, generator=g)
            routes = [route(torch.randn(batch, num_experts, generator=g), top_k, renormalize=True)
                      for _ in range(args.layers)]
            ones, zeros = torch.ones(batch, 1), torch.zeros(batch, 1, dtype=torch.int32)

            def moe_pass():
                for experts, (weights, ids) in zip(moe_weights, routes):
                    kernels.fused_experts(x, experts, weights, ids, few_rows=args.few_rows)

            def dense_pass(layers=dense_weights):
                for experts in layers:
                    kernels.fused_experts(x, experts, ones, zeros, few_rows=args.few_rows)

            def torch_loop():
                for (w13, w2), (weights, ids) in zip(moe, routes):
                    fused_experts_ref(x, w13, w2, weights, ids)

            moe_ms, dense_ms, ratio = paired_ms(moe_pass, dense_pass, args.repeats, clock)
            row = f"{fmt:>6} {batch:>5} {moe_ms / args.layers:>8.2f} {dense_ms / args.layers:>9.2f} {ratio:>9.2f}x"
            if dense_packed:
                _, packed_ms, packed_ratio = paired_ms(moe_pass, lambda: dense_pass(dense_packed), args.repeats, clock)
                loop_ms = median_ms(torch_loop, 3, clock)
                row += f" {packed_ms / args.layers:>16.2f} {packed_ratio:>10.2f}x {loop_ms / args.layers:>14.2f}"
            print(row)


if __name__ == "__main__":
    main()
