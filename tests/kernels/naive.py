"""Obviously-correct (slow) oracles for the kernel references: loops over tokens."""

from __future__ import annotations

import torch


def naive_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                          sliding_window=None, logits_soft_cap=None, sinks=None):
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query, dtype=torch.float64)
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        # positions the window hides are never looked up (their blocks may be freed)
        lowest = max(0, seq_len - (end - start) - sliding_window + 1) if sliding_window else 0
        slots = [(int(block_tables[seq, pos // block_size]), pos % block_size) for pos in range(lowest, seq_len)]
        keys = torch.stack([key_cache[b, :, o] for b, o in slots]).double()  # [seq_len - lowest, kvh, D]
        values = torch.stack([value_cache[b, :, o] for b, o in slots]).double()
        for i, token in enumerate(range(start, end)):
            position = seq_len - (end - start) + i
            first = max(0, position - sliding_window + 1) if sliding_window else 0
            for head in range(query.shape[1]):
                kv = head // group
                seen = slice(first - lowest, position + 1 - lowest)
                scores = keys[seen, kv] @ query[token, head].double() * scale
                if logits_soft_cap is not None:
                    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[head].double().view(1)])
                probs = torch.softmax(scores, 0)[: seen.stop - seen.start]
                out[token, head] = probs @ values[seen, kv]
    return out.to(query.dtype)


def make_paged_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_size, block_size,
                     num_blocks, dtype=torch.float32, generator=None):
    """Random query, caches and shuffled block tables for sequences of the given lengths."""
    g = generator
    needed = [-(-n // block_size) for n in seq_lens]
    assert sum(needed) <= num_blocks
    ids = torch.randperm(num_blocks, generator=g)[: sum(needed)].tolist()
    max_blocks = max(needed)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for seq, n in enumerate(needed):
        block_tables[seq, :n] = torch.tensor([ids.pop() for _ in range(n)])
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=g).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=g).to(dtype)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return query, key_cache, value_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc
