"""Attention of a flat batch of prefill chunks and decodes over the paged KV cache, in
Triton (the GPU's path): the same inputs and result as paged_attention_ref
(kernels/paged_attention_ref.py), which is its oracle and the CPU's torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import cdiv, dot_in_fp32, jit, next_power_of_2, tl
from kernels.paged_attention_ref import SequenceSplit

# -- Triton ----------------------------------------------------------------------------------
#
# Two kernels, each launched over its own kind of sequence:
# - decodes (q_len == 1): split-K ("flash-decoding"). A program takes one (decode, kv head,
#   split of PARTITION_SIZE keys) and all the query heads that share the kv head, so each
#   key is read once per group; a second pass combines the splits' softmaxes. A long
#   context thus spreads over many programs even when the batch is small.
# - prefill chunks: a program takes BLOCK_M queries of one head of one chunk and walks the
#   keys through the block table up to its last query's position (flash attention with a
#   causal mask on positions, so a chunk that starts mid-sequence sees its whole prefix).
# Keys are gathered token by token through the block table, so a tile may span blocks
# and any block size works. Softmax runs online in fp32 with exp2 (the scale is
# pre-multiplied by log2(e)). Cache offsets start from int64 block ids: block_id * stride
# passes 2**31 in a cache of a few GB.


@dataclass(frozen=True)
class PagedAttentionLaunch:
    """What a step's launches need besides the attention inputs, computed once per step
    (paged_attention_launch) and shared by all layers: the grid sizes, which are host
    numbers, and which sequences each kernel takes."""

    decode_seqs: torch.Tensor  # [num_decodes] int32: sequences with one query token
    prefill_seqs: torch.Tensor  # [num_prefills] int32: sequences with more
    max_query_len: int  # longest prefill chunk (0: none)
    max_decode_seq_len: int  # longest sequence among the decodes (0: none)
    decode_partition_size: int = 512  # keys per split of a decode: a power of two >= 16


_DECODE_BLOCK_N = 64  # keys per iteration of the decode kernel (fewer if the partition is smaller)
_PREFILL_BLOCK_M = 64  # queries per prefill program
_PREFILL_BLOCK_N = 64  # keys per iteration of the prefill kernel
_LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); the kernels take scale * log2(e)


def paged_attention_launch(
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    decode_partition_size: int = 512,
    host: SequenceSplit | None = None,  # the same on the host, split; else read off the device (a sync)
) -> PagedAttentionLaunch:
    assert decode_partition_size >= 16 and decode_partition_size & (decode_partition_size - 1) == 0
    if host is None:
        host = SequenceSplit.from_device(seq_lens, query_start_loc)
    starts = host.query_start_loc

    def on_device(seqs: list[int]) -> torch.Tensor:
        return torch.tensor(seqs, dtype=torch.int32).to(seq_lens.device, non_blocking=True)

    return PagedAttentionLaunch(
        decode_seqs=on_device(host.decode_seqs), prefill_seqs=on_device(host.prefill_seqs),
        max_query_len=max((starts[seq + 1] - starts[seq] for seq in host.prefill_seqs), default=0),
        max_decode_seq_len=max((host.seq_lens[seq] for seq in host.decode_seqs), default=0),
        decode_partition_size=decode_partition_size)


@jit
def _paged_decode_kernel(
    query_ptr,  # [num_tokens, num_heads, head_size]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    decode_seqs_ptr,  # [num_decodes] int32
    out_ptr,  # [num_tokens, num_heads, head_size]: written when NUM_SPLITS == 1
    partial_out_ptr,  # [num_decodes, num_heads, NUM_SPLITS, head_size] fp32: each split's output
    partial_max_ptr, partial_sum_ptr,  # [num_decodes, num_heads, NUM_SPLITS] fp32: its softmax max, sum
    scale_log2,  # scale * log2(e)
    query_stride_token, query_stride_head, out_stride_token, out_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot, block_tables_stride,
    num_heads, head_size,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (the smallest tl.dot)
    BLOCK_D: tl.constexpr,  # head_size padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # keys per iteration
    PARTITION_SIZE: tl.constexpr,  # keys per split
    NUM_SPLITS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # see kernels._triton.dot_in_fp32
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 (tf32 keeps 10 mantissa bits); else None
):
    decode = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decode_seqs_ptr + decode)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * PARTITION_SIZE
    if start >= seq_len:  # a shorter sequence than the longest decode
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    groups = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, BLOCK_D)
    head_mask = (groups < GROUP)[:, None] & (dims < head_size)[None, :]
    q = tl.load(query_ptr + token * query_stride_token + heads[:, None] * query_stride_head + dims[None, :],
                mask=head_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        block_ids = tl.load(block_table + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        offsets = (block_ids[:, None] * cache_stride_block + kv_head * cache_stride_head
                   + (tokens % BLOCK_SIZE)[:, None] * cache_stride_slot + dims[None, :])
        kv_mask = token_mask[:, None] & (dims < head_size)[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # finite: every tile has a key
        correction = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        row_max = new_max

    if NUM_SPLITS == 1:
        out = out_ptr + token * out_stride_token + heads[:, None] * out_stride_head + dims[None, :]
        tl.store(out, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=head_mask)
    else:
        rows = (decode.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(partial_out_ptr + rows[:, None] * head_size + dims[None, :], acc / row_sum[:, None],
                 mask=head_mask)
        tl.store(partial_max_ptr + rows, row_max, mask=groups < GROUP)
        tl.store(partial_sum_ptr + rows, row_sum, mask=groups < GROUP)


@jit
def _paged_decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    partial_out_ptr,  # [num_decodes, num_heads, NUM_SPLITS, head_size] fp32
    partial_max_ptr, partial_sum_ptr,  # [num_decodes, num_heads, NUM_SPLITS] fp32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    decode_seqs_ptr,  # [num_decodes] int32
    out_stride_token, out_stride_head, num_heads, head_size,
    PARTITION_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    BLOCK_D: tl.constexpr,
):
    """One program per (decode, head): the splits' outputs weighted by their softmax sums,
    rescaled to a common max."""
    decode = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(decode_seqs_ptr + decode)
    num_splits = (tl.load(seq_lens_ptr + seq) + PARTITION_SIZE - 1) // PARTITION_SIZE
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    rows = (decode.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    maxes = tl.load(partial_max_ptr + rows, mask=split_mask, other=float("-inf"))
    weights = tl.load(partial_sum_ptr + rows, mask=split_mask, other=0.0) * tl.exp2(maxes - tl.max(maxes, 0))
    partial = tl.load(partial_out_ptr + rows[:, None] * head_size + dims[None, :],
                      mask=split_mask[:, None] & (dims < head_size)[None, :], other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * out_stride_token + head * out_stride_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_size)


@jit
def _paged_prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_size]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    prefill_seqs_ptr,  # [num_prefills] int32
    out_ptr,  # [num_tokens, num_heads, head_size]
    scale_log2,  # scale * log2(e)
    query_stride_token, query_stride_head, out_stride_token, out_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot, block_tables_stride,
    head_size,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per iteration
    BLOCK_D: tl.constexpr,  # head_size padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    DOT_IN_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    query_tile = tl.program_id(0)
    seq = tl.load(prefill_seqs_ptr + tl.program_id(1))
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_tile * BLOCK_M >= query_len:  # past the end of a shorter chunk than the longest
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP
    rows = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    positions = seq_len - query_len + rows  # the chunk's queries are the sequence's last tokens
    dims = tl.arange(0, BLOCK_D)
    query_mask = (rows < query_len)[:, None] & (dims < head_size)[None, :]
    tokens_of_rows = (query_start + rows).to(tl.int64)
    q = tl.load(query_ptr + tokens_of_rows[:, None] * query_stride_token + head * query_stride_head
                + dims[None, :], mask=query_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    # keys up to this tile's last query; the first tile holds key 0, which every row sees
    end = tl.minimum(seq_len, seq_len - query_len + (query_tile + 1) * BLOCK_M)
    for tile_start in range(0, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        block_ids = tl.load(block_table + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        offsets = (block_ids[:, None] * cache_stride_block + kv_head * cache_stride_head
                   + (tokens % BLOCK_SIZE)[:, None] * cache_stride_slot + dims[None, :])
        kv_mask = token_mask[:, None] & (dims < head_size)[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        correction = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        row_max = new_max
    out = out_ptr + tokens_of_rows[:, None] * out_stride_token + head * out_stride_head + dims[None, :]
    tl.store(out, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=query_mask)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: tokens in the cache, this step's included
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cumulative query lengths
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    launch: PagedAttentionLaunch | None = None,  # from paged_attention_launch; else made here
) -> torch.Tensor:
    """paged_attention_ref's result, from the Triton kernels."""
    num_tokens, num_heads, head_size = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], key_cache.shape[1]
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape and key_cache.shape[3] == head_size
    assert key_cache.dtype == value_cache.dtype == query.dtype
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.dtype == query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    # the last dimension of each is contiguous; the others may be strided
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and key_cache.stride() == value_cache.stride()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    if num_tokens == 0:
        return out
    if launch is None:
        launch = paged_attention_launch(seq_lens, query_start_loc)
    tables = (block_tables, seq_lens, query_start_loc)
    if launch.max_decode_seq_len:
        _launch_decodes(query, key_cache, value_cache, tables, out, scale, launch)
    if launch.max_query_len:
        grid = (cdiv(launch.max_query_len, _PREFILL_BLOCK_M), launch.prefill_seqs.numel(), num_heads)
        _paged_prefill_kernel[grid](
            query, key_cache, value_cache, *tables, launch.prefill_seqs, out, scale * _LOG2_E,
            *_strides(query, key_cache, block_tables, out), head_size,
            BLOCK_M=_PREFILL_BLOCK_M, BLOCK_N=_PREFILL_BLOCK_N, **_shape_constants(query, key_cache),
            # fp32 K/V tiles are twice as big: three stages of them may not fit in shared memory
            num_stages=2 if query.element_size() == 4 else 3)
    return out


def _strides(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
             out: torch.Tensor) -> tuple[int, ...]:
    return (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0))


def _shape_constants(query: torch.Tensor, key_cache: torch.Tensor) -> dict:
    return dict(GROUP=query.shape[1] // key_cache.shape[1], BLOCK_D=max(16, next_power_of_2(query.shape[2])),
                BLOCK_SIZE=key_cache.shape[2], DOT_IN_FP32=dot_in_fp32(query.dtype, query.device),
                INPUT_PRECISION="ieee" if query.dtype == torch.float32 else None)


def _launch_decodes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    tables: tuple[torch.Tensor, ...], out: torch.Tensor, scale: float,
                    launch: PagedAttentionLaunch) -> None:
    num_decodes, (_, num_heads, head_size) = launch.decode_seqs.numel(), query.shape
    num_kv_heads, partition = key_cache.shape[1], launch.decode_partition_size
    num_splits = cdiv(launch.max_decode_seq_len, partition)
    if num_splits == 1:  # the decode kernel writes out itself; no partial buffers
        partial_out = partial_max = partial_sum = out
    else:
        partial_out = torch.empty(num_decodes, num_heads, num_splits, head_size, dtype=torch.float32,
                                  device=query.device)
        partial_max = torch.empty(num_decodes, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    constants = _shape_constants(query, key_cache)
    _paged_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, key_cache, value_cache, *tables, launch.decode_seqs, out, partial_out, partial_max, partial_sum,
        scale * _LOG2_E, *_strides(query, key_cache, tables[0], out), num_heads, head_size,
        BLOCK_G=max(16, next_power_of_2(constants["GROUP"])), BLOCK_N=min(_DECODE_BLOCK_N, partition),
        PARTITION_SIZE=partition, NUM_SPLITS=num_splits, **constants)
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_decodes, num_heads)](
            out, partial_out, partial_max, partial_sum, *tables[1:], launch.decode_seqs,
            out.stride(0), out.stride(1), num_heads, head_size,
            PARTITION_SIZE=partition, NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=constants["BLOCK_D"])
