"""The segmented multi-LoRA shrink and expand of kernels/lora_ref.py as Triton kernels, for
CUDA (the Punica/S-LoRA way, the shapes vLLM's lora_shrink/lora_expand take): the batch's
tokens come grouped by adapter, so each program multiplies one tile of one segment's
tokens by that segment's adapter, and a step mixing adapters costs one launch per
operation whatever the number of adapters. Base-model tokens are in no segment and no
program touches them.

- shrink: t[rows, :slot_rows[s]] = x[rows] · a[s]ᵀ. A decode step has few tokens per
  segment and a long reduction (the hidden size) into few columns (the rank), so the
  reduction can be split over split_k programs that each add a partial sum into an fp32
  scratch; the launcher then writes the sum into t.
- expand: y[rows, cols] += t[rows, col_offset[s]:+rank[s]] · b[s, cols, :rank[s]]ᵀ for one
  module's output columns. Segments never overlap, so each element of y has one writer
  and a plain load-add-store is enough.

Layouts, shapes and the meaning of each argument are kernels/lora_ref.py's; the tests
(tests/kernels/test_lora_kernels.py) compare the two, under triton's interpreter on a CPU."""

from __future__ import annotations

import torch

from kernels._triton import cdiv, dot_in_fp32, dot_precision, jit, next_power_of_2, tl

_BLOCK_M = 16  # tokens per program (tl.dot's smallest tile)


@jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr,  # x [tokens, in], a [slots, group_rows, in], out: t or the split-K scratch
    seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rows_ptr,
    in_features, x_stride, a_slot_stride, a_row_stride, out_stride,
    split_k, k_per_split,  # programs sharing a tile's reduction, in_features columns each (BLOCK_K multiples)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, ATOMIC: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    m_tile = tl.program_id(1) // split_k
    split = tl.program_id(1) % split_k
    n_tile = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + segment).to(tl.int64)
    rows = tl.load(slot_rows_ptr + slot)
    length = tl.load(seg_len_ptr + segment)
    if n_tile * BLOCK_N < rows and m_tile * BLOCK_M < length:
        start = tl.load(seg_start_ptr + segment).to(tl.int64)
        m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = m < length
        n_mask = n < rows
        token = start + m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, in_features)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_end
            xs = tl.load(x_ptr + token[:, None] * x_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            a_t = tl.load(a_ptr + slot * a_slot_stride + n[None, :] * a_row_stride + k[:, None],
                          mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST:
                xs, a_t = xs.to(tl.float32), a_t.to(tl.float32)
            acc += tl.dot(xs, a_t, input_precision=INPUT_PRECISION)
        out = out_ptr + token[:, None] * out_stride + n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(out, acc, mask=mask)
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _lora_expand_kernel(
    t_ptr, b_ptr, y_ptr,  # t [tokens, group_rows], b [slots, group_out, max_rank], y [tokens, group_out]
    seg_start_ptr, seg_len_ptr, seg_slot_ptr, col_offset_ptr, rank_ptr,
    out_offset, out_size, t_stride, b_slot_stride, b_row_stride, y_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    m_tile = tl.program_id(1)
    n_tile = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + segment).to(tl.int64)
    rank = tl.load(rank_ptr + slot)
    length = tl.load(seg_len_ptr + segment)
    if rank > 0 and m_tile * BLOCK_M < length:
        start = tl.load(seg_start_ptr + segment).to(tl.int64)
        col_offset = tl.load(col_offset_ptr + slot)
        m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = m < length
        n_mask = n < out_size
        token = start + m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, rank, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < rank
            ts = tl.load(t_ptr + token[:, None] * t_stride + col_offset + k[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b_t = tl.load(b_ptr + slot * b_slot_stride + (out_offset + n[None, :]) * b_row_stride + k[:, None],
                          mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST:
                ts, b_t = ts.to(tl.float32), b_t.to(tl.float32)
            acc += tl.dot(ts, b_t, input_precision=INPUT_PRECISION)
        y = y_ptr + token[:, None] * y_stride + out_offset + n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        # the base output and the delta are added in fp32, rounded once, as addmm_ does
        total = tl.load(y, mask=mask, other=0.0).to(tl.float32) + acc
        tl.store(y, total.to(y_ptr.dtype.element_ty), mask=mask)


def _check_segments(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        assert tensor.dtype == torch.int32 and tensor.is_contiguous(), "segment and slot tables are contiguous int32"


def lora_shrink(x: torch.Tensor, a: torch.Tensor, t: torch.Tensor,
                seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor,
                slot_rows: torch.Tensor, max_seg_len: int, split_k: int | None = None) -> None:
    """lora_shrink_reference's result into t; max_seg_len: the longest segment (sizes the
    grid); split_k: programs sharing each tile's reduction (None: chosen by shape)."""
    _check_segments(seg_start, seg_len, seg_slot, slot_rows)
    assert x.stride(1) == 1 and a.stride(2) == 1 and t.stride(1) == 1 and a.shape[2] == x.shape[1]
    num_segments, in_features, group_rows = seg_start.shape[0], x.shape[1], a.shape[1]
    if num_segments == 0 or max_seg_len == 0 or group_rows == 0:
        return
    block_n = max(16, min(64, next_power_of_2(group_rows)))
    block_k = max(16, min(128, next_power_of_2(in_features)))
    if split_k is None:
        # few token tiles and a long reduction: spread the reduction over more programs
        split_k = max(1, min(8, in_features // 512)) if max_seg_len <= _BLOCK_M else 1
    split_k = max(1, min(split_k, cdiv(in_features, block_k)))
    k_per_split = cdiv(cdiv(in_features, split_k), block_k) * block_k
    split_k = cdiv(in_features, k_per_split)
    grid = (num_segments, cdiv(max_seg_len, _BLOCK_M) * split_k, cdiv(group_rows, block_n))
    meta = dict(BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=dot_in_fp32(x.dtype, x.device),
                INPUT_PRECISION=dot_precision(x.dtype))
    if split_k == 1:
        _lora_shrink_kernel[grid](x, a, t, seg_start, seg_len, seg_slot, slot_rows, in_features, x.stride(0),
                                  a.stride(0), a.stride(1), t.stride(0), 1, k_per_split, ATOMIC=False, **meta)
        return
    # partial sums land in an fp32 scratch over all rows (zero where no segment is), summed into t:
    # rows of base-model tokens and columns past a slot's rows then hold zeros, which nothing reads
    scratch = torch.zeros(x.shape[0], group_rows, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[grid](x, a, scratch, seg_start, seg_len, seg_slot, slot_rows, in_features, x.stride(0),
                              a.stride(0), a.stride(1), scratch.stride(0), split_k, k_per_split, ATOMIC=True, **meta)
    t.copy_(scratch)


def lora_expand(t: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
                seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor,
                col_offset: torch.Tensor, rank: torch.Tensor, out_offset: int, out_size: int,
                max_seg_len: int) -> None:
    """lora_expand_reference's addition into y's columns [out_offset, out_offset + out_size)."""
    _check_segments(seg_start, seg_len, seg_slot, col_offset, rank)
    assert t.stride(1) == 1 and b.stride(2) == 1 and y.stride(1) == 1
    num_segments = seg_start.shape[0]
    if num_segments == 0 or max_seg_len == 0 or out_size == 0:
        return
    block_n = max(16, min(128, next_power_of_2(out_size)))
    block_k = max(16, min(64, next_power_of_2(b.shape[2])))
    grid = (num_segments, cdiv(max_seg_len, _BLOCK_M), cdiv(out_size, block_n))
    _lora_expand_kernel[grid](
        t, b, y, seg_start, seg_len, seg_slot, col_offset, rank, out_offset, out_size,
        t.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=dot_in_fp32(t.dtype, t.device),
        INPUT_PRECISION=dot_precision(t.dtype))
