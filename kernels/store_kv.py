"""Write a step's new keys and values into their slots of the paged KV cache.

Cache layout: [num_blocks, num_kv_heads, block_size, head_size], so one block of one
head is a contiguous [block_size, head_size] matrix (what attention reads). A slot is
block_id * block_size + offset; a negative slot (padding) is skipped."""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    block_size = key_cache.shape[2]
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # advanced indices on dims 0 and 2 put the token dim first: [num_tokens, num_kv_heads, head_size]
    key_cache[block_ids, :, offsets] = key.to(key_cache.dtype)
    value_cache[block_ids, :, offsets] = value.to(value_cache.dtype)
