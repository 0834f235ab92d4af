"""MXFP4 weights and GPT-OSS's experts in plain torch: the oracle of kernels/moe_mxfp4.cpp,
and the path of any device without it.

MXFP4 as GPT-OSS checkpoints store it (OCP microscaling; Hugging Face's
integrations/mxfp4.py reads the same bytes):
- blocks [..., rows, in / 32, 16] uint8: each byte two FP4 E2M1 values, the low nibble the
  even column, the high nibble the odd one; a nibble is sign (bit 3) and one of
  FP4_VALUES' eight magnitudes;
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

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def mxfp4_dequantize(blocks: torch.Tensor,  # [..., rows, in / 32, 16] uint8
                     scales: torch.Tensor,  # [..., rows, in / 32] uint8
                     ) -> torch.Tensor:  # [..., rows, in] float32
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape[:-1] == scales.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., in / 32, 32]: even, odd, even, ...
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def mxfp4_quantize(weight: torch.Tensor,  # [..., rows, in] float, in a multiple of 32
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # (blocks, scales) as mxfp4_dequantize reads them
    """Each block of 32 scaled by the power of two that brings its largest magnitude to at
    most 6 (FP4's largest), each value rounded to the nearest FP4 magnitude. For tests: a
    checkpoint in GPT-OSS's format from random weights."""
    *outer, in_features = weight.shape
    assert in_features % BLOCK == 0
    w = weight.float().reshape(*outer, in_features // BLOCK, BLOCK)
    amax = w.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).to(torch.int32)
    scaled = torch.ldexp(w, -exponent[..., None])
    magnitudes = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=weight.device)
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)  # nearest magnitude, [..., 32]
    codes = (index | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def route_gpt_oss(router_logits: torch.Tensor,  # [num_tokens, num_experts] (the router's bias added)
                  top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [num_tokens, top_k] float32, topk_ids int32): the top_k logits, softmax
    over them alone (Hugging Face's GptOssTopKRouter, in its order of operations)."""
    top_logits, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(top_logits, dim=-1), topk_ids.to(torch.int32)


def clamped_swiglu(gate_up: torch.Tensor,  # [rows, 2I]: gate and up interleaved
                   alpha: float, limit: float) -> torch.Tensor:  # [rows, I]
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


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
