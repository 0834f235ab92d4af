"""Write a step's new keys and values into their slots of the paged KV cache.

Cache layout: [num_blocks, num_kv_heads, block_size, head_size], so one block of one
head is a contiguous [block_size, head_size] matrix (what attention reads). A slot is
block_id * block_size + offset; a negative slot (padding) is skipped."""

from __future__ import annotations

import torch

from kernels._triton import jit, next_power_of_2, tl


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


# -- Triton ----------------------------------------------------------------------------------


@jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot,  # shared by both caches
    num_kv_heads, head_size,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,  # head_size rounded up to a power of two
):
    """One program per token: copies all its heads' key and value rows into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding
        return
    # slot is int64, so block_id * cache_stride_block cannot wrap around 32 bits
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)
    cache_offsets = block_id * cache_stride_block + heads * cache_stride_head + offset * cache_stride_slot + dims
    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
    # converted to the cache's dtype (as the reference's key.to(key_cache.dtype))
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = key_cache.shape[2]
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_size, \
        f"cache {tuple(key_cache.shape)} does not hold [*, {num_kv_heads}, *, {head_size}]"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    # rows of head_size elements must be contiguous; everything above may be strided
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert key_cache.stride(3) == 1 and key_cache.stride() == value_cache.stride()
    assert key_cache.dtype == value_cache.dtype
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_size,
        BLOCK_SIZE=block_size, BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_size),
    )
