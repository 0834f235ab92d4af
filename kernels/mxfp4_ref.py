"""MXFP4 weights and GPT-OSS's experts in plain torch: the oracle of kernels/moe_mxfp4.cpp,
and the path of any device without it.

MXFP4 as GPT-OSS checkpoints store it (OCP microscaling; Hugging Face's
integrations/mxfp4.py reads the same bytes):
- blocks [..., rows, in / 32, 16] uint8: each byte two FP4 E2M1 values, the low nibble the
  even column, the high nibble the odd one; a nibble is sign (bit 3) and one of
  kernels/mxfp4.py's FP4_VALUES' eight magnitudes;
- scales [..., rows, in / 32] uint8: E8M0, the block of 32 columns times 2 ** (scale - 127).

GPT-OSS's experts (Hugging Face's GptOssExperts, rows as the checkpoint's blocks hold them):
- w13 [E, 2I, H]: the fused gate_up_proj, gate and up interleaved (row 2j gate j, row 2j+1
  up j), with its bias b13 [E, 2I];
- w2 [E, H, I]: down_proj, with b2 [E, H];
- act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
Hugging Face's own parameters are these transposed ([E, H, 2I] and [E, I, H]).
"""

from __future__ import annotations

import torch

from kernels.fused_moe_ref import clamped_swiglu
from kernels.mxfp4 import GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4

BLOCK = GROUP_SIZE  # values per scale


def mxfp4_dequantize(blocks: torch.Tensor,  # [..., rows, in / 32, 16] uint8
                     scales: torch.Tensor,  # [..., rows, in / 32] uint8
                     ) -> torch.Tensor:  # [..., rows, in] float32
    """kernels/mxfp4.py's dequantizer on the checkpoint's block shape."""
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape[:-1] == scales.shape
    return dequantize_mxfp4(blocks.flatten(-2), scales)


def mxfp4_quantize(weight: torch.Tensor,  # [..., rows, in] float, in a multiple of 32
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # (blocks, scales) as mxfp4_dequantize reads them
    """kernels/mxfp4.py's quantizer, its blocks in the checkpoint's shape. For tests: a
    checkpoint in GPT-OSS's format from random weights."""
    blocks, scales = quantize_mxfp4(weight)
    return blocks.unflatten(-1, (-1, 16)).contiguous(), scales


def route_gpt_oss(router_logits: torch.Tensor,  # [num_tokens, num_experts] (the router's bias added)
                  top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [num_tokens, top_k] float32, topk_ids int32): the top_k logits, softmax
    over them alone (Hugging Face's GptOssTopKRouter, in its order of operations)."""
    top_logits, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1), topk_ids.to(torch.int32)


def gpt_oss_experts_ref(x: torch.Tensor,  # [num_tokens, hidden]
                        w13: torch.Tensor,  # [E, 2I, H] float (mxfp4_dequantize's, or a float checkpoint's)
                        b13: torch.Tensor,  # [E, 2I]
                        w2: torch.Tensor,  # [E, H, I]
                        b2: torch.Tensor,  # [E, H]
                        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
                        topk_ids: torch.Tensor,  # [num_tokens, top_k]; -1: an expert held elsewhere
                        alpha: float, limit: float) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """sum_k weight_k * (act(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]), e = topk_ids[:, k],
    one expert at a time (in float32)."""
    return _routed_experts(x, lambda e: (w13[e], b13[e], w2[e], b2[e]), topk_weights, topk_ids, alpha, limit)


def mxfp4_experts_ref(x: torch.Tensor,  # [num_tokens, hidden]
                      w13_blocks: torch.Tensor, w13_scales: torch.Tensor,  # [E, 2I, H / 32, 16], [E, 2I, H / 32]
                      b13: torch.Tensor,  # [E, 2I]
                      w2_blocks: torch.Tensor, w2_scales: torch.Tensor,  # [E, H, I / 32, 16], [E, H, I / 32]
                      b2: torch.Tensor,  # [E, H]
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt_oss_experts_ref on MXFP4 weights, each routed expert dequantized as it runs (a
    decode step's few experts, never the whole layer)."""
    def expert(e: int) -> tuple[torch.Tensor, ...]:
        return mxfp4_dequantize(w13_blocks[e], w13_scales[e]), b13[e], mxfp4_dequantize(w2_blocks[e], w2_scales[e]), b2[e]

    return _routed_experts(x, expert, topk_weights, topk_ids, alpha, limit)


def _routed_experts(x: torch.Tensor, expert, topk_weights: torch.Tensor, topk_ids: torch.Tensor, alpha: float,
                    limit: float) -> torch.Tensor:
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        w13, b13, w2, b2 = expert(e)
        tokens, slot = torch.where(topk_ids == e)
        gate_up = xf[tokens] @ w13.float().T + b13.float()
        y = clamped_swiglu(gate_up, alpha, limit) @ w2.float().T + b2.float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slot, None].float())
    return out.to(x.dtype)
