"""Fused mixture-of-experts for CUDA in Triton (vLLM's fused_moe shape of it): the tokens'
(token, expert) pairs sorted by expert and padded to whole blocks of BLOCK_M rows, so each
program multiplies one block of one expert's rows by that expert's weights, and a step costs
two launches whatever the routing. Semantics, layouts and the oracle: kernels/fused_moe_ref.py.

1. moe_align_block_size (torch ops, no host sync): a "slot" is a (token, k) pair, numbered
   token * top_k + k. sorted_token_ids lists the slots expert by expert (in slot order within
   one), each expert's run padded with the sentinel num_slots to a multiple of BLOCK_M;
   expert_ids gives each block's expert; num_tokens_post_padded the padded total, read by the
   kernels on the device. An expert no token picked gets no block at all; slots of id -1 (an
   expert on another rank) none either, and add nothing.
2. _moe_gate_up_kernel: for a block of slots and BLOCK_N intermediate columns, gate and up
   from the same x tile (two accumulators, one pass over x), then silu(gate) * up fused in the
   epilogue, stored in x's dtype into h [num_slots, I] at each slot's row: no [.., 2I] tensor
   and no second launch for the activation.
3. _moe_down_kernel: h's rows by the expert's down projection, times the slot's top-k weight
   in the epilogue, into an fp32 [num_slots, hidden] buffer at the slot's row.
4. The combine: that buffer viewed [num_tokens, top_k, hidden] and summed over k (torch), in
   fp32, then cast: every element has one writer, so no atomics and the same result run to
   run (a scatter-add of the k terms would add them in whatever order the blocks finish).

CUDA graphs: no .item() and no shape that depends on the routing. The sorted list holds at
most num_slots + num_experts * (BLOCK_M - 1) rows (each expert pads fewer than BLOCK_M), so
the grids are sized by that bound and blocks past num_tokens_post_padded return at once.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, dot_in_fp32, dot_precision, jit, next_power_of_2, tl


def moe_align_block_size(topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64
                         block_m: int, num_experts: int,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [num_slots + E * (block_m - 1)] int32, expert_ids [that / block_m,
    rounded up] int32 (-1 for blocks past the end), num_tokens_post_padded [1] int32); see
    the module's docstring. Sizes depend on the shapes only, never on the routing."""
    device = topk_ids.device
    # an id of -1 (an expert on another rank) goes to bucket num_experts, last and unpadded:
    # its slots sit past num_tokens_post_padded, where no block is run
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)
    num_slots = flat.numel()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync for its size
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = counts[num_experts]
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices  # slots expert by expert, in slot order within one
    expert_of = flat[order]
    destination = padded_start[expert_of] + torch.arange(num_slots, device=device) - start[expert_of]
    max_padded = num_slots + num_experts * (block_m - 1)
    sorted_token_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, destination, order.to(torch.int32))
    block_start = torch.arange(cdiv(max_padded, block_m), device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)  # first bucket ending past it
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, padded_end[num_experts - 1:num_experts].to(torch.int32)


@jit
def _block_expert(expert_ids_ptr, num_post_padded_ptr, block, BLOCK_M: tl.constexpr):
    """The expert of this block of sorted rows (int64), or -1 past the padded total."""
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    return tl.where(block * BLOCK_M < tl.load(num_post_padded_ptr), expert, -1)


@jit
def _moe_gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w13_ptr,  # [num_experts, 2 * intermediate, hidden]
    h_ptr,  # [num_slots, intermediate]: silu(gate) * up, x's dtype
    sorted_token_ids_ptr, expert_ids_ptr, num_post_padded_ptr,  # moe_align_block_size's
    num_slots, top_k, hidden, intermediate,
    x_stride, w_expert_stride, w_row_stride, h_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    expert = _block_expert(expert_ids_ptr, num_post_padded_ptr, block, BLOCK_M)
    if expert >= 0:
        slots = tl.load(sorted_token_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = slots < num_slots
        token = (slots // top_k).to(tl.int64)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < intermediate
        w_expert = w13_ptr + expert * w_expert_stride
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < hidden
            xs = tl.load(x_ptr + token[:, None] * x_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            w_mask = n_mask[None, :] & k_mask[:, None]
            w_gate = tl.load(w_expert + n[None, :].to(tl.int64) * w_row_stride + k[:, None], mask=w_mask,
                             other=0.0)  # [BLOCK_K, BLOCK_N]
            w_up = tl.load(w_expert + (intermediate + n[None, :]).to(tl.int64) * w_row_stride + k[:, None],
                           mask=w_mask, other=0.0)
            if UPCAST:
                xs, w_gate, w_up = xs.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            gate += tl.dot(xs, w_gate, input_precision=INPUT_PRECISION)
            up += tl.dot(xs, w_up, input_precision=INPUT_PRECISION)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + slots[:, None].to(tl.int64) * h_stride + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


@jit
def _moe_down_kernel(
    h_ptr,  # [num_slots, intermediate]
    w2_ptr,  # [num_experts, hidden, intermediate]
    out_ptr,  # [num_slots, hidden] float32: each slot's weighted expert output
    topk_weights_ptr,  # [num_slots] float32
    sorted_token_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_slots, hidden, intermediate,
    h_stride, w_expert_stride, w_row_stride, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    expert = _block_expert(expert_ids_ptr, num_post_padded_ptr, block, BLOCK_M)
    if expert >= 0:
        slots = tl.load(sorted_token_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = slots < num_slots
        rows = slots.to(tl.int64)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < hidden
        w_expert = w2_ptr + expert * w_expert_stride
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, intermediate, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < intermediate
            hs = tl.load(h_ptr + rows[:, None] * h_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            w = tl.load(w_expert + n[None, :].to(tl.int64) * w_row_stride + k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST:
                hs, w = hs.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(hs, w, input_precision=INPUT_PRECISION)
        weight = tl.load(topk_weights_ptr + rows, mask=m_mask, other=0.0)
        tl.store(out_ptr + rows[:, None] * out_stride + n[None, :], acc * weight[:, None],
                 mask=m_mask[:, None] & n_mask[None, :])


def choose_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's smallest) while an expert averages few rows (decode:
    padding to 64 would multiply mostly zeros), 64 once the average fills such blocks."""
    return 64 if num_slots >= 64 * num_experts else 16


def fused_experts(x: torch.Tensor,  # [num_tokens, hidden]
                  w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
                  w2: torch.Tensor,  # [num_experts, hidden, intermediate]
                  topk_weights: torch.Tensor,  # [num_tokens, top_k]
                  topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64; -1: on another rank
                  activation: str = "silu",
                  block_m: int | None = None,
                  ) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """fused_experts_ref's result, in two kernel launches plus torch's sort and sum."""
    if activation != "silu":
        raise ValueError(f"activation {activation!r}: the Triton kernel has only 'silu'")
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, intermediate)
    assert x.dtype == w13.dtype == w2.dtype and x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    block_m = block_m or choose_block_m(num_slots, num_experts)
    sorted_token_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, block_m, num_experts)
    num_blocks = expert_ids.shape[0]
    weights = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(num_slots, intermediate, dtype=x.dtype, device=x.device)
    # zeros: the rows of slots whose expert is on another rank (id -1) are never written
    per_slot = torch.zeros(num_slots, hidden, dtype=torch.float32, device=x.device)
    meta = dict(BLOCK_M=block_m, UPCAST=dot_in_fp32(x.dtype, x.device), INPUT_PRECISION=dot_precision(x.dtype))
    block_n = max(16, min(64, next_power_of_2(intermediate)))
    _moe_gate_up_kernel[(num_blocks, cdiv(intermediate, block_n))](
        x, w13, h, sorted_token_ids, expert_ids, num_post_padded, num_slots, top_k, hidden, intermediate,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_N=block_n, BLOCK_K=max(16, min(64, next_power_of_2(hidden))), **meta)
    block_n = max(16, min(64, next_power_of_2(hidden)))
    _moe_down_kernel[(num_blocks, cdiv(hidden, block_n))](
        h, w2, per_slot, weights, sorted_token_ids, expert_ids, num_post_padded, num_slots, hidden, intermediate,
        h.stride(0), w2.stride(0), w2.stride(1), per_slot.stride(0),
        BLOCK_N=block_n, BLOCK_K=max(16, min(64, next_power_of_2(intermediate))), **meta)
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
