"""rotary_store_kv: Qwen3's q/k norms, rotary and the KV store in one kernel, against the
unfused references and against the unfused Triton kernels it replaces."""

from __future__ import annotations

import pytest
import torch

from actors.layers.attention import CpuBackend, TorchBackend, TritonBackend
from kernels.rotary import build_cos_sin_cache
from kernels.rotary_store_kv import rotary_store_kv, rotary_store_kv_ref, rotary_store_kv_unfused
from tests.kernels.helpers import DEVICE, assert_close, caches_past_two_to_the_31, generator, requires_triton
from tests.kernels.test_rotary import LLAMA3_SCALING, make_qkv

NUM_BLOCKS, BLOCK_SIZE = 9, 16


def make_step(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, seed: int,
              num_padding: int = 3, norms: bool = True, device: torch.device = DEVICE):
    """q, k and v as views of one qkv matrix, positions, distinct slots (num_padding of
    them -1), the rope-scaled cos/sin table and, with norms, q/k norm weights."""
    g = generator(seed)
    qkv, q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, seed, device)
    positions = torch.randint(0, 1024, (num_tokens,), generator=g).to(device)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=g)[:num_padding]] = -1
    cache = build_cos_sin_cache(head_size, 1024, 500000.0, LLAMA3_SCALING).to(device)
    weights = [(1 + 0.3 * torch.randn(head_size, generator=g)).to(dtype).to(device) for _ in range(2)] \
        if norms else [None, None]
    return qkv, q, k, v, positions, slots.to(device), cache, weights


def poisoned_caches(num_kv_heads: int, head_size: int, dtype: torch.dtype,
                    device: torch.device = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, head_size)
    # NaN everywhere: a slot written that should not be, or not written, fails
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def test_reference_leaves_its_inputs_and_skips_padding_slots():
    qkv, q, k, v, positions, slots, cache, (q_norm, k_norm) = make_step(7, 4, 2, 16, torch.float32, seed=1)
    qkv_before = qkv.clone()
    key_cache, value_cache = poisoned_caches(2, 16, torch.float32)
    rotated_q, rotated_k = rotary_store_kv_ref(positions, q, k, v, cache, key_cache, value_cache, slots, q_norm,
                                               k_norm, 1e-6)
    assert torch.equal(qkv, qkv_before)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE], rotated_k[token])
            assert torch.equal(value_cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE], v[token])
    assert int(key_cache.isnan().any(-1).sum()) == (NUM_BLOCKS * BLOCK_SIZE - int((slots >= 0).sum())) * 2


@requires_triton
@pytest.mark.parametrize("norms", [True, False], ids=["qwen3-norms", "no-norms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size, heads", [(16, (4, 2)), (64, (4, 4)), (80, (8, 1)), (128, (16, 8))])
def test_triton_matches_reference_in_place_and_in_the_cache(norms, dtype, head_size, heads):
    num_heads, num_kv_heads = heads
    qkv, q, k, v, positions, slots, cache, (q_norm, k_norm) = make_step(
        13, num_heads, num_kv_heads, head_size, dtype, seed=head_size + num_heads, norms=norms)
    value_before = v.clone()
    expected_caches, caches = poisoned_caches(num_kv_heads, head_size, dtype), poisoned_caches(
        num_kv_heads, head_size, dtype)
    expected_q, expected_k = rotary_store_kv_ref(positions, q, k, v, cache, *expected_caches, slots, q_norm, k_norm,
                                                 1e-6)
    rotated_q, rotated_k = rotary_store_kv(positions, q, k, v, cache, *caches, slots, q_norm, k_norm, 1e-6)
    assert rotated_q is q and rotated_k is k
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(v, value_before)  # the rest of the qkv row is untouched
    for written, expected in zip(caches, expected_caches):
        assert_close(written, expected, equal_nan=True)  # (padding slots: still NaN)


@requires_triton
@pytest.mark.parametrize("norms", [True, False], ids=["qwen3-norms", "no-norms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_the_unfused_kernels(norms, dtype):
    """The same arithmetic as the four kernels it replaces: bit for bit (on a GPU the norm's
    sum of squares may add in another order than rms_norm's, so one rounding apart)."""
    qkv, q, k, v, positions, slots, cache, (q_norm, k_norm) = make_step(11, 8, 2, 128, dtype, seed=7, norms=norms)
    uq, uk, uv = (t.view(11, -1, 128) for t in qkv.clone().split([1024, 256, 256], dim=-1))
    unfused_caches, caches = poisoned_caches(2, 128, dtype), poisoned_caches(2, 128, dtype)
    expected_q, expected_k = rotary_store_kv_unfused(positions, uq, uk, uv, cache, *unfused_caches, slots, q_norm,
                                                     k_norm, 1e-6)
    rotary_store_kv(positions, q, k, v, cache, *caches, slots, q_norm, k_norm, 1e-6)
    exact = not (norms and DEVICE.type == "cuda")
    for actual, expected in zip((q, k, *caches), (expected_q, expected_k, *unfused_caches)):
        if exact:
            torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
        else:
            assert_close(actual, expected, equal_nan=True)


@requires_triton
def test_triton_stores_into_a_cache_of_another_dtype():
    """fp32 activations over a bf16 cache: the key rounded once more, as store_kv rounds it."""
    qkv, q, k, v, positions, slots, cache, (q_norm, k_norm) = make_step(9, 4, 2, 64, torch.float32, seed=3)
    expected_caches, caches = poisoned_caches(2, 64, torch.bfloat16), poisoned_caches(2, 64, torch.bfloat16)
    rotary_store_kv_ref(positions, q, k, v, cache, *expected_caches, slots, q_norm, k_norm, 1e-6)
    rotary_store_kv(positions, q, k, v, cache, *caches, slots, q_norm, k_norm, 1e-6)
    for written, expected in zip(caches, expected_caches):
        assert_close(written, expected, equal_nan=True)


@requires_triton
def test_triton_rotates_every_padding_row_and_stores_none():
    """All slots -1 (a CUDA graph's padding rows): q and k still rotate, the cache stays as it was."""
    qkv, q, k, v, positions, slots, cache, _ = make_step(5, 4, 2, 32, torch.float32, seed=4, num_padding=5,
                                                         norms=False)
    expected_q, expected_k = rotary_store_kv_ref(positions, q, k, v, cache, *poisoned_caches(2, 32, torch.float32),
                                                 slots)
    caches = poisoned_caches(2, 32, torch.float32)
    rotary_store_kv(positions, q, k, v, cache, *caches, slots)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert all(c.isnan().all() for c in caches)


@requires_triton
def test_triton_of_no_tokens_is_a_no_op():
    empty = torch.empty(0, 2, 16, device=DEVICE)
    caches = poisoned_caches(2, 16, torch.float32)
    rotary_store_kv(torch.empty(0, dtype=torch.int64, device=DEVICE), empty, empty, empty,
                    build_cos_sin_cache(16, 8, 10000.0).to(DEVICE), *caches,
                    torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert all(c.isnan().all() for c in caches)


@requires_triton
def test_cache_offsets_past_two_to_the_31_elements():
    """Slots in the last blocks of a cache of more than 2**31 elements (helpers.caches_past_two_to_the_31)."""
    head_size = 16
    key_cache, value_cache = caches_past_two_to_the_31(BLOCK_SIZE, head_size)
    num_blocks = key_cache.shape[0]
    _, q, k, v, positions, _, cache, (q_norm, k_norm) = make_step(3, 2, 1, head_size, torch.bfloat16, seed=5)
    slots = torch.tensor([num_blocks * BLOCK_SIZE - 1, (num_blocks - 3) * BLOCK_SIZE + 5, -1], device=DEVICE)
    expected_q, expected_k = rotary_store_kv_ref(positions, q, k, v, cache, *poisoned_caches(1, 16, torch.bfloat16),
                                                 torch.full_like(slots, -1), q_norm, k_norm, 1e-6)
    value = v.clone()
    rotary_store_kv(positions, q, k, v, cache, key_cache, value_cache, slots, q_norm, k_norm, 1e-6)
    for token in range(2):
        slot = int(slots[token])
        assert torch.equal(key_cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE], k[token])
        assert torch.equal(value_cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE], value[token])
    assert_close(q, expected_q)
    assert_close(k, expected_k)


@pytest.mark.parametrize("backend", ["cpu-c++", "cpu-torch", "triton"])
@pytest.mark.parametrize("norms", [True, False], ids=["qwen3-norms", "no-norms"])
def test_each_backend_runs_the_torch_backends_sequence(backend, norms, request):
    """The layer loop calls one rotary_store_kv on every backend: the cpu backend composes
    its own norm, rotary and store ops, the Triton backend runs the fused kernel."""
    if backend == "triton":
        pytest.importorskip("triton")
        ops, device = TritonBackend(), DEVICE
    else:
        ops = CpuBackend(request.getfixturevalue("native_kernels") if backend == "cpu-c++" else None)
        device = torch.device("cpu")
    _, q, k, v, positions, slots, cache, (q_norm, k_norm) = make_step(10, 8, 2, 64, torch.float32, seed=9,
                                                                      norms=norms, device=device)
    expected_caches = poisoned_caches(2, 64, torch.float32, device)
    caches = [c.clone() for c in expected_caches]
    expected = TorchBackend().rotary_store_kv(positions, q, k, v, cache, *expected_caches, slots, q_norm, k_norm,
                                              1e-6)
    for actual, wanted in zip(ops.rotary_store_kv(positions, q, k, v, cache, *caches, slots, q_norm, k_norm, 1e-6),
                              expected):
        assert_close(actual, wanted)
    for written, wanted in zip(caches, expected_caches):
        assert_close(written, wanted, equal_nan=True)
