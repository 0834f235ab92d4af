"""The Triton fused MoE (kernels/fused_moe_triton.py) on a GPU: one Qwen3-30B-A3B MoE layer
(the defaults: hidden 2048, 128 experts of moe_intermediate 768, top-8, bf16, random router
logits) against a per-expert loop of torch ops (Hugging Face's way: index the expert's
tokens, three matmuls, index_add) and a dense SwiGLU MLP with the same active weights
(intermediate 8 x 768, cuBLAS + torch's silu * up), eager and replayed in a CUDA graph.
Checks the kernel against the reference first. Not yet run on a GPU (written while none was
lent); on a CPU it runs under triton's interpreter with --small, to try the script itself.

    python benchmarks/moe_kernels_gpu.py
    TRITON_INTERPRET=1 python benchmarks/moe_kernels_gpu.py --small --batches 1,8 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F

from kernels.fused_moe_ref import fused_experts_ref, route
from kernels.fused_moe_triton import fused_experts


def torch_loop(x, w13, w2, weights, ids):
    """Hugging Face's MoE loop in the model's dtype: each expert's tokens gathered, its MLP,
    the weighted rows added back."""
    out = torch.zeros_like(x)
    intermediate = w2.shape[2]
    for expert in ids.unique().tolist():
        token, k = (ids == expert).nonzero(as_tuple=True)
        gate_up = x[token] @ w13[expert].T
        h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out.index_add_(0, token, (h @ w2[expert].T) * weights[token, k, None].to(x.dtype))
    return out


def dense(x, w13, w2):
    gate_up = x @ w13.T
    intermediate = w2.shape[1]
    return (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]) @ w2.T


def timed_ms(run, repeats: int, cuda: bool) -> float:
    run()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def graphed(run):
    """run captured once in a CUDA graph; the returned function replays it."""
    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,512")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--small", action="store_true", help="hidden 64, 8 experts of 32, top-2 (the interpreter)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    hidden, num_experts, inter, top_k = (64, 8, 32, 2) if args.small else (2048, 128, 768, 8)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(device)
    d13 = (torch.randn(2 * top_k * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    d2 = (torch.randn(hidden, top_k * inter, generator=g) / (top_k * inter) ** 0.5).to(dtype).to(device)
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU (interpreter)'}; hidden {hidden}, {num_experts} experts of "
          f"{inter}, top-{top_k}, bf16; ms, median of {args.repeats}")
    print(f"{'batch':>5} {'triton':>8} {'graph':>8} {'torch loop':>11} {'dense':>8} {'dense graph':>12} {'max err':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.randn(batch, hidden, generator=g).to(dtype).to(device)
        weights, ids = route(torch.randn(batch, num_experts, generator=g), top_k, renormalize=True)
        weights, ids = weights.to(device), ids.to(device)
        out = fused_experts(x, w13, w2, weights, ids)
        expected = fused_experts_ref(x, w13, w2, weights, ids)
        error = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
        triton_ms = timed_ms(lambda: fused_experts(x, w13, w2, weights, ids), args.repeats, cuda)
        loop_ms = timed_ms(lambda: torch_loop(x, w13, w2, weights, ids), max(1, args.repeats // 10), cuda)
        dense_ms = timed_ms(lambda: dense(x, d13, d2), args.repeats, cuda)
        graph_ms = dense_graph_ms = float("nan")
        if cuda:
            graph_ms = timed_ms(graphed(lambda: fused_experts(x, w13, w2, weights, ids)), args.repeats, cuda)
            dense_graph_ms = timed_ms(graphed(lambda: dense(x, d13, d2)), args.repeats, cuda)
        print(f"{batch:>5} {triton_ms:>8.3f} {graph_ms:>8.3f} {loop_ms:>11.3f} {dense_ms:>8.3f} {dense_graph_ms:>12.3f} "
              f"{error:>8.1e}")


if __name__ == "__main__":
    main()
