"""Attention variants (a sliding window, a logit soft cap, sinks, the query scale) in every
paged attention path: the reference against the naive oracle and against Hugging Face's own
eager attention (Gemma 2's soft cap, GPT-OSS's sinks, masking_utils' sliding window); the
C++ CPU kernels and the Triton kernels against the reference.

Block table entries of blocks wholly outside every query's window hold an id far past the
cache (a KV-cache manager may free those blocks): a path that reads one fails (an index
error, or a crash in the C++ or Triton kernel)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.paged_attention import PagedAttentionLaunch, paged_attention, paged_attention_launch
from kernels.paged_attention_cpu import paged_attention_cpu, plan_paged_attention_cpu
from kernels.paged_attention_ref import paged_attention_ref
from tests.kernels.helpers import DEVICE, assert_close, generator, poisoned, requires_cuda, requires_triton
from tests.kernels.naive import make_paged_batch, naive_paged_attention

STALE = 2**30  # a freed block's table entry: any read of it is far out of the cache

# (seq_len, query_len) around a window of 16-24 keys: decodes far past it and inside it,
# whole prompts longer and shorter than it, chunks that start before, at and after its reach
WINDOW_BATCH = [
    (200, 1),  # a decode whose context is many windows long
    (90, 90),  # a whole prompt, several windows long
    (120, 50),  # a chunk after 70 cached tokens: its first queries' windows reach into the prefix
    (9, 1),  # a decode inside its window
    (7, 7),  # a whole prompt shorter than the window
    (77, 13),  # a short chunk, mid-block, far past the sequence's start
    (33, 1),  # a decode whose window starts mid-block
]

# name -> the variant's arguments; sinks are made per case ([num_heads])
VARIANTS = {
    "window": dict(sliding_window=16),
    "window-of-one": dict(sliding_window=1),
    "soft-cap": dict(logits_soft_cap=2.0),
    "sinks": dict(sinks=True),
    "scale": dict(scale=0.3),
    "all": dict(sliding_window=24, logits_soft_cap=3.0, sinks=True, scale=0.2),
    "window-and-sinks": dict(sliding_window=20, sinks=True),
}


def variant_arguments(name: str, num_heads: int, seed: int) -> dict:
    variant = dict(VARIANTS[name])
    if variant.get("sinks"):  # logits about as large as the scores, some above them
        variant["sinks"] = (torch.randn(num_heads, generator=generator(seed)) * 2).to(DEVICE)
    return variant


def with_stale_entries(block_tables: torch.Tensor, batch: list[tuple[int, int]], block_size: int,
                       sliding_window: int | None) -> torch.Tensor:
    """The block tables with STALE where a block holds no key any query of the step sees."""
    block_tables = block_tables.clone()
    for seq, (seq_len, query_len) in enumerate(batch):
        if sliding_window:
            lowest = max(0, seq_len - query_len - sliding_window + 1)
            block_tables[seq, : lowest // block_size] = STALE
    return block_tables


def make_batch(batch: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               dtype: torch.dtype, seed: int, sliding_window: int | None):
    seq_lens, query_lens = zip(*batch)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 7
    query, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc = make_paged_batch(
        list(seq_lens), list(query_lens), num_heads, num_kv_heads, head_size, block_size, num_blocks, dtype,
        generator(seed))
    block_tables = with_stale_entries(block_tables, batch, block_size, sliding_window)
    return [t.to(DEVICE) for t in (query, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc)]


def step_keys_values(inputs, batch: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own keys and values (each sequence's last query_len positions), from the cache."""
    _, key_cache, value_cache, block_tables = inputs[:4]
    block_size = key_cache.shape[2]
    slots = [(int(block_tables[seq, pos // block_size]), pos % block_size)
             for seq, (seq_len, query_len) in enumerate(batch) for pos in range(seq_len - query_len, seq_len)]
    return (torch.stack([key_cache[block, :, slot] for block, slot in slots]),
            torch.stack([value_cache[block, :, slot] for block, slot in slots]))


def reference(inputs, variant: dict) -> torch.Tensor:
    variant = dict(variant)
    scale = variant.pop("scale", None)
    return paged_attention_ref(*inputs, scale, **variant)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(4, 4, 16), (8, 2, 5)])
def test_reference_matches_naive_oracle(name, num_heads, num_kv_heads, block_size):
    variant = variant_arguments(name, num_heads, seed=1)
    inputs = [t.cpu() for t in make_batch(WINDOW_BATCH, num_heads, num_kv_heads, 32, block_size, torch.float32,
                                          seed=num_heads + block_size, sliding_window=variant.get("sliding_window"))]
    naive = dict(variant, sinks=variant["sinks"].cpu() if "sinks" in variant else None)
    expected = naive_paged_attention(*inputs, scale=naive.pop("scale", 32**-0.5), **naive)
    torch.testing.assert_close(reference(inputs, variant), expected, rtol=1e-4, atol=1e-5)


def hugging_face_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                           sliding_window: int | None = None, logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense attention of one sequence ([seq_len, heads, head_size] each) as Hugging Face's
    eager attention computes it: Gemma 2's (soft cap) or GPT-OSS's (sinks), with the mask of
    masking_utils (sliding_window_causal_mask_function, or the causal one)."""
    from transformers import masking_utils
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_attention
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_attention

    seq_len, num_heads, head_size = query.shape
    mask_function = (masking_utils.sliding_window_causal_mask_function(sliding_window) if sliding_window
                     else masking_utils.causal_mask_function)
    positions = torch.arange(seq_len)
    allowed = mask_function(0, 0, positions[:, None], positions[None, :])
    mask = torch.zeros(seq_len, seq_len).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = SimpleNamespace(num_key_value_groups=num_heads // key.shape[1], head_dim=head_size, training=False,
                             sinks=sinks)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, seq_len, head_size]
    if sinks is not None:
        assert logits_soft_cap is None, "no Hugging Face model has both"
        out, _ = gpt_oss_attention(module, q, k, v, mask, scaling=scale)
    else:
        out, _ = gemma2_attention(module, q, k, v, mask, scaling=scale, softcap=logits_soft_cap)
    return out[0]  # [seq_len, heads, head_size]


@pytest.mark.parametrize("variant", [
    pytest.param(dict(sliding_window=16), id="mistral-window"),
    pytest.param(dict(sliding_window=16, logits_soft_cap=50.0, scale=0.25), id="gemma2-window"),
    pytest.param(dict(logits_soft_cap=1.5), id="gemma2-global"),
    pytest.param(dict(sliding_window=12, sinks=True), id="gpt-oss-window"),
    pytest.param(dict(sinks=True), id="gpt-oss-global"),
])
def test_reference_matches_hugging_face_on_one_sequence_in_every_kind_of_step(variant):
    """One 90-token sequence, its keys in shuffled blocks of 8, attended as every kind of
    step would: the whole prompt at once, in chunks that cross the window's reach, and
    decodes far past the window; each output row equals Hugging Face's at its position."""
    seq_len, num_heads, num_kv_heads, head_size, block_size = 90, 8, 2, 32, 8
    g = generator(7)
    query = torch.randn(seq_len, num_heads, head_size, generator=g)
    key = torch.randn(seq_len, num_kv_heads, head_size, generator=g)
    value = torch.randn(seq_len, num_kv_heads, head_size, generator=g)
    variant = dict(variant, sinks=torch.randn(num_heads, generator=g) * 2 if variant.get("sinks") else None)
    variant.setdefault("scale", head_size**-0.5)
    expected = hugging_face_attention(query, key, value, **variant)

    # the sequence's keys in the cache, behind shuffled block ids
    num_blocks = -(-seq_len // block_size)
    ids = torch.randperm(num_blocks + 5, generator=g)[:num_blocks]
    key_cache = torch.zeros(num_blocks + 5, num_kv_heads, block_size, head_size)
    value_cache = torch.zeros_like(key_cache)
    for position in range(seq_len):
        key_cache[ids[position // block_size], :, position % block_size] = key[position]
        value_cache[ids[position // block_size], :, position % block_size] = value[position]
    steps = [(90, 90), (40, 40), (70, 30), (90, 20), (90, 1), (61, 1), (17, 1), (1, 1)]
    block_tables = ids.to(torch.int32).repeat(len(steps), 1)
    block_tables = with_stale_entries(block_tables, steps, block_size, variant.get("sliding_window"))
    rows = torch.cat([torch.arange(n - q, n) for n, q in steps])
    query_start_loc = torch.tensor([0] + [q for _, q in steps], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in steps], dtype=torch.int32)
    inputs = [query[rows], key_cache, value_cache, block_tables, seq_lens, query_start_loc]
    torch.testing.assert_close(reference(inputs, variant), expected[rows], rtol=1e-5, atol=1e-5)


# the CPU's kernels: head sizes, GQA ratios (up to 16 query heads a kv head, fewer tokens a
# prefill task) and block sizes below, at and above the decode's 16-key runs
CPU_SHAPES = [(32, (4, 4), 16), (64, (8, 2), 5), (128, (16, 1), 32), (80, (6, 3), 8)]


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("head_size, heads, block_size", CPU_SHAPES)
def test_cpu_matches_reference(native_kernels, name, head_size, heads, block_size):
    """The C++ kernels and, without them, the CPU path's torch fallback."""
    num_heads, num_kv_heads = heads
    variant = variant_arguments(name, num_heads, seed=head_size)
    inputs = make_batch(WINDOW_BATCH, num_heads, num_kv_heads, head_size, block_size, torch.float32,
                        seed=head_size + block_size, sliding_window=variant.get("sliding_window"))
    expected = reference(inputs, variant)
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = inputs
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, block_size)
    key, value = step_keys_values(inputs, WINDOW_BATCH)
    cpu_variant = dict(variant)
    scale = cpu_variant.pop("scale", None)
    for kernels in (native_kernels, None):
        out = paged_attention_cpu(query, key, value, key_cache, value_cache, plan, scale, kernels, **cpu_variant)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cpu_window_longer_than_every_sequence_changes_no_bit(native_kernels):
    batch = [(200, 1), (90, 90), (120, 50), (33, 1)]
    inputs = make_batch(batch, 8, 2, 64, 16, torch.float32, seed=3, sliding_window=None)
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = inputs
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, 16)
    key, value = step_keys_values(inputs, batch)
    plain = paged_attention_cpu(query, key, value, key_cache, value_cache, plan, 0.125, native_kernels)
    plan = plan_paged_attention_cpu(block_tables, seq_lens, query_start_loc, 16)
    windowed = paged_attention_cpu(query, key, value, key_cache, value_cache, plan, 0.125, native_kernels,
                                   sliding_window=200)
    assert torch.equal(plain, windowed)


def run_triton(inputs, variant: dict, decode_partition_size: int = 512,
               launch: PagedAttentionLaunch | None = None) -> torch.Tensor:
    query, _, _, _, seq_lens, query_start_loc = inputs
    variant = dict(variant)
    scale = variant.pop("scale", None)
    out = poisoned(*query.shape, dtype=query.dtype)
    if launch is None:
        launch = paged_attention_launch(seq_lens, query_start_loc, decode_partition_size)
    return paged_attention(*inputs, scale, out=out, launch=launch, **variant)


@requires_triton
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype, head_size, heads, block_size, partition", [
    (torch.float32, 32, (8, 2), 16, 16),  # decodes in 16-key splits: the window's splits and the reduction
    (torch.bfloat16, 64, (4, 4), 32, 512),  # one split each: the decode kernel writes the output itself
])
def test_triton_matches_reference(name, dtype, head_size, heads, block_size, partition):
    num_heads, num_kv_heads = heads
    variant = variant_arguments(name, num_heads, seed=head_size)
    inputs = make_batch(WINDOW_BATCH, num_heads, num_kv_heads, head_size, block_size, dtype,
                        seed=head_size + block_size, sliding_window=variant.get("sliding_window"))
    assert_close(run_triton(inputs, variant, partition), reference(inputs, variant))


@requires_triton
def test_triton_windowed_decodes_under_a_cuda_graphs_grid():
    """A CUDA graph's launch sizes the decodes for max_model_len: a windowed layer still
    launches its window's splits only, and each decode (inside its window or far past it,
    in one split or several) is right."""
    batch = [(300, 1), (20, 1), (47, 1), (1, 1)]
    variant = dict(sliding_window=40, sinks=torch.linspace(-1, 2, 4, device=DEVICE))
    inputs = make_batch(batch, 4, 1, 16, 16, torch.float32, seed=5, sliding_window=40)
    decode_seqs = torch.arange(4, dtype=torch.int32, device=DEVICE)
    launch = PagedAttentionLaunch(decode_seqs, torch.zeros(0, dtype=torch.int32, device=DEVICE), 0, 4096, 16)
    assert_close(run_triton(inputs, variant, launch=launch), reference(inputs, variant))


@pytest.mark.gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("variant", [
    pytest.param(dict(sliding_window=512), id="window"),
    pytest.param(dict(sliding_window=1024, logits_soft_cap=50.0, scale=256**-0.5), id="gemma2"),
    pytest.param(dict(sliding_window=128, sinks=True), id="gpt-oss"),
])
def test_triton_matches_reference_at_serving_sizes(variant):
    """Compiled: 48 decodes of up to 8k tokens and two long prefill chunks across the
    window, bf16, 32 query heads over 8 kv heads, default launch sizes."""
    g = generator(len(variant))
    batch = [(int(n), 1) for n in torch.randint(1, 8192, (48,), generator=g)] + [(3000, 1500), (1800, 1800)]
    variant = dict(variant, **({"sinks": torch.randn(32, generator=g).to(DEVICE)} if variant.get("sinks") else {}))
    inputs = make_batch(batch, 32, 8, 128, 16, torch.bfloat16, seed=2, sliding_window=variant["sliding_window"])
    assert_close(run_triton(inputs, variant), reference(inputs, variant))
