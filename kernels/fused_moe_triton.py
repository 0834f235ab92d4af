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
   from the same x tile (two accumulators, one pass over x), then the biases and the
   activation (silu(gate) * up, or GPT-OSS's clamped "swigluoai" over interleaved rows) fused
   in the epilogue, stored in x's dtype into h [num_slots, I] at each slot's row: no [.., 2I]
   tensor and no second launch for the activation.
3. _moe_down_kernel: h's rows by the expert's down projection, plus its bias, times the slot's
   top-k weight in the epilogue, into an fp32 [num_slots, hidden] buffer at the slot's row.
4. The combine: that buffer viewed [num_tokens, top_k, hidden] and summed over k (torch), in
   fp32, then cast: every element has one writer, so no atomics and the same result run to
   run (a scatter-add of the k terms would add them in whatever order the blocks finish).

MXFP4 weights (fused_experts_mxfp4; the layout in kernels/mxfp4.py): both kernels load each
k tile's packed bytes and E8M0 scales and decode them to float in registers (_mxfp4_tile),
then multiply in x's dtype with fp32 accumulation. A byte holds elements 2j and 2j + 1, so a
tile's low nibbles multiply x's even columns and its high nibbles the odd ones: two dots of
BLOCK_K / 2 instead of one interleaved tile. The variants (MXFP4, HAS_BIAS, SWIGLUOAI) are
constexpr: the float SiLU kernel compiles as it did without them.

CUDA graphs: no .item() and no shape that depends on the routing. The sorted list holds at
most num_slots + num_experts * (BLOCK_M - 1) rows (each expert pads fewer than BLOCK_M), so
the grids are sized by that bound and blocks past num_tokens_post_padded return at once.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, dot_in_fp32, dot_precision, jit, next_power_of_2, tl
from kernels.fused_moe_ref import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT


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
def _e2m1_to_float(code):
    """FP4 E2M1 codes (int32, 0..15) as float32: a normal code's exponent (bias 1) rebased to
    float32's (bias 127) in its bits, the subnormal code 1 as 0.5; bit 3 the sign."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@jit
def _mxfp4_tile(blocks_ptr, scales_ptr, rows, j, mask, row_stride, scale_row_stride):
    """Bytes j [BLOCK_K // 2] of the weight rows [BLOCK_N] (kernels/mxfp4.py's layout) as two
    float32 [BLOCK_K // 2, BLOCK_N] tiles: the elements k = 2j (low nibbles), k = 2j + 1 (high).
    Byte j's scale is the one of group 2j // 32 = j // 16, loaded once per byte (the repeated
    addresses hit the cache). Masked bytes and scales read 0, so their weights are 0, not NaN."""
    rows = rows[None, :].to(tl.int64)
    packed = tl.load(blocks_ptr + rows * row_stride + j[:, None], mask=mask, other=0).to(tl.int32)
    exponent = tl.load(scales_ptr + rows * scale_row_stride + (j // 16)[:, None], mask=mask, other=0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)  # E8M0 2^(e - 127): the float32 exponent field
    return _e2m1_to_float(packed & 15) * scale, _e2m1_to_float(packed >> 4) * scale


@jit
def _dot(a, b, acc, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + a @ b in float32, b (dequantized float32 weights) cast to a's dtype first: bf16
    holds every MXFP4 value exactly. The interpreter upcasts both instead (dot_in_fp32)."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b, input_precision=INPUT_PRECISION)
    return acc + tl.dot(a, b.to(a.dtype), input_precision=INPUT_PRECISION)


@jit
def _moe_gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w13_ptr,  # [num_experts, 2 * intermediate, hidden], or MXFP4 blocks uint8 [.., hidden // 2]
    w13_scales_ptr,  # MXFP4: uint8 [num_experts, 2 * intermediate, hidden // 32]; else unused
    w13_bias_ptr,  # HAS_BIAS: [num_experts, 2 * intermediate]; else unused
    h_ptr,  # [num_slots, intermediate]: the activation's output, x's dtype
    sorted_token_ids_ptr, expert_ids_ptr, num_post_padded_ptr,  # moe_align_block_size's
    num_slots, top_k, hidden, intermediate,
    x_stride, w_expert_stride, w_row_stride, scale_expert_stride, scale_row_stride, bias_expert_stride, h_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
    SWIGLUOAI: tl.constexpr, SWIGLUOAI_ALPHA: tl.constexpr, SWIGLUOAI_LIMIT: tl.constexpr,
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
        if SWIGLUOAI:  # GPT-OSS's rows as its checkpoint stores them: gate i at 2i, up i at 2i + 1
            gate_rows = 2 * n
            up_rows = 2 * n + 1
        else:
            gate_rows = n
            up_rows = intermediate + n
        w_expert = w13_ptr + expert * w_expert_stride
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            if MXFP4:
                # the dot's k order is free: the even k of x times the low nibbles plus the odd k
                # times the high ones, so no tile is ever interleaved
                j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns
                j_mask = j < hidden // 2
                x_mask = m_mask[:, None] & j_mask[None, :]
                x_even = tl.load(x_ptr + token[:, None] * x_stride + 2 * j[None, :], mask=x_mask, other=0.0)
                x_odd = tl.load(x_ptr + token[:, None] * x_stride + 2 * j[None, :] + 1, mask=x_mask, other=0.0)
                w_mask = n_mask[None, :] & j_mask[:, None]
                s_expert = w13_scales_ptr + expert * scale_expert_stride
                gate_even, gate_odd = _mxfp4_tile(w_expert, s_expert, gate_rows, j, w_mask, w_row_stride,
                                                  scale_row_stride)
                up_even, up_odd = _mxfp4_tile(w_expert, s_expert, up_rows, j, w_mask, w_row_stride, scale_row_stride)
                gate = _dot(x_odd, gate_odd, _dot(x_even, gate_even, gate, UPCAST, INPUT_PRECISION), UPCAST,
                            INPUT_PRECISION)
                up = _dot(x_odd, up_odd, _dot(x_even, up_even, up, UPCAST, INPUT_PRECISION), UPCAST,
                          INPUT_PRECISION)
            else:
                k = k0 + tl.arange(0, BLOCK_K)
                k_mask = k < hidden
                xs = tl.load(x_ptr + token[:, None] * x_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                             other=0.0)
                w_mask = n_mask[None, :] & k_mask[:, None]
                w_gate = tl.load(w_expert + gate_rows[None, :].to(tl.int64) * w_row_stride + k[:, None], mask=w_mask,
                                 other=0.0)  # [BLOCK_K, BLOCK_N]
                w_up = tl.load(w_expert + up_rows[None, :].to(tl.int64) * w_row_stride + k[:, None],
                               mask=w_mask, other=0.0)
                if UPCAST:
                    xs, w_gate, w_up = xs.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
                gate += tl.dot(xs, w_gate, input_precision=INPUT_PRECISION)
                up += tl.dot(xs, w_up, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            bias = w13_bias_ptr + expert * bias_expert_stride
            gate += tl.load(bias + gate_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias + up_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SWIGLUOAI:  # kernels/fused_moe_ref.py's _swigluoai_and_mul
            gate = tl.minimum(gate, SWIGLUOAI_LIMIT)
            up = tl.minimum(tl.maximum(up, -SWIGLUOAI_LIMIT), SWIGLUOAI_LIMIT)
            h = (up + 1.0) * gate / (1.0 + tl.exp(-SWIGLUOAI_ALPHA * gate))
        else:
            h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + slots[:, None].to(tl.int64) * h_stride + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


@jit
def _moe_down_kernel(
    h_ptr,  # [num_slots, intermediate]
    w2_ptr,  # [num_experts, hidden, intermediate], or MXFP4 blocks uint8 [.., intermediate // 2]
    w2_scales_ptr,  # MXFP4: uint8 [num_experts, hidden, intermediate // 32]; else unused
    w2_bias_ptr,  # HAS_BIAS: [num_experts, hidden]; else unused
    out_ptr,  # [num_slots, hidden] float32: each slot's weighted expert output
    topk_weights_ptr,  # [num_slots] float32
    sorted_token_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_slots, hidden, intermediate,
    h_stride, w_expert_stride, w_row_stride, scale_expert_stride, scale_row_stride, bias_expert_stride, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
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
            if MXFP4:  # as in the gate/up kernel: even k by low nibbles, odd k by high ones
                j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                j_mask = j < intermediate // 2
                h_mask = m_mask[:, None] & j_mask[None, :]
                h_even = tl.load(h_ptr + rows[:, None] * h_stride + 2 * j[None, :], mask=h_mask, other=0.0)
                h_odd = tl.load(h_ptr + rows[:, None] * h_stride + 2 * j[None, :] + 1, mask=h_mask, other=0.0)
                w_even, w_odd = _mxfp4_tile(w_expert, w2_scales_ptr + expert * scale_expert_stride, n, j,
                                            n_mask[None, :] & j_mask[:, None], w_row_stride, scale_row_stride)
                acc = _dot(h_odd, w_odd, _dot(h_even, w_even, acc, UPCAST, INPUT_PRECISION), UPCAST,
                           INPUT_PRECISION)
            else:
                k = k0 + tl.arange(0, BLOCK_K)
                k_mask = k < intermediate
                hs = tl.load(h_ptr + rows[:, None] * h_stride + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                             other=0.0)
                w = tl.load(w_expert + n[None, :].to(tl.int64) * w_row_stride + k[:, None],
                            mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
                if UPCAST:
                    hs, w = hs.to(tl.float32), w.to(tl.float32)
                acc += tl.dot(hs, w, input_precision=INPUT_PRECISION)
        if HAS_BIAS:  # before the top-k weight, as Hugging Face's GptOssExperts adds it
            bias = tl.load(w2_bias_ptr + expert * bias_expert_stride + n, mask=n_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        weight = tl.load(topk_weights_ptr + rows, mask=m_mask, other=0.0)
        tl.store(out_ptr + rows[:, None] * out_stride + n[None, :], acc * weight[:, None],
                 mask=m_mask[:, None] & n_mask[None, :])


def choose_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's smallest) while an expert averages few rows (decode:
    padding to 64 would multiply mostly zeros), 64 once the average fills such blocks."""
    return 64 if num_slots >= 64 * num_experts else 16


def fused_experts(x: torch.Tensor,  # [num_tokens, hidden]
                  w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: rows in the activation's order
                  w2: torch.Tensor,  # [num_experts, hidden, intermediate]
                  topk_weights: torch.Tensor,  # [num_tokens, top_k]
                  topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64; -1: on another rank
                  activation: str = "silu",  # or "swigluoai" (fused_moe_ref's docstring)
                  block_m: int | None = None,
                  *,
                  w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate], float
                  w2_bias: torch.Tensor | None = None,  # [num_experts, hidden], float
                  ) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """fused_experts_ref's result, in two kernel launches plus torch's sort and sum."""
    num_experts, two_i, _ = w13.shape
    assert w13.shape[2] == x.shape[1] and w2.shape == (num_experts, x.shape[1], two_i // 2)
    assert x.dtype == w13.dtype == w2.dtype
    return _launch(x, (w13, None), (w2, None), topk_weights, topk_ids, activation, block_m, w13_bias, w2_bias)


def fused_experts_mxfp4(x: torch.Tensor,  # [num_tokens, hidden], hidden a multiple of 32
                        w13_blocks: torch.Tensor,  # uint8 [num_experts, 2 * intermediate, hidden // 2]
                        w13_scales: torch.Tensor,  # uint8 [num_experts, 2 * intermediate, hidden // 32]
                        w2_blocks: torch.Tensor,  # uint8 [num_experts, hidden, intermediate // 2]
                        w2_scales: torch.Tensor,  # uint8 [num_experts, hidden, intermediate // 32]
                        topk_weights: torch.Tensor,  # [num_tokens, top_k]
                        topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64; -1: on another rank
                        activation: str = "swigluoai",
                        block_m: int | None = None,
                        *,
                        w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate], float
                        w2_bias: torch.Tensor | None = None,  # [num_experts, hidden], float
                        ) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """kernels/mxfp4.py's fused_experts_mxfp4_ref: the MXFP4 weights (that module's layout; a
    GPT-OSS checkpoint's *_blocks flattened over their last two dimensions) dequantized in
    registers, tile by tile, inside both GEMMs' k loops; never in memory."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13_blocks.shape
    intermediate = two_i // 2
    if hidden % 32 or intermediate % 32:
        raise ValueError(f"MXFP4 experts need hidden ({hidden}) and intermediate ({intermediate}) "
                         "to be multiples of 32, the scales' group size")
    assert w13_blocks.shape == (num_experts, two_i, hidden // 2)
    assert w13_scales.shape == (num_experts, two_i, hidden // 32)
    assert w2_blocks.shape == (num_experts, hidden, intermediate // 2)
    assert w2_scales.shape == (num_experts, hidden, intermediate // 32)
    assert all(t.dtype == torch.uint8 and t.stride(2) == 1 for t in (w13_blocks, w13_scales, w2_blocks, w2_scales))
    return _launch(x, (w13_blocks, w13_scales), (w2_blocks, w2_scales), topk_weights, topk_ids, activation, block_m,
                   w13_bias, w2_bias)


def _launch(x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor | None],
            w2: tuple[torch.Tensor, torch.Tensor | None],  # (weights or MXFP4 blocks, None or scales)
            topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str, block_m: int | None,
            w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> torch.Tensor:
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"activation {activation!r}: the Triton kernel has 'silu' and 'swigluoai'")
    (w13, w13_scales), (w2, w2_scales) = w13, w2
    mxfp4 = w13_scales is not None
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    assert (w13_bias is None) == (w2_bias is None), "both biases or neither"
    if w13_bias is not None:
        assert w13_bias.shape == (num_experts, two_i) and w2_bias.shape == (num_experts, hidden)
        assert w13_bias.stride(1) == 1 and w2_bias.stride(1) == 1
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
    meta = dict(BLOCK_M=block_m, UPCAST=dot_in_fp32(x.dtype, x.device), INPUT_PRECISION=dot_precision(x.dtype),
                MXFP4=mxfp4, HAS_BIAS=w13_bias is not None)
    # an MXFP4 tile is BLOCK_K // 2 bytes a row, and tl.dot needs 16 of them
    min_block_k = 32 if mxfp4 else 16
    # the pointers a variant does not read (no scales, no biases) get some tensor all the same
    w13_scales, w2_scales = (w13_scales, w2_scales) if mxfp4 else (w13, w2)
    w13_bias, w2_bias = (w13_bias, w2_bias) if meta["HAS_BIAS"] else (x, x)
    block_n = max(16, min(64, next_power_of_2(intermediate)))
    _moe_gate_up_kernel[(num_blocks, cdiv(intermediate, block_n))](
        x, w13, w13_scales, w13_bias, h, sorted_token_ids, expert_ids, num_post_padded, num_slots, top_k, hidden,
        intermediate, x.stride(0), w13.stride(0), w13.stride(1), w13_scales.stride(0), w13_scales.stride(1),
        w13_bias.stride(0), h.stride(0), BLOCK_N=block_n, BLOCK_K=max(min_block_k, min(64, next_power_of_2(hidden))),
        SWIGLUOAI=activation == "swigluoai", SWIGLUOAI_ALPHA=SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT=SWIGLUOAI_LIMIT,
        **meta)
    block_n = max(16, min(64, next_power_of_2(hidden)))
    _moe_down_kernel[(num_blocks, cdiv(hidden, block_n))](
        h, w2, w2_scales, w2_bias, per_slot, weights, sorted_token_ids, expert_ids, num_post_padded, num_slots,
        hidden, intermediate, h.stride(0), w2.stride(0), w2.stride(1), w2_scales.stride(0), w2_scales.stride(1),
        w2_bias.stride(0), per_slot.stride(0),
        BLOCK_N=block_n, BLOCK_K=max(min_block_k, min(64, next_power_of_2(intermediate))), **meta)
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
