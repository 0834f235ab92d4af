"""Rotary position embedding (neox style: the two halves of each head rotate together),
with the cos/sin table built once per model, including Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from kernels._triton import jit, next_power_of_2, tl
from kernels.cpu_kernels import NativeKernels


def build_cos_sin_cache(
    head_size: int, max_position: int, base: float, rope_scaling: dict | None = None
) -> torch.Tensor:  # [max_position, head_size]: cos in the first half, sin in the second
    """The same float32 arithmetic as Hugging Face's rotary embedding, so positions
    rotate bit-for-bit alike."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (base**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type not in (None, "default"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: torch.Tensor,  # [max_position, head_size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated copies of query and key (the Triton kernel rotates in place)."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)



def rotary_cpu(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_size]
    native: NativeKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_ref's results, bit for bit, written into query and key (as the Triton kernel
    does) and returned: by the C++ kernel for fp32, else by torch's ops. Where key directly
    follows query in memory (the model's q and k are neighbouring slices of one qkv
    matrix), both rotate as one tensor."""
    if query.dtype != torch.float32:  # the reference rotates in fp32 and rounds once
        rotated_query, rotated_key = rotary_ref(positions, query, key, cos_sin_cache)
        return query.copy_(rotated_query), key.copy_(rotated_key)
    num_tokens, num_heads, head_size = query.shape
    adjacent = (key.stride() == query.stride() and query.stride(1) == head_size
                and key.data_ptr() == query.data_ptr() + num_heads * head_size * query.element_size())
    heads = [query.as_strided((num_tokens, num_heads + key.shape[1], head_size), query.stride())] if adjacent \
        else [query, key]
    if native is not None and cos_sin_cache.dtype == torch.float32:
        for x in heads:
            native.rotary(positions, x, cos_sin_cache)
        return query, key
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    for x in heads:
        _rotate_in_place(x, cos, sin)
    return query, key


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # the reference's x1 * cos - x2 * sin and x2 * cos + x1 * sin, same roundings
    x1, x2 = x.chunk(2, dim=-1)
    x2_sin = x2 * sin
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)

# -- Triton ----------------------------------------------------------------------------------


@jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    query_ptr,  # [num_tokens, num_heads, head_size], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_size], rotated in place
    cos_sin_cache_ptr,  # [max_position, head_size]
    query_stride_token, query_stride_head, key_stride_token, key_stride_head, cache_stride,
    num_heads, num_kv_heads, half_size,
    BLOCK_H: tl.constexpr,  # max(num_heads, num_kv_heads) rounded up to a power of two
    BLOCK_HALF: tl.constexpr,  # head_size / 2 rounded up to a power of two
):
    """One program per token: every query and key head of it, both halves at once."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cos = tl.load(cos_sin_cache_ptr + position * cache_stride + dims, mask=dims < half_size, other=0.0)
    sin = tl.load(cos_sin_cache_ptr + position * cache_stride + half_size + dims, mask=dims < half_size, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    dims = dims[None, :]

    first = query_ptr + token * query_stride_token + heads * query_stride_head + dims
    mask = (heads < num_heads) & (dims < half_size)
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half_size, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(query_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half_size, (x2 * cos + x1 * sin).to(query_ptr.dtype.element_ty), mask=mask)

    first = key_ptr + token * key_stride_token + heads * key_stride_head + dims
    mask = (heads < num_kv_heads) & (dims < half_size)
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half_size, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(key_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half_size, (x2 * cos + x1 * sin).to(key_ptr.dtype.element_ty), mask=mask)


def rotary(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_size]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query and key in place and returns them (the same tensors). They may be
    strided views (the model's q and k are slices of one qkv matrix); each head's row of
    head_size elements must be contiguous."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert key.shape == (num_tokens, num_kv_heads, head_size) and key.dtype == query.dtype
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size and cos_sin_cache.stride(1) == 1
    assert head_size % 2 == 0 and query.stride(2) == 1 and key.stride(2) == 1
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos_sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
            num_heads, num_kv_heads, head_size // 2,
            BLOCK_H=next_power_of_2(max(num_heads, num_kv_heads)), BLOCK_HALF=next_power_of_2(head_size // 2),
        )
    return query, key
