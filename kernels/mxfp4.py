"""MXFP4 (OCP Microscaling FP4), the format of GPT-OSS's expert weights, in plain torch: the
quantizer tests build weights with, the dequantizer, and the oracle of the Triton fused MoE
kernel that multiplies the packed weights as they are (kernels/fused_moe_triton.py).

Layout of a weight w [..., K], K a multiple of 32 (K: the input dimension, the one a GEMM
reduces over; for an expert, w13's hidden and w2's intermediate):
- blocks uint8 [..., K // 2]: two FP4 E2M1 codes a byte, element k = 2 * j in the low nibble
  of byte j and k = 2 * j + 1 in its high nibble. A code is sign (bit 3), exponent (bits 1-2,
  bias 1) and mantissa (bit 0): FP4_VALUES[code]. A checkpoint's `*_blocks` [..., K // 32, 16]
  is this tensor reshaped (`blocks.flatten(-2)`): no copy.
- scales uint8 [..., K // 32]: one E8M0 scale per 32 consecutive elements along K (elements
  32 * g .. 32 * g + 31 share scales[..., g]), worth 2 ** (scale - 127); 255 (NaN) unused.
- w[..., k] = FP4_VALUES[code of k] * 2 ** (scales[..., k // 32] - 127).
Hugging Face's convert_moe_packed_tensors (transformers/integrations/mxfp4.py) reads them so.

GPT-OSS's experts (Hugging Face's GptOssExperts): gate_up_proj_blocks [E, 2I, H // 32, 16]
with gate and up rows interleaved (row 2i is gate i, row 2i + 1 up i), a float bias per row;
down_proj_blocks [E, H, I // 32, 16] and its bias [E, H]; the activation is
kernels/fused_moe_ref.py's "swigluoai"."""

from __future__ import annotations

import torch

from kernels.fused_moe_ref import fused_experts_ref

# E2M1 by code: the low three bits are the magnitude, bit 3 the sign
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32  # elements per scale
_EMAX_E2M1 = 2  # the exponent of E2M1's largest magnitude, 6 = 1.5 * 2**2
# halfway between neighbouring magnitudes: a value on one rounds to the even code (below)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _magnitude_codes(magnitude: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 magnitude's code (0..7) of each non-negative float32, ties to even
    (the mantissa bit 0, as the OCP spec rounds), values past 6 saturated to 6."""
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=magnitude.device)
    below = torch.bucketize(magnitude, midpoints, right=False)  # on a midpoint: the lower code
    above = torch.bucketize(magnitude, midpoints, right=True)  # on a midpoint: the upper one
    return torch.where(below % 2 == 0, below, above)


def quantize_mxfp4(w: torch.Tensor,  # [..., K], K a multiple of 32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., K // 2], scales uint8 [..., K // 32]) in the module's layout, by
    the OCP spec's recipe: a group's scale is 2 ** (floor(log2(amax)) - 2), so its largest
    magnitude lands in [4, 8) and rounds to 4 or 6; every element rounds to the nearest E2M1
    value. A weight whose groups are already E2M1 values times a power of two comes back
    exactly; an all-zero group gets the scale 1 (127)."""
    if w.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(f"w's last dimension {w.shape[-1]} is not a multiple of {GROUP_SIZE}")
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2) = exponent - 1
    shared = torch.where(amax > 0, exponent - 1 - _EMAX_E2M1, 0).clamp(-127, 127)
    scaled = torch.ldexp(groups, -shared)  # exact: a power of two
    codes = _magnitude_codes(scaled.abs()) | (torch.signbit(scaled).to(torch.int64) << 3)
    codes = codes.reshape(*w.shape).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even k in the low nibble
    return blocks.contiguous(), (shared + 127).squeeze(-1).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor,  # uint8 [..., K // 2]
                     scales: torch.Tensor,  # uint8 [..., K // 32]
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [..., K]
    """The weight the blocks and scales stand for (the module's layout), computed in float32
    (every value exact: a 2-bit significand times a power of two) and cast to dtype (exact in
    bfloat16 too; float16 rounds values under 2**-14, its subnormals, and flushes those under
    2**-24)."""
    num_groups = scales.shape[-1]
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape[:-1] == scales.shape[:-1]
    assert blocks.shape[-1] == num_groups * GROUP_SIZE // 2, (blocks.shape, scales.shape)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = table[codes].reshape(*scales.shape, GROUP_SIZE)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def fused_experts_mxfp4_ref(x: torch.Tensor,  # [num_tokens, hidden]
                            w13_blocks: torch.Tensor,  # uint8 [num_experts, 2 * intermediate, hidden // 2]
                            w13_scales: torch.Tensor,  # uint8 [num_experts, 2 * intermediate, hidden // 32]
                            w2_blocks: torch.Tensor,  # uint8 [num_experts, hidden, intermediate // 2]
                            w2_scales: torch.Tensor,  # uint8 [num_experts, hidden, intermediate // 32]
                            topk_weights: torch.Tensor,  # [num_tokens, top_k]
                            topk_ids: torch.Tensor,  # [num_tokens, top_k]; -1: on another rank
                            activation: str = "swigluoai",
                            *,
                            w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
                            w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
                            ) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """fused_experts_ref over the dequantized weights (float32, so exactly the values the
    kernel multiplies). w13's rows in the activation's order: interleaved for "swigluoai"
    (GPT-OSS's checkpoint as it is), gate rows then up rows for "silu"."""
    return fused_experts_ref(x, dequantize_mxfp4(w13_blocks, w13_scales), dequantize_mxfp4(w2_blocks, w2_scales),
                             topk_weights, topk_ids, activation, w13_bias=w13_bias, w2_bias=w2_bias)
