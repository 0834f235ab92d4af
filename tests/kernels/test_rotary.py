"""rotary: neox-style rotation of each head's two halves by position * frequency."""

from __future__ import annotations

import pytest
import torch

from kernels.rotary import build_cos_sin_cache, rotary, rotary_cpu, rotary_ref
from tests.kernels.helpers import DEVICE, assert_close, generator, requires_triton

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}


def make_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, seed: int,
             device: torch.device = DEVICE):
    """q, k and v as views of one qkv matrix, as the model makes them."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=generator(seed))
    qkv = qkv.to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return (qkv, q.view(num_tokens, num_heads, head_size), k.view(num_tokens, num_kv_heads, head_size),
            v.view(num_tokens, num_kv_heads, head_size))


def test_reference_rotates_each_pair_by_position_times_frequency():
    head_size, base = 8, 10000.0
    _, q, k, _ = make_qkv(5, 2, 1, head_size, torch.float64, seed=0)
    positions = torch.tensor([0, 1, 7, 100, 511])
    cache = build_cos_sin_cache(head_size, 512, base).to(DEVICE)
    rotated_q, rotated_k = rotary_ref(positions.to(DEVICE), q, k, cache)
    # neox pairs element i with element i + head_size / 2: a complex number rotated by e^(i*angle)
    # (the table is fp32: its angles at position 511 are off by ~1e-5 radians)
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angle = positions[:, None, None].double() * inv_freq
    for x, rotated in ((q, rotated_q), (k, rotated_k)):
        half = head_size // 2
        expected = torch.complex(x[..., :half], x[..., half:]).cpu() * torch.exp(1j * angle)
        torch.testing.assert_close(rotated.cpu(), torch.cat([expected.real, expected.imag], -1),
                                   rtol=1e-5, atol=2e-5)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size, heads", [(16, (4, 2)), (64, (4, 4)), (80, (8, 1)), (128, (8, 2))])
def test_triton_rotates_q_and_k_in_place_like_the_reference(dtype, head_size, heads):
    num_heads, num_kv_heads = heads
    qkv, q, k, v = make_qkv(13, num_heads, num_kv_heads, head_size, dtype, seed=head_size + num_heads)
    value_before = v.clone()
    positions = torch.randint(0, 1024, (13,), generator=generator(head_size)).to(DEVICE)
    cache = build_cos_sin_cache(head_size, 1024, 500000.0, LLAMA3_SCALING).to(DEVICE)
    expected_q, expected_k = rotary_ref(positions, q, k, cache)
    rotated_q, rotated_k = rotary(positions, q, k, cache)
    assert rotated_q is q and rotated_k is k
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(v, value_before)  # the rest of the qkv row is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neighbours", [True, False], ids=["q-k-of-one-qkv", "separate-q-k"])
@pytest.mark.parametrize("path", ["torch", "native"])
def test_cpu_path_rotates_in_place_bit_for_bit(dtype, neighbours, path, request):
    native = request.getfixturevalue("native_kernels") if path == "native" else None
    qkv, q, k, v = make_qkv(11, 8, 2, 64, dtype, seed=3, device=torch.device("cpu"))  # (the CPU's path, on a GPU too)
    if not neighbours:  # as after Qwen3's q and k norms: two tensors of their own
        q, k = q.clone(), k.clone()
    value_before = v.clone()
    positions = torch.randint(0, 1024, (11,), generator=generator(4))
    cache = build_cos_sin_cache(64, 1024, 500000.0, LLAMA3_SCALING)
    expected_q, expected_k = rotary_ref(positions, q, k, cache)
    rotated_q, rotated_k = rotary_cpu(positions, q, k, cache, native)
    assert rotated_q is q and rotated_k is k
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, value_before)
