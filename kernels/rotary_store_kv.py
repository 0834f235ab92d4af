"""Rotary position embedding fused with the KV store (and, for Qwen3, with the per-head
RMSNorm of q and k before it): what a layer does between its qkv projection and its
attention, in one launch instead of up to six (two norms and the copies their inputs
need, rotary, store_kv). On the GPU a launch from Python costs tens of microseconds of
host time, more than these kernels' GPU time at decode sizes.

Same results as the unfused sequence, op for op: each head is normalised (rms_norm's
arithmetic, rounded to the model's dtype), rotated (rotary's, neox style, rounded again),
written back in place and, unless its slot is negative (padding), stored with its value
into the paged cache (store_kv's layout: [num_blocks, num_kv_heads, block_size, head_size])."""

from __future__ import annotations

import torch

from kernels._triton import jit, next_power_of_2, tl
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import rotary, rotary_ref
from kernels.store_kv import store_kv, store_kv_ref


def rotary_store_kv_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: torch.Tensor,  # [max_position, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: padding, nothing stored
    q_norm: torch.Tensor | None = None,  # [head_size]: Qwen3's per-head RMSNorm weights
    k_norm: torch.Tensor | None = None,  # [head_size]
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused sequence of references: returns the normed, rotated copies of query
    and key (the Triton kernel writes them in place) and stores key and value."""
    if q_norm is not None:
        query = rms_norm_ref(query.reshape(-1, query.shape[-1]), q_norm, eps).view(query.shape)
        key = rms_norm_ref(key.reshape(-1, key.shape[-1]), k_norm, eps).view(key.shape)
    query, key = rotary_ref(positions, query, key, cos_sin_cache)
    store_kv_ref(key, value, key_cache, value_cache, slot_mapping)
    return query, key


# -- Triton ----------------------------------------------------------------------------------


@jit
def _norm_and_rotate(
    row_ptr,  # this token's first head: [num_rows_heads, head_size] with a head stride
    head_stride, num_row_heads, head_size, half_size, eps,
    norm_ptr,  # [head_size]; unused without HAS_NORM
    cos, sin,  # [1, BLOCK_HALF] fp32
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # num_row_heads rounded up to a power of two
    BLOCK_HALF: tl.constexpr,  # head_size / 2 rounded up to a power of two
    BLOCK_D: tl.constexpr,  # head_size rounded up to a power of two
):
    """Every head of one token, normed (if HAS_NORM) and rotated, written back in place:
    returns the two rotated halves in fp32 (already rounded to the row's dtype once) and
    the mask of the [BLOCK_H, BLOCK_HALF] tiles."""
    dtype = row_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    halves = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_row_heads) & (halves < half_size)
    first = row_ptr + heads * head_stride + halves
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half_size, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # rms_norm's arithmetic, a head a row: the squares summed over the whole row as that
        # kernel sums them (one [BLOCK_D] row), normed, rounded, weighted, rounded again
        dims = tl.arange(0, BLOCK_D)[None, :]
        whole = tl.load(row_ptr + heads * head_stride + dims, mask=(heads < num_row_heads) & (dims < head_size),
                        other=0.0).to(tl.float32)
        inverse_rms = tl.rsqrt(tl.sum(whole * whole, axis=1) / head_size + eps)[:, None]
        weight1 = tl.load(norm_ptr + halves, mask=halves < half_size, other=0.0).to(tl.float32)
        weight2 = tl.load(norm_ptr + half_size + halves, mask=halves < half_size, other=0.0).to(tl.float32)
        x1 = (weight1 * (x1 * inverse_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (weight2 * (x2 * inverse_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rotated1 = (x1 * cos - x2 * sin).to(dtype)
    rotated2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(first, rotated1, mask=mask)
    tl.store(first + half_size, rotated2, mask=mask)
    return rotated1, rotated2, mask


@jit
def _rotary_store_kv_kernel(
    positions_ptr,  # [num_tokens] int64
    query_ptr,  # [num_tokens, num_heads, head_size]: normed and rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_size]: normed and rotated in place
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache_ptr,  # [max_position, head_size]: cos in the first half, sin in the second
    q_norm_ptr, k_norm_ptr,  # [head_size]; unused without HAS_NORM
    key_cache_ptr, value_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    query_stride_token, query_stride_head, key_stride_token, key_stride_head,
    value_stride_token, value_stride_head, cos_sin_stride,
    cache_stride_block, cache_stride_head, cache_stride_slot,  # shared by both caches
    num_heads, num_kv_heads, head_size, eps,
    HAS_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_HQ: tl.constexpr,  # num_heads rounded up to a power of two
    BLOCK_HK: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_HALF: tl.constexpr,  # head_size / 2 rounded up to a power of two
    BLOCK_D: tl.constexpr,  # head_size rounded up to a power of two
):
    """One program per token: all its query and key heads, its keys and values stored."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    half_size = head_size // 2
    halves = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_cache_ptr + position * cos_sin_stride + halves, mask=halves < half_size, other=0.0)
    sin = tl.load(cos_sin_cache_ptr + position * cos_sin_stride + half_size + halves, mask=halves < half_size,
                  other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _norm_and_rotate(query_ptr + token * query_stride_token, query_stride_head, num_heads, head_size, half_size,
                     eps, q_norm_ptr, cos, sin, HAS_NORM, BLOCK_HQ, BLOCK_HALF, BLOCK_D)
    key1, key2, key_mask = _norm_and_rotate(key_ptr + token * key_stride_token, key_stride_head, num_kv_heads,
                                            head_size, half_size, eps, k_norm_ptr, cos, sin, HAS_NORM, BLOCK_HK,
                                            BLOCK_HALF, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:  # a negative slot is a padding row (CUDA graphs): rotated, but stored nowhere
        # slot is int64, so block_id * cache_stride_block cannot wrap around 32 bits
        heads = tl.arange(0, BLOCK_HK)[:, None]
        cache_row = (slot // BLOCK_SIZE) * cache_stride_block + heads * cache_stride_head \
            + (slot % BLOCK_SIZE) * cache_stride_slot
        cache_dtype = key_cache_ptr.dtype.element_ty
        first = key_cache_ptr + cache_row + halves[None, :]
        tl.store(first, key1.to(cache_dtype), mask=key_mask)
        tl.store(first + half_size, key2.to(cache_dtype), mask=key_mask)
        dims = tl.arange(0, BLOCK_D)[None, :]
        value_mask = (heads < num_kv_heads) & (dims < head_size)
        value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=value_mask)
        tl.store(value_cache_ptr + cache_row + dims, value.to(cache_dtype), mask=value_mask)


def rotary_store_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], normed and rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], normed and rotated in place
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: torch.Tensor,  # [max_position, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: padding, nothing stored
    q_norm: torch.Tensor | None = None,  # [head_size], in query's dtype
    k_norm: torch.Tensor | None = None,  # [head_size], in key's dtype
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_store_kv_ref's results in one launch: query and key are overwritten with
    them and returned (the same tensors). They and value may be strided views (the model's
    are slices of one qkv matrix); each head's row of head_size elements is contiguous."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_size)
    assert key.dtype == query.dtype == value.dtype
    assert query.stride(2) == key.stride(2) == value.stride(2) == 1
    assert head_size % 2 == 0
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size and cos_sin_cache.stride(1) == 1
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape and key_cache.dtype == value_cache.dtype
    assert key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_size, \
        f"cache {tuple(key_cache.shape)} does not hold [*, {num_kv_heads}, *, {head_size}]"
    assert key_cache.stride(3) == 1 and key_cache.stride() == value_cache.stride()
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    has_norm = q_norm is not None
    assert has_norm == (k_norm is not None), "q_norm and k_norm come together"
    if has_norm:  # (in another dtype, rms_norm_ref would promote q and k to it: not in place)
        assert q_norm.shape == k_norm.shape == (head_size,) and q_norm.is_contiguous() and k_norm.is_contiguous()
        assert q_norm.dtype == k_norm.dtype == query.dtype
    if num_tokens:
        block_hq, block_d = next_power_of_2(num_heads), next_power_of_2(head_size)
        _rotary_store_kv_kernel[(num_tokens,)](
            positions, query, key, value, cos_sin_cache,
            q_norm if has_norm else query, k_norm if has_norm else key,  # (any pointer where there is none)
            key_cache, value_cache, slot_mapping,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            cos_sin_cache.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            num_heads, num_kv_heads, head_size, eps,
            HAS_NORM=has_norm, BLOCK_SIZE=key_cache.shape[2], BLOCK_HQ=block_hq,
            BLOCK_HK=next_power_of_2(num_kv_heads), BLOCK_HALF=next_power_of_2(head_size // 2), BLOCK_D=block_d,
            # a token's query heads are held at once (the norm's whole rows and both halves): more
            # threads for more heads, so that 32 or 64 heads of 128 do not spill registers on sm_90
            num_warps=max(4, min(16, block_hq * block_d // 512)),
        )
    return query, key


def rotary_store_kv_unfused(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels rotary_store_kv replaces, one launch each (as the Triton backend ran
    them before it): the norms (over copies of q and k where several tokens make their heads
    strided), rotary, store_kv. The baseline of its tests and of benchmarks/kernels.py."""
    if q_norm is not None:
        query = rms_norm(query.reshape(-1, query.shape[-1]), q_norm, eps).view_as(query)
        key = rms_norm(key.reshape(-1, key.shape[-1]), k_norm, eps).view_as(key)
    query, key = rotary(positions, query, key, cos_sin_cache)
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    return query, key
