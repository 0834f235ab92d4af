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
) -> PagedAttentionPlan:
    if host is None:
        host = SequenceSplit.from_device(seq_lens, query_start_loc)
    return PagedAttentionPlan(prefills=prefill_chunks(block_tables, host, block_size),
                              **plan_decodes(block_tables, seq_lens, host, block_size, dtype))


def prefill_chunks(block_tables: torch.Tensor, host: SequenceSplit, block_size: int) -> list[PrefillChunk]:
    chunks = []
    starts, seq_lens = host.query_start_loc, host.seq_lens
    for seq in host.prefill_seqs:
        num_blocks = -(-seq_lens[seq] // block_size)
        chunks.append(PrefillChunk(starts[seq], starts[seq + 1] - starts[seq], seq_lens[seq],
                                   block_tables[seq, :num_blocks].long()))
    return chunks


def plan_decodes(block_tables: torch.Tensor, seq_lens: torch.Tensor, host: SequenceSplit, block_size: int,
                 dtype: torch.dtype) -> dict:
    decode_seqs, starts = host.decode_seqs, host.query_start_loc
    num_decodes = len(decode_seqs)
    # planned on the host (a reference: one copy of the tables is fine), handed to the device after
    device, block_tables, seq_lens = block_tables.device, block_tables.cpu(), seq_lens.cpu()
    rows = torch.tensor(decode_seqs, dtype=torch.long)
    lens = seq_lens.long().index_select(0, rows)
    num_blocks = (lens + block_size - 1) // block_size
    max_blocks = int(num_blocks.max()) if num_decodes else 0
    column = torch.arange(max_blocks)
    in_table = column[None, :] < num_blocks[:, None]  # [num_decodes, max_blocks]
    block_ids = block_tables.long().index_select(0, rows)[:, :max_blocks][in_table]
    owner = torch.arange(num_decodes).repeat_interleave(num_blocks)
    # slots of each block that hold a token: all but in a sequence's last block
    num_valid = (lens[:, None] - column[None, :] * block_size).clamp(max=block_size)[in_table]

    block_range = None
    if num_decodes:
        lo, hi = int(block_ids.min()), int(block_ids.max()) + 1
        distinct = int(torch.unique(block_ids).numel()) == block_ids.numel()
        if distinct and hi - lo <= 2 * block_ids.numel():
            # Read the cache in place; blocks in the range no decode owns go to a dummy row.
            block_range = (lo, hi)
            full_owner = torch.full((hi - lo,), num_decodes, dtype=torch.long)
            full_valid = torch.zeros(hi - lo, dtype=torch.long)
            full_owner[block_ids - lo] = owner
            full_valid[block_ids - lo] = num_valid
            owner, num_valid = full_owner, full_valid
    valid = torch.arange(block_size)[None, :] < num_valid[:, None]
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
    plan: PagedAttentionPlan,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    if plan.num_decodes:
        out[plan.decode_query_index] = decode_attention(query, key_cache, value_cache, plan, scale)
    for chunk in plan.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = prefill_attention(query[rows], key_cache, value_cache, chunk, scale)
    return out


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      plan: PagedAttentionPlan, scale: float) -> torch.Tensor:
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
    scores = scores.float().mul_(scale).add_(plan.decode_bias)
    block_max = scores.amax(-1)
    seq_max = torch.full_like(q[:, :, :, 0], _MASKED, dtype=torch.float32)
    seq_max.scatter_reduce_(0, owner[:, None, None].expand_as(block_max), block_max, "amax")
    probs = torch.exp(scores - seq_max.index_select(0, owner).unsqueeze(-1))
    denominator = torch.zeros_like(seq_max).index_add_(0, owner, probs.sum(-1))
    partial = torch.matmul(probs.to(values.dtype), values)  # [num_pairs, num_kv_heads, group, head_size]
    numerator = torch.zeros(q.shape, dtype=torch.float32, device=q.device).index_add_(0, owner, partial.float())
    result = numerator[:num_decodes] / denominator[:num_decodes].unsqueeze(-1)
    return result.view(num_decodes, num_kv_heads * group, head_size).to(query.dtype)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       chunk: PrefillChunk, scale: float) -> torch.Tensor:
    num_kv_heads, head_size = key_cache.shape[1], key_cache.shape[3]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [1, num_kv_heads, seq_len, head_size]
        blocks = cache.index_select(0, chunk.block_ids).transpose(0, 1)
        return blocks.reshape(1, num_kv_heads, -1, head_size)[:, :, : chunk.seq_len]

    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_size]
    if chunk.query_len == chunk.seq_len:
        mask, causal = None, True
    else:  # the chunk starts mid-sequence: query i sits at position seq_len - query_len + i
        first = chunk.seq_len - chunk.query_len
        positions = torch.arange(chunk.seq_len, device=query.device)
        mask = positions[None, :] <= positions[first:, None]
        causal = False
    out = F.scaled_dot_product_attention(q, gather(key_cache), gather(value_cache), attn_mask=mask,
                                         is_causal=causal, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: tokens in the cache, this step's included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cumulative query lengths
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
) -> torch.Tensor:
    assert query.dim() == 3 and key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert query.shape[1] % key_cache.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.shape[2] == key_cache.shape[3]
    assert block_tables.shape[0] == seq_lens.shape[0] == query_start_loc.shape[0] - 1
    plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[2])
    return paged_attention_planned(query, key_cache, value_cache, plan, scale, out)
