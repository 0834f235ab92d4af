"""The CPU's paged attention and KV store (kernels/paged_attention_cpu.py) against the
references: the C++ decode kernel where it builds, the reference's decode where it does
not, and prefill chunks on the step's own keys and values."""

from __future__ import annotations


import pytest
import torch

from kernels.paged_attention_ref import paged_attention_ref
from kernels.paged_attention_cpu import paged_attention_cpu, plan_paged_attention_cpu, store_kv_cpu
from kernels.store_kv import store_kv_ref
from tests.kernels.naive import make_paged_batch
from tests.kernels.test_paged_attention import MIXED_BATCH

# the C++ kernel's online softmax and exp round differently from torch's: fp32 noise
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def native(native_kernels):
    return native_kernels


def make_step(batch: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
              dtype: torch.dtype = torch.float32, seed: int = 0):
    """A batch over shuffled blocks, with the step's own keys and values (those of each
    sequence's last query_len positions) read back from the cache."""
    seq_lens, query_lens = zip(*batch)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 7
    query, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc = make_paged_batch(
        list(seq_lens), list(query_lens), num_heads, num_kv_heads, head_size, block_size, num_blocks, dtype,
        torch.Generator().manual_seed(seed))
    slots = [int(block_tables[seq, pos // block_size]) * block_size + pos % block_size
             for seq, (seq_len, query_len) in enumerate(batch) for pos in range(seq_len - query_len, seq_len)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    by_slot = key_cache.transpose(1, 2).reshape(-1, num_kv_heads, head_size)
    key = by_slot[slot_mapping]
    value = value_cache.transpose(1, 2).reshape(-1, num_kv_heads, head_size)[slot_mapping]
    return query, key, value, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc, slot_mapping


def run_both_ways(step, block_size: int, scale: float, native):
    query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _ = step
    expected = paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, block_size)
    for kernels in (native, None):
        out = paged_attention_cpu(query, key, value, key_cache, value_cache, plan, scale, kernels)
        torch.testing.assert_close(out, expected, **TOLERANCE)


# head sizes the kernel has code for, GQA ratios 1, 3, 4 and 8, block sizes below, at and
# above its 16-key runs, and one (5) that divides nothing
@pytest.mark.parametrize("head_size, heads, block_size", [
    (16, (2, 2), 16), (32, (4, 1), 32), (64, (9, 3), 16), (64, (4, 4), 4), (80, (8, 2), 5),
    (96, (4, 1), 16), (128, (8, 1), 32), (256, (2, 1), 16)])
def test_mixed_batch_matches_reference(native, head_size, heads, block_size):
    step = make_step(MIXED_BATCH, *heads, head_size, block_size, seed=head_size + block_size)
    run_both_ways(step, block_size, head_size**-0.5, native)


def test_long_decodes_and_one_token_sequences_match_reference(native):
    batch = [(1, 1), (700, 1), (17, 1), (16, 1), (300, 1), (2, 2)]
    run_both_ways(make_step(batch, 8, 2, 64, 16, seed=9), 16, 0.125, native)


@pytest.mark.parametrize("heads, head_size, block_size", [((8, 1), 128, 16), ((64, 1), 16, 5), ((6, 3), 48, 32)])
def test_long_prefill_chunks_match_reference(native, heads, head_size, block_size):
    # whole prompts and chunks after cached prefixes, longer than a 64-key tile and than a
    # task's rows; groups of 8 (8 tokens a task) and 64 (one token a task)
    batch = [(300, 300), (260, 100), (129, 65), (2, 2), (70, 1)]
    step = make_step(batch, *heads, head_size, block_size, seed=head_size)
    run_both_ways(step, block_size, head_size**-0.5, native)


def test_a_batch_of_many_decodes_matches_reference(native):
    # enough decodes that each thread takes whole decodes rather than (decode, kv head) pairs
    lengths = torch.randint(1, 400, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    run_both_ways(make_step([(n, 1) for n in lengths], 9, 3, 64, 16, seed=4), 16, 0.125, native)


def test_shapes_the_kernel_has_no_code_for_take_the_reference_decode(native):
    # a head size that is no multiple of 16, and bf16
    step = make_step(MIXED_BATCH, 4, 2, 40, 16, seed=1)
    assert not native.supports_attention(step[0], step[3])
    run_both_ways(step, 16, 0.2, native)
    step = make_step(MIXED_BATCH, 4, 2, 64, 16, dtype=torch.bfloat16, seed=2)
    query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _ = step
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, 16)
    out = paged_attention_cpu(query, key, value, key_cache, value_cache, plan, 0.2, native)
    expected = paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.2)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_the_reference_writes(native, dtype):
    query, key, value, key_cache, value_cache, _, _, _, slot_mapping = make_step(MIXED_BATCH, 4, 2, 32, 16, dtype)
    slot_mapping[3] = -1  # padding: skipped
    caches = [torch.zeros_like(key_cache) for _ in range(4)]
    store_kv_ref(key, value, caches[0], caches[1], slot_mapping)
    store_kv_cpu(key, value, caches[2], caches[3], slot_mapping, native)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].count_nonzero() < key.count_nonzero()  # the padding token was not stored


def test_cache_offsets_past_two_to_the_31_elements(native):
    """A decode and a store in the last blocks of caches of more than 2**31 elements: an
    int32 offset anywhere reads or writes out of bounds. The caches are allocated but never
    filled, so only the pages of the few blocks used become memory."""
    num_kv_heads, block_size, head_size = 1, 16, 16
    num_blocks = 2**31 // (num_kv_heads * block_size * head_size) + 8
    try:
        key_cache = torch.empty(num_blocks, num_kv_heads, block_size, head_size)
        value_cache = torch.empty(num_blocks, num_kv_heads, block_size, head_size)
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve two 8 GiB caches: {error}")
    g = torch.Generator().manual_seed(31)
    block_tables = torch.tensor([[num_blocks - 1, num_blocks - 5, num_blocks - 3]], dtype=torch.int32)
    seq_lens = torch.tensor([40], dtype=torch.int32)
    slot_mapping = torch.tensor([int(block_tables[0, p // block_size]) * block_size + p % block_size
                                 for p in range(40)])
    keys = torch.randn(40, num_kv_heads, head_size, generator=g)
    values = torch.randn(40, num_kv_heads, head_size, generator=g)
    store_kv_cpu(keys, values, key_cache, value_cache, slot_mapping, native)
    assert torch.equal(key_cache.view(-1, num_kv_heads, head_size)[slot_mapping], keys)
    assert torch.equal(value_cache.view(-1, num_kv_heads, head_size)[slot_mapping], values)
    query = torch.randn(1, 4, head_size, generator=g)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
    expected = paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.25)
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, block_size)
    out = paged_attention_cpu(query, keys[-1:], values[-1:], key_cache, value_cache, plan, 0.25, native)
    torch.testing.assert_close(out, expected, **TOLERANCE)
