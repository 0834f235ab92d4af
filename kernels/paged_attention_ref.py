"""Attention of a flat batch of prefill chunks and decodes over the paged KV cache.

Sequence i owns queries query[query_start_loc[i]:query_start_loc[i+1]]: its last q_len
tokens, at positions seq_lens[i] - q_len ... seq_lens[i] - 1, whose keys are already in
the cache (store_kv runs first). Causal within the new tokens; GQA (num_heads is a
multiple of num_kv_heads) without repeating K/V.

Cache layout: [num_blocks, num_kv_heads, block_size, head_size].

The torch reference is also the CPU path, so it is written for speed:
- decodes (q_len == 1) are computed block by block: each cached block is one small
  matmul against its owner's query, read in place from the cache (no gather of K/V when
  the decodes' blocks are a compact range), and the per-block partial softmaxes are
  combined per sequence;
- prefill chunks run one scaled_dot_product_attention each over their gathered blocks.
The bookkeeping from block tables is done once per step (plan_paged_attention) and
reused by every layer (paged_attention_planned).

The Triton path (kernels/paged_attention.py, the GPU's) has its own per-step bookkeeping
(paged_attention_launch); this reference is its oracle. All three paths start their
bookkeeping from the same host numbers (SequenceSplit).

Attention variants, per call (a model's layers may differ), the same in every path:
- scale: the scores' factor, head_size ** -0.5 by default (Gemma: query_pre_attn_scalar ** -0.5).
- logits_soft_cap: scores = cap * tanh(scores / cap), after the scale and before the mask and
  softmax (Gemma 2).
- sinks: [num_heads] fp32, a learned logit per head that joins the softmax's denominator and
  adds no value (GPT-OSS): softmax over [scores, sink], the sink's column dropped.
- sliding_window: a query at position p sees the keys at positions p - window < k <= p, its
  last `window` keys itself included (Hugging Face's sliding_window_overlay: kv_idx > q_idx -
  window). The kernels never read a block wholly outside a query's window, so its entry in
  the block table may be stale: a KV-cache manager may free those blocks (the sequence's
  block table keeps its columns, position // block_size, with anything in the freed ones).
  Here the window is planned with the step (plan_paged_attention(sliding_window=)): the
  decodes' block pairs are the window's blocks only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A finite "minus infinity" for masked scores: exp() of it is 0 and it never makes NaN.
_MASKED = -1e30


@dataclass
class PrefillChunk:
    query_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64


@dataclass
class PagedAttentionPlan:
    """Tensors derived from the block tables, shared by all layers of a step."""

    num_decodes: int
    decode_query_index: torch.Tensor  # [num_decodes] int64: decode i's row in query
    decode_block_range: tuple[int, int] | None  # (lo, hi): read key_cache[lo:hi] in place
    decode_block_ids: torch.Tensor | None  # [num_pairs] int64: else gather these blocks
    decode_owner: torch.Tensor  # [num_pairs] int64: decode that owns each block (num_decodes = none)
    decode_bias: torch.Tensor  # [num_pairs, 1, 1, block_size]: 0 for valid slots, _MASKED else
    prefills: list[PrefillChunk]
    sliding_window: int | None = None  # the window the decodes' pairs were planned for (None: all keys)


@dataclass(frozen=True)
class SequenceSplit:
    """A step's sequence lengths and query offsets on the host, its sequences split into
    decodes (one query token) and prefill chunks: what every backend's per-step bookkeeping
    starts from. The model runner has them before it makes the device tensors
    (actors/worker/attention_metadata.py); a caller with only the tensors reads them off
    the device (from_device: one copy, one sync)."""

    seq_lens: list[int]  # [num_seqs]: tokens in the cache, this step's included
    query_start_loc: list[int]  # [num_seqs + 1]: cumulative query lengths
    decode_seqs: list[int]  # sequences with one query token
    prefill_seqs: list[int]  # sequences with more

    @staticmethod
    def of(seq_lens: list[int], query_start_loc: list[int]) -> SequenceSplit:
        query_lens = [end - start for start, end in zip(query_start_loc, query_start_loc[1:])]
        return SequenceSplit(seq_lens, query_start_loc,
                             decode_seqs=[seq for seq, query_len in enumerate(query_lens) if query_len == 1],
                             prefill_seqs=[seq for seq, query_len in enumerate(query_lens) if query_len > 1])

    @staticmethod
    def from_device(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> SequenceSplit:
        num_seqs = seq_lens.shape[0]
        on_host = torch.cat([seq_lens, query_start_loc]).tolist()  # one copy, one sync
        return SequenceSplit.of(on_host[:num_seqs], on_host[num_seqs:])


def plan_paged_attention(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
    dtype: torch.dtype = torch.float32,
    host: SequenceSplit | None = None,  # the same on the host, split; else read off the device
    sliding_window: int | None = None,  # the layers' window (a plan per window: the decodes' blocks differ)
) -> PagedAttentionPlan:
    if host is None:
        host = SequenceSplit.from_device(seq_lens, query_start_loc)
    return PagedAttentionPlan(prefills=prefill_chunks(block_tables, host, block_size), sliding_window=sliding_window,
                              **plan_decodes(block_tables, seq_lens, host, block_size, dtype, sliding_window))


def prefill_chunks(block_tables: torch.Tensor, host: SequenceSplit, block_size: int) -> list[PrefillChunk]:
    chunks = []
    starts, seq_lens = host.query_start_loc, host.seq_lens
    for seq in host.prefill_seqs:
        num_blocks = -(-seq_lens[seq] // block_size)
        chunks.append(PrefillChunk(starts[seq], starts[seq + 1] - starts[seq], seq_lens[seq],
                                   block_tables[seq, :num_blocks].long()))
    return chunks


def plan_decodes(block_tables: torch.Tensor, seq_lens: torch.Tensor, host: SequenceSplit, block_size: int,
                 dtype: torch.dtype, sliding_window: int | None = None) -> dict:
    decode_seqs, starts = host.decode_seqs, host.query_start_loc
    num_decodes = len(decode_seqs)
    # planned on the host (a reference: one copy of the tables is fine), handed to the device after
    device, block_tables, seq_lens = block_tables.device, block_tables.cpu(), seq_lens.cpu()
    rows = torch.tensor(decode_seqs, dtype=torch.long)
    lens = seq_lens.long().index_select(0, rows)
    # a decode's keys: positions first_key ... len - 1, in its blocks first_block ... (the window's only)
    first_key = (lens - sliding_window).clamp(min=0) if sliding_window else torch.zeros_like(lens)
    first_block = first_key // block_size
    num_blocks = (lens + block_size - 1) // block_size - first_block
    max_blocks = int(num_blocks.max()) if num_decodes else 0
    column = first_block[:, None] + torch.arange(max_blocks)[None, :]  # [num_decodes, max_blocks]
    in_table = column < (first_block + num_blocks)[:, None]
    tables = block_tables.long().index_select(0, rows)
    block_ids = tables.gather(1, column.clamp(max=max(tables.shape[1] - 1, 0)))[in_table]
    owner = torch.arange(num_decodes).repeat_interleave(num_blocks)
    # slots of each block that hold a visible token: first_valid ... num_valid - 1 (all but in a
    # sequence's last block and, with a window, its first)
    num_valid = (lens[:, None] - column * block_size).clamp(max=block_size)[in_table]
    first_valid = (first_key[:, None] - column * block_size).clamp(min=0)[in_table]

    block_range = None
    if num_decodes:
        lo, hi = int(block_ids.min()), int(block_ids.max()) + 1
        distinct = int(torch.unique(block_ids).numel()) == block_ids.numel()
        if distinct and hi - lo <= 2 * block_ids.numel():
            # Read the cache in place; blocks in the range no decode owns go to a dummy row.
            block_range = (lo, hi)
            full_owner = torch.full((hi - lo,), num_decodes, dtype=torch.long)
            full_valid = torch.zeros(hi - lo, dtype=torch.long)
            full_first = torch.zeros(hi - lo, dtype=torch.long)
            full_owner[block_ids - lo] = owner
            full_valid[block_ids - lo] = num_valid
            full_first[block_ids - lo] = first_valid
            owner, num_valid, first_valid = full_owner, full_valid, full_first
    slot = torch.arange(block_size)[None, :]
    valid = (slot < num_valid[:, None]) & (slot >= first_valid[:, None])
    bias = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, _MASKED)
    return {
        "num_decodes": num_decodes,
        "decode_query_index": torch.tensor([starts[i] for i in decode_seqs], dtype=torch.long, device=device),
        "decode_block_range": block_range,
        "decode_block_ids": None if block_range else block_ids.to(device),
        "decode_owner": owner.to(device),
        "decode_bias": bias[:, None, None, :].to(device),
    }


def paged_attention_planned(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    plan: PagedAttentionPlan,  # planned with the layer's sliding_window
    scale: float | None = None,  # None: head_size ** -0.5
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    *,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    if scale is None:
        scale = query.shape[2] ** -0.5
    variant = dict(logits_soft_cap=logits_soft_cap, sinks=sinks)
    if plan.num_decodes:
        out[plan.decode_query_index] = decode_attention(query, key_cache, value_cache, plan, scale, **variant)
    for chunk in plan.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = prefill_attention(query[rows], key_cache, value_cache, chunk, scale,
                                      sliding_window=plan.sliding_window, **variant)
    return out


def soft_capped(scores: torch.Tensor, logits_soft_cap: float | None) -> torch.Tensor:
    """Gemma 2's cap on the (scaled) scores: cap * tanh(scores / cap)."""
    return scores if logits_soft_cap is None else torch.tanh(scores / logits_soft_cap) * logits_soft_cap


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     plan: PagedAttentionPlan, scale: float, *, logits_soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    num_decodes, owner = plan.num_decodes, plan.decode_owner
    _, num_kv_heads, block_size, head_size = key_cache.shape
    group = query.shape[1] // num_kv_heads
    q = query.index_select(0, plan.decode_query_index).view(num_decodes, num_kv_heads, group, head_size)
    q = torch.cat([q, q.new_zeros(1, num_kv_heads, group, head_size)])  # the dummy owner's row
    if plan.decode_block_range is not None:
        lo, hi = plan.decode_block_range
        keys, values = key_cache[lo:hi], value_cache[lo:hi]
    else:
        keys = key_cache.index_select(0, plan.decode_block_ids)
        values = value_cache.index_select(0, plan.decode_block_ids)
    # scores of each block against its owner's queries: [num_pairs, num_kv_heads, group, block_size]
    scores = torch.matmul(q.index_select(0, owner), keys.transpose(-1, -2))
    scores = soft_capped(scores.float().mul_(scale), logits_soft_cap).add_(plan.decode_bias)
    block_max = scores.amax(-1)
    seq_max = torch.full_like(q[:, :, :, 0], _MASKED, dtype=torch.float32)
    seq_max.scatter_reduce_(0, owner[:, None, None].expand_as(block_max), block_max, "amax")
    if sinks is not None:  # [num_kv_heads, group]: joins each decode's max and denominator
        sink = sinks.float().view(num_kv_heads, group)
        seq_max = torch.maximum(seq_max, sink)
    probs = torch.exp(scores - seq_max.index_select(0, owner).unsqueeze(-1))
    denominator = torch.zeros_like(seq_max).index_add_(0, owner, probs.sum(-1))
    if sinks is not None:
        denominator += torch.exp(sink - seq_max)
    partial = torch.matmul(probs.to(values.dtype), values)  # [num_pairs, num_kv_heads, group, head_size]
    numerator = torch.zeros(q.shape, dtype=torch.float32, device=q.device).index_add_(0, owner, partial.float())
    result = numerator[:num_decodes] / denominator[:num_decodes].unsqueeze(-1)
    return result.view(num_decodes, num_kv_heads * group, head_size).to(query.dtype)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      chunk: PrefillChunk, scale: float, *, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    num_kv_heads, block_size, head_size = key_cache.shape[1:]
    first = chunk.seq_len - chunk.query_len  # query i sits at position first + i
    # the chunk's keys: from its first query's window on (blocks before it are never read)
    first_block = max(0, first - sliding_window + 1) // block_size if sliding_window else 0
    key_start = first_block * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [1, num_kv_heads, seq_len - key_start, head_size]
        blocks = cache.index_select(0, chunk.block_ids[first_block:]).transpose(0, 1)
        return blocks.reshape(1, num_kv_heads, -1, head_size)[:, :, : chunk.seq_len - key_start]

    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_size]
    if chunk.query_len == chunk.seq_len and not sliding_window:
        mask, causal = None, True
    else:  # the chunk starts mid-sequence or sees a window: masked on positions
        query_positions = torch.arange(first, chunk.seq_len, device=query.device)[:, None]
        key_positions = torch.arange(key_start, chunk.seq_len, device=query.device)[None, :]
        mask = key_positions <= query_positions
        if sliding_window:
            mask &= key_positions > query_positions - sliding_window
        causal = False
    if logits_soft_cap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, gather(key_cache), gather(value_cache), attn_mask=mask,
                                             is_causal=causal, scale=scale, enable_gqa=True)
    else:
        out = _explicit_attention(q, gather(key_cache), gather(value_cache), mask, scale, logits_soft_cap, sinks)
    return out[0].transpose(0, 1)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                        logits_soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """What scaled_dot_product_attention has no option for: scores soft-capped, a sink column
    in the softmax. q: [1, num_heads, query_len, head_size]; k, v: [1, num_kv_heads, keys, head_size]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = soft_capped(torch.matmul(q, k.transpose(-1, -2)).float() * scale, logits_soft_cap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], -1)
    probs = torch.softmax(scores, -1)[..., : k.shape[2]]  # the sink's column dropped
    return torch.matmul(probs.to(v.dtype), v)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: tokens in the cache, this step's included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cumulative query lengths
    scale: float | None = None,  # None: head_size ** -0.5
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    *,
    sliding_window: int | None = None,  # see the module's docstring for these
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
) -> torch.Tensor:
    assert query.dim() == 3 and key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert query.shape[1] % key_cache.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.shape[2] == key_cache.shape[3]
    assert block_tables.shape[0] == seq_lens.shape[0] == query_start_loc.shape[0] - 1
    check_variant(query.shape[1], sliding_window, logits_soft_cap, sinks)
    plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[2],
                                sliding_window=sliding_window)
    return paged_attention_planned(query, key_cache, value_cache, plan, scale, out, logits_soft_cap=logits_soft_cap,
                                   sinks=sinks)


def check_variant(num_heads: int, sliding_window: int | None, logits_soft_cap: float | None,
                  sinks: torch.Tensor | None) -> None:
    """The variant arguments every path takes, checked once at each launcher."""
    assert sliding_window is None or sliding_window >= 1, "sliding_window counts the query's own key: >= 1"
    assert logits_soft_cap is None or logits_soft_cap > 0
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous()), "sinks: [num_heads]"
