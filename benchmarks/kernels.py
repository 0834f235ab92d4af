"""The Triton kernels on CUDA, in four parts (--parts, all by default):

- attention: paged decode attention against torch's scaled_dot_product_attention on
  contiguous K/V, and against the memory roofline. Decode attention reads every cached key
  and value once and does little arithmetic on them, so its floor is bytes(K) + bytes(V) /
  memory bandwidth, measured here with a large device-to-device copy. For each batch size
  and context length: triton (paged_attention over a cache of shuffled 16-token blocks, as a
  server's cache is after a while, launch sizes computed once outside the timing, as a model
  step does), sdpa (the same K/V laid out contiguously, [batch, kv_heads, context, head],
  enable_gqa: what a non-paged engine would run), roofline (the K/V bytes over the measured
  bandwidth, and how close triton comes to it). Every configuration also checks the
  kernel's output against SDPA's. With --sliding-window, triton's decodes attend their
  window only (a sliding layer's), SDPA the window's keys, and the roofline counts those:
  the time should stay flat as the context grows.
- fused: rotary_store_kv (q/k norms, rotary and the KV store in one kernel) against the
  kernels it replaced (rotary_store_kv_unfused), at Qwen3-0.6B's shapes (with the norms) and
  Llama-3.1-8B's (without): kernels launched (counted by torch.profiler), GPU time
  (do_bench), host time a call (launches only, no sync), and a CUDA graph's replay.
- splits: decode attention launched as an eager step launches it (splits for the longest
  decode) and as a CUDA graph of max_model_len does (its splits, mostly past the sequences'
  ends): what the empty splits and the reduction launch cost short sequences.
- layer: the CUDA kernels of one decoder layer in an eager decode step (a two-layer minus a
  one-layer forward, counted by torch.profiler), Qwen3 and Llama, one and eight decodes,
  contexts of one split and of two.

    python benchmarks/kernels.py                              # every part
    python benchmarks/kernels.py --parts attention --batch-sizes 64 --context-lens 1024,4096 --head-size 64
    python benchmarks/kernels.py --parts fused,splits,layer
    python benchmarks/kernels.py --parts attention --batch-sizes 1,64 --context-lens 1024,8192 --sliding-window 512

Without a CUDA device it says so and exits 0 (tests/kernels checks the kernels on the
CPU, under triton's interpreter).
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder comes first on sys.path, where "kernels" would
    # name this file rather than the kernels package: the checkout takes its place.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path if os.path.abspath(path or os.curdir) != _here]

import torch
import torch.nn.functional as F

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PARTS = ("attention", "fused", "splits", "layer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def int_list(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=lambda text: [part for part in text.split(",") if part],
                        default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--batch-sizes", type=int_list, default=[64, 256], help="comma-separated")
    parser.add_argument("--context-lens", type=int_list, default=[512, 1024, 2048, 4096, 8192],
                        help="comma-separated; every sequence of a batch has this many cached tokens")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--sliding-window", type=int, default=None, help="attention part: a sliding layer's window")
    parser.add_argument("--warmup-ms", type=int, default=25, help="triton.testing.do_bench warm-up")
    parser.add_argument("--rep-ms", type=int, default=100, help="triton.testing.do_bench measuring time")
    parser.add_argument("--fused-tokens", type=int_list, default=[1, 64, 256],
                        help="comma-separated: tokens of a step in the fused part")
    args = parser.parse_args(argv)
    if args.num_heads % args.num_kv_heads:
        parser.error("--num-heads must be a multiple of --num-kv-heads")
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    return args


def measure_bandwidth(device: torch.device, num_bytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (it reads and writes num_bytes each)."""
    from triton.testing import do_bench

    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    milliseconds = do_bench(lambda: target.copy_(source), warmup=25, rep=200)
    return 2 * num_bytes / (milliseconds / 1e3)


def make_decode_batch(args: argparse.Namespace, batch_size: int, context_len: int, device: torch.device):
    """A paged cache holding batch_size sequences of context_len tokens in shuffled blocks,
    one query token each, and the same K/V laid out contiguously for SDPA."""
    dtype, block_size = _DTYPES[args.dtype], args.block_size
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch_size * blocks_per_seq
    shape = (num_blocks, args.num_kv_heads, block_size, args.head_size)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).view(batch_size, blocks_per_seq).int()
    seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch_size, args.num_heads, args.head_size, dtype=dtype, device=device)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, context, head]
        blocks = cache[block_tables.long()]  # [batch, blocks_per_seq, kv_heads, block_size, head]
        blocks = blocks.transpose(1, 2).reshape(batch_size, args.num_kv_heads, -1, args.head_size)
        return blocks[:, :, :context_len].contiguous()

    return (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            contiguous(key_cache), contiguous(value_cache))


def bench_one(args: argparse.Namespace, batch_size: int, context_len: int, bandwidth: float,
              device: torch.device) -> dict:
    from triton.testing import do_bench

    from kernels.paged_attention import paged_attention, paged_attention_launch

    (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
     keys, values) = make_decode_batch(args, batch_size, context_len, device)
    scale = args.head_size**-0.5
    launch = paged_attention_launch(seq_lens, query_start_loc)
    out = torch.empty_like(query)
    window = args.sliding_window
    if window:  # a decode's window is its last `window` keys
        keys, values = keys[:, :, -window:].contiguous(), values[:, :, -window:].contiguous()
    variant = {"sliding_window": window} if window else {}

    def triton_decode() -> torch.Tensor:
        return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                               out=out, launch=launch, **variant)

    sdpa_query = query.unsqueeze(2)  # [batch, heads, 1, head]

    def sdpa_decode() -> torch.Tensor:
        return F.scaled_dot_product_attention(sdpa_query, keys, values, scale=scale, enable_gqa=True)

    torch.testing.assert_close(triton_decode(), sdpa_decode().squeeze(2), rtol=2e-2, atol=2e-2)
    triton_ms = do_bench(triton_decode, warmup=args.warmup_ms, rep=args.rep_ms)
    sdpa_ms = do_bench(sdpa_decode, warmup=args.warmup_ms, rep=args.rep_ms)
    kv_bytes = 2 * keys.numel() * keys.element_size()
    roofline_ms = kv_bytes / bandwidth * 1e3
    return {"batch": batch_size, "context": context_len, "triton_us": triton_ms * 1e3, "sdpa_us": sdpa_ms * 1e3,
            "roofline_us": roofline_ms * 1e3, "triton_gbps": kv_bytes / triton_ms / 1e6,
            "of_roofline": roofline_ms / triton_ms}


def attention_table(args: argparse.Namespace, device: torch.device) -> None:
    bandwidth = measure_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"decode, {args.dtype}, {args.num_heads} q heads / {args.num_kv_heads} kv heads, "
          f"head {args.head_size}, block {args.block_size}"
          + (f", sliding window {args.sliding_window}" if args.sliding_window else ""))
    header = f"{'batch':>6} {'context':>8} {'triton us':>10} {'sdpa us':>10} {'roofline us':>12} " \
             f"{'triton GB/s':>12} {'% roofline':>11} {'vs sdpa':>8}"
    print(header)
    for batch_size in args.batch_sizes:
        for context_len in args.context_lens:
            row = bench_one(args, batch_size, context_len, bandwidth, device)
            torch.cuda.empty_cache()  # this configuration's caches, before the next one's
            print(f"{row['batch']:>6} {row['context']:>8} {row['triton_us']:>10.1f} {row['sdpa_us']:>10.1f} "
                  f"{row['roofline_us']:>12.1f} {row['triton_gbps']:>12.0f} {100 * row['of_roofline']:>10.0f}% "
                  f"{row['sdpa_us'] / row['triton_us']:>7.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device, and this machine has none: nothing to time. "
              "(tests/kernels checks the kernels on the CPU under triton's interpreter.)")
        return 0
    from benchmarks.kernels_fused import fused_table, layer_table, splits_table

    device = torch.device("cuda")
    parts = {"attention": attention_table, "fused": fused_table, "splits": splits_table, "layer": layer_table}
    for part in args.parts:
        print(f"\n== {part}")
        parts[part](args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
