"""store_kv: each new token's key and value land in its slot, padding slots write nothing."""

from __future__ import annotations

import pytest
import torch

from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import DEVICE, assert_close, generator, poisoned, requires_triton


def make_step(num_tokens: int, num_kv_heads: int, head_size: int, block_size: int, num_blocks: int,
              dtype: torch.dtype, seed: int, num_padding: int = 0):
    """Keys and values as strided views of one qkv matrix (as the model passes them), and
    distinct random slots, num_padding of them -1."""
    g = generator(seed)
    kv_size = num_kv_heads * head_size
    qkv = torch.randn(num_tokens, 3 * kv_size, generator=g).to(dtype).to(DEVICE)
    key = qkv[:, kv_size: 2 * kv_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 2 * kv_size:].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:num_padding]] = -1
    return key, value, slots.to(DEVICE)


def test_reference_writes_each_token_to_its_slot_and_skips_padding():
    key, value, slots = make_step(num_tokens=10, num_kv_heads=2, head_size=8, block_size=4, num_blocks=6,
                                  dtype=torch.float32, seed=0, num_padding=3)
    key_cache = poisoned(6, 2, 4, 8, dtype=torch.float32)
    value_cache = poisoned(6, 2, 4, 8, dtype=torch.float32)
    store_kv_ref(key, value, key_cache, value_cache, slots)
    expected_key = poisoned(6, 2, 4, 8, dtype=torch.float32)
    expected_value = poisoned(6, 2, 4, 8, dtype=torch.float32)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_key[slot // 4, :, slot % 4] = key[token]
            expected_value[slot // 4, :, slot % 4] = value[token]
    torch.testing.assert_close(key_cache, expected_key, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(value_cache, expected_value, equal_nan=True, rtol=0, atol=0)


@requires_triton
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("num_kv_heads, head_size, block_size", [(1, 16, 16), (2, 80, 32), (8, 128, 16),
                                                                 (4, 96, 32)])
def test_triton_store_kv_matches_reference(dtype, cache_dtype, num_kv_heads, head_size, block_size):
    num_blocks = 9
    key, value, slots = make_step(53, num_kv_heads, head_size, block_size, num_blocks, dtype,
                                  seed=num_kv_heads * 1000 + head_size + block_size, num_padding=5)
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    # NaN everywhere: a slot written that should not be, or not written, fails
    key_cache, value_cache = poisoned(*shape, dtype=cache_dtype), poisoned(*shape, dtype=cache_dtype)
    expected_key, expected_value = poisoned(*shape, dtype=cache_dtype), poisoned(*shape, dtype=cache_dtype)
    store_kv(key, value, key_cache, value_cache, slots)
    store_kv_ref(key, value, expected_key, expected_value, slots)
    assert_close(key_cache, expected_key, equal_nan=True)
    assert_close(value_cache, expected_value, equal_nan=True)


@requires_triton
def test_triton_store_kv_of_no_tokens_is_a_no_op():
    key_cache = poisoned(2, 1, 16, 16, dtype=torch.float32)
    empty = torch.empty(0, 1, 16, device=DEVICE)
    store_kv(empty, empty, key_cache, key_cache.clone(), torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert key_cache.isnan().all()
