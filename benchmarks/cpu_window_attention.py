"""Decode attention on the CPU with a sliding window: the C++ kernel (paged_decode_f32 through
paged_attention_cpu) at growing contexts, a windowed layer against a global one.

A scaled-down Gemma-3-like model's attention for one decode step: its sliding layers (window
512 by default) read their window's blocks only, so their cost stays flat with the context,
while a global layer's grows with it. Each layer has its own cache (of shuffled 16-token
blocks), so a layer does not find the previous one's keys in the CPU's caches. Per context,
median times of: the step's sliding layers (5 by default), its global layer(s) (1), the
whole step's attention, that step's ratio to the first context's, and the same step with
every layer full (no window), as troupe ran such a model before.

    python benchmarks/cpu_window_attention.py
    python benchmarks/cpu_window_attention.py --context-lens 1024,8192 --window 512 --batch-size 1 --threads 1

--plain-only times plain (no window) decodes only, for an A/B of the default path against
another checkout: it prints the median time of one call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

import torch

from actors.config import cache_dir
from kernels.cpu_kernels import load_native_kernels
from kernels.paged_attention_cpu import paged_attention_cpu, plan_paged_attention_cpu


def make_decodes(batch_size: int, context_len: int, num_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int, seed: int = 0):
    """A query per decode and a cache of shuffled blocks holding batch_size contexts."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch_size * blocks_per_seq
    block_tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch_size, blocks_per_seq)
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g)
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g)
    query = torch.randn(batch_size, num_heads, head_size, generator=g)
    seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32)
    query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32)
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, block_size)
    return query, key_cache, value_cache, plan


def median_seconds(call, iterations: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-lens", default="1024,2048,4096,8192", help="comma-separated")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1, help="decodes a step (1: single-stream)")
    parser.add_argument("--num-heads", type=int, default=4)  # Gemma 3 1B's attention shape
    parser.add_argument("--num-kv-heads", type=int, default=1)
    parser.add_argument("--head-size", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sliding-layers", type=int, default=5)
    parser.add_argument("--global-layers", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch's (and the kernels') threads; 0: torch's default")
    parser.add_argument("--plain-only", action="store_true", help="time plain decodes only (an A/B's workload)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native = load_native_kernels(os.path.join(cache_dir(), "kernels"))
    if native is None:
        sys.exit("the C++ kernels did not build")
    context_lens = [int(n) for n in args.context_lens.split(",")]
    print(f"{args.batch_size} decode(s), {args.num_heads} query heads over {args.num_kv_heads} kv heads of "
          f"{args.head_size}, blocks of {args.block_size}, {torch.get_num_threads()} threads")
    if not args.plain_only:
        print(f"window {args.window}; a step: {args.sliding_layers} sliding + {args.global_layers} global layers\n")
        print("| context | sliding layers | global layers | a step's attention | vs first | every layer full |")
        print("|---|---|---|---|---|---|")
    first_step = None
    num_layers = 1 if args.plain_only else args.sliding_layers + args.global_layers
    for context_len in context_lens:
        layers = [make_decodes(args.batch_size, context_len, args.num_heads, args.num_kv_heads, args.head_size,
                               args.block_size, seed=layer) for layer in range(num_layers)]

        def attend(first: int, last: int, sliding_window: int | None) -> None:
            variant = {"sliding_window": sliding_window} if sliding_window else {}  # (a checkout before them: none)
            for query, key_cache, value_cache, plan in layers[first:last]:
                paged_attention_cpu(query, None, None, key_cache, value_cache, plan, query.shape[2] ** -0.5, native,
                                    **variant)

        if args.plain_only:
            plain = median_seconds(lambda: attend(0, 1, None), args.iterations)
            print(f"context {context_len}: plain decode {plain * 1e6:.1f} us")
            continue
        sliding = median_seconds(lambda: attend(0, args.sliding_layers, args.window), args.iterations)
        full = median_seconds(lambda: attend(args.sliding_layers, num_layers, None), args.iterations)

        def step() -> None:
            attend(0, args.sliding_layers, args.window)
            attend(args.sliding_layers, num_layers, None)

        whole = median_seconds(step, args.iterations)
        no_window = median_seconds(lambda: attend(0, num_layers, None), args.iterations)
        first_step = first_step or whole
        print(f"| {context_len} | {sliding * 1e6:.1f} us | {full * 1e6:.1f} us | {whole * 1e6:.1f} us | "
              f"{whole / first_step:.2f}x | {no_window * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
