"""The Triton kernels of paged attention (the GPU's path); their launcher, which checks
the inputs and sizes the grids, is kernels/paged_attention.py, and their oracle
paged_attention_ref (kernels/paged_attention_ref.py).

Two kernels, each launched over its own kind of sequence:
- decodes (q_len == 1): split-K ("flash-decoding"). A program takes one (decode, kv head,
  split of PARTITION_SIZE keys) and all the query heads that share the kv head, so each
  key is read once per group; a second pass (_paged_decode_reduce_kernel) combines the
  splits' softmaxes. A long context thus spreads over many programs even when the batch
  is small. A sequence that fits one split is done by its one program, which writes the
  output itself (no partial results, no work in the reduction): the launcher sizes the
  grid from the step's longest decode, a CUDA graph from max_model_len.
- prefill chunks: a program takes BLOCK_M queries of one head of one chunk and walks the
  keys through the block table up to its last query's position (flash attention with a
  causal mask on positions, so a chunk that starts mid-sequence sees its whole prefix).
Both walk their keys the same way, through two helpers: _load_kv_tile gathers a tile of
keys and values token by token through the block table, so a tile may span blocks and any
block size works; _online_softmax_update folds the tile into the running softmax, in fp32
with exp2 (the scale is pre-multiplied by log2(e)). Cache offsets start from int64 block
ids: block_id * stride passes 2**31 in a cache of a few GB.

Attention variants (paged_attention_ref's docstring has their semantics), each a constexpr
switch so that plain attention compiles as it did: SLIDING (a window: a decode's splits cover
its window only, from its first key, so the grid and the work stay the window's whatever the
context; a prefill program's keys start at its first query's window; blocks before it are
never read, nor their block table entries), SOFT_CAP (the cap, times log2(e) as the scores
are), HAS_SINKS (a sink logit per head joins the softmax's denominator where the output is
normalised: the one-split decode, the reduction, the prefill).
"""

from __future__ import annotations

from kernels._triton import jit, tl


@jit
def _load_kv_tile(
    key_cache_ptr, value_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_table,  # pointer to the sequence's row of block_tables (int32)
    tokens,  # [BLOCK_N] positions in the sequence
    token_mask,  # [BLOCK_N]: positions to load (the others read as 0)
    kv_head, dims,  # dims: [BLOCK_D] offsets within a head
    head_size, cache_stride_block, cache_stride_head, cache_stride_slot,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    DOT_IN_FP32: tl.constexpr,  # see kernels._triton.dot_in_fp32
):
    """The keys and values of one kv head at `tokens`: [BLOCK_N, BLOCK_D] each."""
    block_ids = tl.load(block_table + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    offsets = (block_ids[:, None] * cache_stride_block + kv_head * cache_stride_head
               + (tokens % BLOCK_SIZE)[:, None] * cache_stride_slot + dims[None, :])
    kv_mask = token_mask[:, None] & (dims < head_size)[None, :]
    k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@jit
def _online_softmax_update(
    q,  # [ROWS, BLOCK_D]: query rows
    k, v,  # [BLOCK_N, BLOCK_D]: a tile of keys and values
    visible,  # [ROWS, BLOCK_N] or [1, BLOCK_N]: which keys each row attends to
    row_max, row_sum,  # [ROWS] fp32: the running max (base 2) and sum of exp2 of the scores
    acc,  # [ROWS, BLOCK_D] fp32: the running unnormalised output
    scale_log2,  # scale * log2(e)
    soft_cap_log2,  # the logit soft cap * log2(e), read when SOFT_CAP
    INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 (tf32 keeps 10 mantissa bits); else None
    SOFT_CAP: tl.constexpr = False,
    MAY_SEE_NOTHING: tl.constexpr = False,  # a row may see no key in its first tiles (a window)
):
    """The running softmax after one more tile: rescaled to the new max, plus the tile's
    share. The new max stays finite as long as each row saw a key in its first tile (a
    later tile may hide all its keys from a row); where it may not (MAY_SEE_NOTHING), a row
    that has seen nothing yet keeps a max of -inf and a sum of 0."""
    scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2  # [ROWS, BLOCK_N]
    if SOFT_CAP:  # cap * tanh(scores / cap), tanh(y) = 1 - 2 / (e^2y + 1), all in base 2
        scores = soft_cap_log2 * (1.0 - 2.0 / (tl.exp2(scores * (2.0 * 1.4426950408889634 / soft_cap_log2)) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    if MAY_SEE_NOTHING:  # exp2(-inf - -inf) would be NaN: rescale by 0 instead
        new_max_or_0 = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - new_max_or_0)
        p = tl.exp2(scores - new_max_or_0[:, None])
    else:
        correction = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(p, 1)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return new_max, row_sum, acc


@jit
def _normalized(acc, row_max, row_sum,  # [ROWS, BLOCK_D], [ROWS], [ROWS] fp32: a finished softmax
                sink_log2,  # [ROWS] fp32: the rows' sink logits * log2(e), read when HAS_SINKS
                HAS_SINKS: tl.constexpr):
    """The output rows: acc over the softmax's denominator, the sink's exp2 in it."""
    if HAS_SINKS:
        new_max = tl.maximum(row_max, sink_log2)
        correction = tl.exp2(row_max - new_max)
        return acc * (correction / (row_sum * correction + tl.exp2(sink_log2 - new_max)))[:, None]
    return acc / row_sum[:, None]


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
    sinks_ptr,  # [num_heads] fp32, read when HAS_SINKS
    scale_log2,  # scale * log2(e)
    soft_cap_log2,  # logits_soft_cap * log2(e), read when SOFT_CAP
    sliding_window,  # keys a query sees, read when SLIDING
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
    SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,  # the variant (see the docstring)
):
    decode = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decode_seqs_ptr + decode)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0  # the splits cover first_key ... seq_len - 1: the window's keys
    if SLIDING:
        first_key = tl.maximum(seq_len - sliding_window, 0)
    start = first_key + split * PARTITION_SIZE
    if start >= seq_len:  # a shorter sequence (or window) than the longest decode's
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
        k, v = _load_kv_tile(key_cache_ptr, value_cache_ptr, block_table, tokens, token_mask, kv_head, dims,
                             head_size, cache_stride_block, cache_stride_head, cache_stride_slot, BLOCK_SIZE,
                             DOT_IN_FP32)
        row_max, row_sum, acc = _online_softmax_update(q, k, v, token_mask[None, :], row_max, row_sum, acc,
                                                       scale_log2, soft_cap_log2, INPUT_PRECISION, SOFT_CAP)

    out = out_ptr + token * out_stride_token + heads[:, None] * out_stride_head + dims[None, :]
    sink_log2 = row_max  # (unread without sinks)
    if HAS_SINKS:
        sink_log2 = tl.load(sinks_ptr + heads, mask=groups < GROUP, other=0.0) * 1.4426950408889634
    if NUM_SPLITS == 1:
        tl.store(out, _normalized(acc, row_max, row_sum, sink_log2, HAS_SINKS).to(out_ptr.dtype.element_ty),
                 mask=head_mask)
    elif seq_len - first_key <= PARTITION_SIZE:
        # the sequence's only split: its output is final, and the reduction skips it (a CUDA
        # graph launches max_model_len's splits, yet a short sequence costs one program)
        tl.store(out, _normalized(acc, row_max, row_sum, sink_log2, HAS_SINKS).to(out_ptr.dtype.element_ty),
                 mask=head_mask)
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
    sinks_ptr,  # [num_heads] fp32, read when HAS_SINKS
    sliding_window,  # read when SLIDING
    out_stride_token, out_stride_head, num_heads, head_size,
    PARTITION_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program per (decode, head): the splits' outputs weighted by their softmax sums,
    rescaled to a common max (the sink's, where it is larger)."""
    decode = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(decode_seqs_ptr + decode)
    num_keys = tl.load(seq_lens_ptr + seq)
    if SLIDING:
        num_keys = tl.minimum(num_keys, sliding_window)
    num_splits = (num_keys + PARTITION_SIZE - 1) // PARTITION_SIZE
    # one split: the decode kernel wrote this sequence's output itself; none: a CUDA graph's
    # dummy sequence (actors/worker/graph_inputs.py), nothing to write
    if num_splits <= 1:
        return
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    rows = (decode.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    maxes = tl.load(partial_max_ptr + rows, mask=split_mask, other=float("-inf"))
    if HAS_SINKS:
        sink_log2 = tl.load(sinks_ptr + head) * 1.4426950408889634
        common_max = tl.maximum(tl.max(maxes, 0), sink_log2)
        weights = tl.load(partial_sum_ptr + rows, mask=split_mask, other=0.0) * tl.exp2(maxes - common_max)
        weights = weights / (tl.sum(weights, 0) + tl.exp2(sink_log2 - common_max))
    else:
        weights = tl.load(partial_sum_ptr + rows, mask=split_mask, other=0.0) * tl.exp2(maxes - tl.max(maxes, 0))
        # normalised first, so that the weights sum to 1 as exactly as they can
        weights = weights / tl.sum(weights, 0)
    partial = tl.load(partial_out_ptr + rows[:, None] * head_size + dims[None, :],
                      mask=split_mask[:, None] & (dims < head_size)[None, :], other=0.0)
    out = tl.sum(partial * weights[:, None], 0)
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
    sinks_ptr,  # [num_heads] fp32, read when HAS_SINKS
    scale_log2,  # scale * log2(e)
    soft_cap_log2,  # logits_soft_cap * log2(e), read when SOFT_CAP
    sliding_window,  # keys a query sees, read when SLIDING
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
    SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,  # the variant (see the docstring)
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
    # keys up to this tile's last query; the first tile holds key 0, which every row sees (with a
    # window: from the first row's window's first key, which later rows may not see)
    end = tl.minimum(seq_len, seq_len - query_len + (query_tile + 1) * BLOCK_M)
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(seq_len - query_len + query_tile * BLOCK_M - sliding_window + 1, 0)
    for tile_start in range(first_key, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k, v = _load_kv_tile(key_cache_ptr, value_cache_ptr, block_table, tokens, token_mask, kv_head, dims,
                             head_size, cache_stride_block, cache_stride_head, cache_stride_slot, BLOCK_SIZE,
                             DOT_IN_FP32)
        visible = token_mask[None, :] & (tokens[None, :] <= positions[:, None])  # causal on positions
        if SLIDING:
            visible = visible & (tokens[None, :] > positions[:, None] - sliding_window)
        row_max, row_sum, acc = _online_softmax_update(q, k, v, visible, row_max, row_sum, acc, scale_log2,
                                                       soft_cap_log2, INPUT_PRECISION, SOFT_CAP, SLIDING)
    sink_log2 = row_max  # (unread without sinks)
    if HAS_SINKS:
        sink_log2 = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head) * 1.4426950408889634
    out = out_ptr + tokens_of_rows[:, None] * out_stride_token + head * out_stride_head + dims[None, :]
    tl.store(out, _normalized(acc, row_max, row_sum, sink_log2, HAS_SINKS).to(out_ptr.dtype.element_ty),
             mask=query_mask)
