"""paged_attention: a flat batch of decodes and prefill chunks over the paged KV cache.

The reference is checked against the naive per-token oracle; the Triton kernels against
the reference, on ragged batches that mix every kind of sequence a step can hold."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.paged_attention import PagedAttentionLaunch, paged_attention, paged_attention_launch
from kernels.paged_attention_ref import paged_attention_ref
from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import (DEVICE, assert_close, caches_past_two_to_the_31, generator, poisoned, requires_cuda,
                                   requires_triton)
from tests.kernels.naive import make_paged_batch, naive_paged_attention

# outputs the launchers allocate start as NaN (see conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_allocations")

# (seq_len, query_len) of each sequence, interleaved as no scheduler orders them:
MIXED_BATCH = [
    (37, 1),  # a decode whose last block is partly full
    (45, 45),  # a whole prompt, prefilled at once
    (1, 1),  # a one-token prompt: a decode of its own first token
    (100, 70),  # a chunk after a prefix-cache hit of 30 tokens (not a block multiple), > one query tile
    (130, 1),  # a decode long enough for several splits of 64 keys
    (83, 19),  # a later chunk of a prompt, starting mid-block
]


def make_batch(batch: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int,
               block_size: int, dtype: torch.dtype, seed: int):
    seq_lens, query_lens = zip(*batch)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 7  # some blocks belong to no one
    tensors = make_paged_batch(list(seq_lens), list(query_lens), num_heads, num_kv_heads, head_size,
                               block_size, num_blocks, dtype, generator(seed))
    return [t.to(DEVICE) for t in tensors]


def run_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
               decode_partition_size: int = 512) -> torch.Tensor:
    out = poisoned(*query.shape, dtype=query.dtype)
    launch = paged_attention_launch(seq_lens, query_start_loc, decode_partition_size)
    result = paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                             out=out, launch=launch)
    assert result is out
    return out


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(4, 4, 16), (8, 2, 32), (8, 1, 16)])
def test_reference_matches_naive_oracle(num_heads, num_kv_heads, block_size):
    inputs = make_batch(MIXED_BATCH, num_heads, num_kv_heads, 32, block_size, torch.float32,
                        seed=num_heads + num_kv_heads + block_size)
    inputs = [t.cpu() for t in inputs]
    expected = naive_paged_attention(*inputs, scale=0.2)
    torch.testing.assert_close(paged_attention_ref(*inputs, scale=0.2), expected, rtol=1e-4, atol=1e-5)


def test_launch_splits_decodes_from_prefills_and_sizes_the_grids():
    _, _, _, _, seq_lens, query_start_loc = make_batch(MIXED_BATCH, 2, 1, 16, 16, torch.float32, seed=0)
    launch = paged_attention_launch(seq_lens, query_start_loc, 64)
    assert launch.decode_seqs.tolist() == [0, 2, 4] and launch.prefill_seqs.tolist() == [1, 3, 5]
    assert (launch.max_query_len, launch.max_decode_seq_len, launch.decode_partition_size) == (70, 130, 64)
    assert launch.decode_seqs.dtype == launch.prefill_seqs.dtype == torch.int32
    decodes = paged_attention_launch(seq_lens[[0, 2]], torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE))
    assert (decodes.prefill_seqs.numel(), decodes.max_query_len, decodes.max_decode_seq_len) == (0, 0, 37)


# Every head size in both dtypes, GQA ratios 1, 4 and 8 and both block sizes among them.
TRITON_CASES = [
    (dtype, head_size, heads, block_size)
    for dtype in (torch.float32, torch.bfloat16)
    for head_size, heads, block_size in [(16, (2, 2), 16), (32, (4, 1), 32), (64, (4, 4), 16),
                                         (80, (8, 2), 32), (96, (4, 1), 16), (128, (8, 1), 32)]
]


@requires_triton
@pytest.mark.parametrize("dtype, head_size, heads, block_size", TRITON_CASES)
def test_triton_matches_reference_on_a_mixed_batch(dtype, head_size, heads, block_size):
    num_heads, num_kv_heads = heads
    inputs = make_batch(MIXED_BATCH, num_heads, num_kv_heads, head_size, block_size, dtype,
                        seed=head_size * 100 + num_heads * 10 + block_size)
    scale = head_size**-0.5
    expected = paged_attention_ref(*inputs, scale=scale)
    # 64-key splits: the long decode takes three, the others one; the reduction combines them
    assert_close(run_triton(*inputs, scale=scale, decode_partition_size=64), expected)


@requires_triton
@pytest.mark.parametrize("batch", [
    pytest.param([(150, 1), (16, 1), (17, 1), (64, 1)], id="decodes-in-one-split-each"),
    pytest.param([(200, 1), (3, 1), (97, 1)], id="decodes-in-16-key-splits"),
    pytest.param([(33, 33), (64, 64), (2, 2), (130, 130)], id="whole-prompts"),
    pytest.param([(80, 16), (129, 65), (40, 39), (16, 2)], id="chunks-after-prefix-hits"),
])
def test_triton_matches_reference_on_one_kind_of_sequence(batch):
    partition = 16 if batch[0] == (200, 1) else 512
    inputs = make_batch(batch, 8, 2, 64, 16, torch.float32, seed=len(batch) + batch[0][0])
    expected = paged_attention_ref(*inputs, scale=0.125)
    assert_close(run_triton(*inputs, scale=0.125, decode_partition_size=partition), expected)


@requires_triton
@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_on_random_batches(seed):
    """Random shapes and a random batch: each sequence is a decode, a whole prompt or a
    chunk after a prefix of any length; decodes split into 16 to 512 keys."""
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    head_size = rng.choice([16, 32, 64, 80, 96, 128])
    num_kv_heads = rng.choice([1, 2])
    num_heads = num_kv_heads * rng.choice([1, 4, 8])
    batch = []
    for _ in range(rng.randint(1, 7)):
        seq_len = rng.randint(1, 300)
        batch.append((seq_len, rng.choice([1, seq_len, rng.randint(1, seq_len)])))
    inputs = make_batch(batch, num_heads, num_kv_heads, head_size, rng.choice([16, 32]), dtype, seed=seed)
    expected = paged_attention_ref(*inputs, scale=head_size**-0.5)
    partition = rng.choice([16, 64, 512])
    assert_close(run_triton(*inputs, scale=head_size**-0.5, decode_partition_size=partition), expected)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_that_fits_one_split_gets_the_unsplit_output_under_any_split_count(dtype):
    """A CUDA graph launches max_model_len's splits and the reduction whatever the step; an
    eager step, its longest decode's. A decode that fits one split is written by its one
    program, bit for bit as in a launch of one split, and the reduction leaves it alone
    (its partial results are never written: the launcher's buffers start as NaN)."""
    batch = [(600, 1), (40, 1), (512, 1), (1, 1)]  # 600: two splits of 512; the others one
    inputs = make_batch(batch, 8, 2, 64, 16, dtype, seed=11)
    query, _, _, _, seq_lens, query_start_loc = inputs
    device_seqs = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    no_prefills = torch.zeros(0, dtype=torch.int32, device=DEVICE)

    def launched(decode_seqs: torch.Tensor, max_decode_seq_len: int) -> torch.Tensor:
        out = poisoned(*query.shape, dtype=dtype)
        launch = PagedAttentionLaunch(decode_seqs, no_prefills, 0, max_decode_seq_len, 512)
        return paged_attention(*inputs, scale=0.125, out=out, launch=launch)

    one_split = launched(device_seqs[1:], 512)  # the short ones alone, one split: no reduction launched
    eager = launched(device_seqs, 600)  # two splits
    graph = launched(device_seqs, 4096)  # eight splits, as a graph of max_model_len 4096
    for out in (eager, graph):
        assert torch.equal(out[1:], one_split[1:])
    assert one_split[0].isnan().all()  # (not in that launch)
    assert_close(eager, paged_attention_ref(*inputs, scale=0.125))
    assert_close(graph[0], eager[0])


@requires_triton
def test_triton_computes_its_own_launch_sizes_without_one():
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = make_batch(
        MIXED_BATCH, 4, 2, 16, 16, torch.float32, seed=5)
    out = paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.25)
    assert_close(out, paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc, 0.25))


@requires_triton
def test_cache_offsets_past_two_to_the_31_elements():
    """Blocks at the end of a cache of more than 2**31 elements (helpers.caches_past_two_to_the_31)."""
    num_kv_heads, block_size, head_size = 1, 16, 16
    key_cache, value_cache = caches_past_two_to_the_31(block_size, head_size)
    num_blocks = key_cache.shape[0]
    g = generator(31)
    # one prefill chunk of 30 tokens after a 10-token prefix, and a decode, in the last blocks
    seq_lens = torch.tensor([40, 20], dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([0, 30, 31], dtype=torch.int32, device=DEVICE)
    block_tables = torch.tensor([[num_blocks - 1, num_blocks - 5, num_blocks - 3],
                                 [num_blocks - 2, num_blocks - 4, 0]], dtype=torch.int32, device=DEVICE)
    slots = [int(block_tables[seq, pos // block_size]) * block_size + pos % block_size
             for seq, seq_len in enumerate(seq_lens.tolist()) for pos in range(seq_len)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    keys = torch.randn(len(slots), num_kv_heads, head_size, generator=g).to(torch.bfloat16).to(DEVICE)
    values = torch.randn(len(slots), num_kv_heads, head_size, generator=g).to(torch.bfloat16).to(DEVICE)

    store_kv(keys, values, key_cache, value_cache, slot_mapping)
    last = slot_mapping.max().item()
    assert torch.equal(key_cache.view(-1, num_kv_heads, head_size)[last], keys[slot_mapping.argmax()])
    assert torch.equal(value_cache.view(-1, num_kv_heads, head_size)[slot_mapping], values)

    query = torch.randn(31, 4, head_size, generator=g).to(torch.bfloat16).to(DEVICE)
    expected = paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.25)
    assert_close(run_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.25),
                 expected)
    # store_kv's own offsets, read back through the reference's
    store_kv_ref(keys, values, key_cache, value_cache, slot_mapping)
    assert_close(run_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.25),
                 expected)


@requires_triton
def test_triton_of_an_empty_batch_returns_the_empty_output():
    query = torch.empty(0, 4, 16, device=DEVICE)
    cache = torch.zeros(2, 1, 16, 16, device=DEVICE)
    out = paged_attention(query, cache, cache, torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
                          torch.zeros(0, dtype=torch.int32, device=DEVICE),
                          torch.zeros(1, dtype=torch.int32, device=DEVICE), 0.25)
    assert out.shape == (0, 4, 16)


@pytest.mark.gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
def test_triton_matches_reference_at_serving_sizes(head_size):
    """Compiled (not interpreted): 64 decodes of up to 2k tokens and two long prefill
    chunks, bf16, 32 query heads over 8 kv heads, default launch sizes."""
    g = generator(head_size)
    batch = [(int(n), 1) for n in torch.randint(1, 2048, (64,), generator=g)] + [(1500, 700), (900, 900)]
    inputs = make_batch(batch, 32, 8, head_size, 16, torch.bfloat16, seed=head_size)
    expected = paged_attention_ref(*inputs, scale=head_size**-0.5)
    assert_close(run_triton(*inputs, scale=head_size**-0.5), expected)
