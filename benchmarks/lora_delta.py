"""Ways to add a batch's multi-LoRA deltas on the CPU, timed on one layer group's shapes:
the q/k/v group of SmolLM2-135M (in 576; q 576, k and v 192 out) at rank 16, N adapters,
a batch of T tokens whose requests are spread evenly over the adapters.

- segmented: tokens grouped by adapter, one x·Aᵀ GEMM and one ·Bᵀ GEMM per segment and
  module (kernels/lora_ref.py; the CPU's one-call step runs the same GEMMs through sgemm
  from C++, without Python between them);
- gathered (BGMV): each token's A and B gathered, then two batched matmuls over tokens;
- dense: x·Aᵀ against every adapter's A at once, then each token's own slice expanded.

    python benchmarks/lora_delta.py --tokens 64 --adapters 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path
                                           if os.path.abspath(path or os.curdir) != _here]

import torch

from kernels.lora_ref import lora_expand_reference, lora_shrink_reference

IN, OUTS, RANK = 576, (576, 192, 192), 16


def timed(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    slots, tokens, out = args.adapters, args.tokens, sum(OUTS)
    a = torch.randn(slots, len(OUTS) * RANK, IN) * 0.05
    b = torch.randn(slots, out, RANK) * 0.05
    x = torch.randn(tokens, IN)
    y = torch.zeros(tokens, out)
    token_slot = torch.arange(tokens) * slots // tokens  # sorted: even runs per adapter
    counts = torch.bincount(token_slot, minlength=slots)
    starts = torch.cumsum(counts, 0) - counts
    i32 = torch.int32
    seg_start, seg_len, seg_slot = starts.to(i32), counts.to(i32), torch.arange(slots, dtype=i32)
    rows = torch.full((slots,), len(OUTS) * RANK, dtype=i32)
    offsets = [0, *torch.cumsum(torch.tensor(OUTS), 0).tolist()[:-1]]
    t = torch.empty(tokens, len(OUTS) * RANK)

    def segmented():
        lora_shrink_reference(x, a, t, seg_start, seg_len, seg_slot, rows)
        for module, (offset, size) in enumerate(zip(offsets, OUTS)):
            lora_expand_reference(t, b, y, seg_start, seg_len, seg_slot,
                                  torch.full((slots,), module * RANK, dtype=i32), torch.full((slots,), RANK, dtype=i32),
                                  offset, size)

    def gathered():
        shrunk = torch.bmm(a[token_slot], x.unsqueeze(-1)).squeeze(-1)  # [T, 3R]
        for module, (offset, size) in enumerate(zip(offsets, OUTS)):
            b_tokens = b[token_slot, offset:offset + size]  # [T, size, R]
            part = shrunk[:, module * RANK:(module + 1) * RANK].unsqueeze(-1)
            y[:, offset:offset + size] += torch.bmm(b_tokens, part).squeeze(-1)

    def dense():
        shrunk = (x @ a.reshape(-1, IN).t()).view(tokens, slots, -1)[torch.arange(tokens), token_slot]
        for module, (offset, size) in enumerate(zip(offsets, OUTS)):
            b_tokens = b[token_slot, offset:offset + size]
            part = shrunk[:, module * RANK:(module + 1) * RANK].unsqueeze(-1)
            y[:, offset:offset + size] += torch.bmm(b_tokens, part).squeeze(-1)

    base_weight = torch.randn(out, IN) * 0.05
    base = timed(lambda: torch.nn.functional.linear(x, base_weight), args.repeats)
    print(f"{tokens} tokens, {slots} adapters of rank {RANK}, q/k/v group of SmolLM2; torch threads "
          f"{torch.get_num_threads()}; the base q/k/v linear: {base * 1e6:.0f} us")
    for name, function in (("segmented", segmented), ("gathered (BGMV)", gathered), ("dense", dense)):
        seconds = timed(function, args.repeats)
        print(f"{name:16s} {seconds * 1e6:8.0f} us  ({seconds / base:.2f}x the base linear)")


if __name__ == "__main__":
    main()
