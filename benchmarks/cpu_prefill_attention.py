"""Prefill attention on the CPU: the C++ kernel (paged_prefill_f32, every chunk of a step in
one call, keys and values read through the block tables) against the fallback of one
torch scaled_dot_product_attention per prompt, alternating in one process.

The step: whole prompts of uniform random length (seeded) over a cache of shuffled blocks,
SmolLM2-135M's attention shape by default (9 query heads, 3 kv heads, head size 64).
GFLOPS counts the causal work only (4 * head_size per query head and visible key).

    python benchmarks/cpu_prefill_attention.py
    python benchmarks/cpu_prefill_attention.py --min-len 1000 --max-len 2000 --num-prompts 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

import torch

from actors.config import cache_dir
from actors.worker.cpu_tuning import tune_allocator
from kernels.cpu_kernels import load_native_kernels
from kernels.paged_attention_cpu import paged_attention_cpu, plan_paged_attention_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=13, help="default: a 2048-token step's worth")
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    tune_allocator()
    native = load_native_kernels(os.path.join(cache_dir(), "kernels"))
    if native is None:
        sys.exit("the C++ kernels did not build")
    rng = random.Random(0)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_prompts)]
    heads, kv_heads, head_size, block_size = args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    blocks_of = [-(-n // block_size) for n in lens]
    ids = list(range(sum(blocks_of)))
    rng.shuffle(ids)
    block_tables = torch.zeros(len(lens), max(blocks_of), dtype=torch.int32)
    for i, num_blocks in enumerate(blocks_of):
        block_tables[i, :num_blocks] = torch.tensor(ids[sum(blocks_of[:i]): sum(blocks_of[:i + 1])])
    key_cache = torch.randn(len(ids), kv_heads, block_size, head_size)
    value_cache = torch.randn(len(ids), kv_heads, block_size, head_size)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query_start_loc = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, block_size)
    query = torch.randn(sum(lens), heads, head_size)
    slots = torch.tensor([int(block_tables[i, p // block_size]) * block_size + p % block_size
                          for i, n in enumerate(lens) for p in range(n)])
    key = key_cache.transpose(1, 2).reshape(-1, kv_heads, head_size)[slots]  # the step's own, as stored
    value = value_cache.transpose(1, 2).reshape(-1, kv_heads, head_size)[slots]
    scale = head_size**-0.5
    ways = {"C++ kernel": native, "sdpa per prompt": None}
    outputs = {name: paged_attention_cpu(query, key, value, key_cache, value_cache, plan, scale, kernels)
               for name, kernels in ways.items()}
    print(f"{len(lens)} prompts, {sum(lens)} tokens; max difference "
          f"{(outputs['C++ kernel'] - outputs['sdpa per prompt']).abs().max().item():.1e}")
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, kernels in ways.items():
            start = time.perf_counter()
            paged_attention_cpu(query, key, value, key_cache, value_cache, plan, scale, kernels)
            times[name].append(time.perf_counter() - start)
    flops = sum(n * (n + 1) / 2 for n in lens) * heads * head_size * 4
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"{name}: {seconds * 1e3:.2f} ms, {flops / seconds / 1e9:.0f} GFLOPS")
    print(f"sdpa / C++ kernel: {medians['sdpa per prompt'] / medians['C++ kernel']:.2f}x")


if __name__ == "__main__":
    main()
