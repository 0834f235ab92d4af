"""A GPT-OSS MoE layer's experts as the device multiplies them (biases, interleaved gate/up,
clamped SwiGLU: kernels/mxfp4_ref.py): with the Triton backend (CUDA, or the interpreter in
tests) the fused-MoE Triton kernels, MXFP4 bytes decoded in registers
(kernels/fused_moe_triton.py's fused_experts_mxfp4) or float rows; on the CPU MXFP4 bytes
through kernels/moe_mxfp4.cpp; float rows [E, 2I, H] and [E, H, I] elsewhere through the
torch reference.

A CPU without a compiler runs MXFP4 experts on the reference, each routed expert dequantized
at each call: correct, and they stay MXFP4 in memory, but slow."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fused_moe_ref import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from kernels.moe_mxfp4 import Mxfp4Experts, moe_mxfp4_kernels
from kernels.mxfp4_ref import gpt_oss_experts_ref, mxfp4_experts_ref


@dataclass
class GptOssExperts:
    alpha: float  # swiglu_alpha
    limit: float  # swiglu_limit
    mxfp4: Mxfp4Experts | None = None  # the checkpoint's blocks and scales, as they are
    w13: torch.Tensor | None = None  # [E, 2I, H] float: gate/up rows interleaved (a float checkpoint)
    b13: torch.Tensor | None = None  # [E, 2I]
    w2: torch.Tensor | None = None  # [E, H, I]
    b2: torch.Tensor | None = None  # [E, H]
    # the Triton kernels (the model's attention backend is Triton's); they hard-code GPT-OSS's
    # alpha and limit, so other values stay on the reference
    triton: bool = False

    def num_bytes(self) -> int:
        if self.mxfp4 is not None:
            return self.mxfp4.num_bytes()
        return sum(t.numel() * t.element_size() for t in (self.w13, self.b13, self.w2, self.b2))

    def __call__(self, x: torch.Tensor,  # [num_tokens, hidden]
                 topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
                 topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
                 ) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
        m = self.mxfp4
        if self.triton and (self.alpha, self.limit) == (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            from kernels.fused_moe_triton import fused_experts, fused_experts_mxfp4
            if m is None:
                return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, "swigluoai", w13_bias=self.b13,
                                     w2_bias=self.b2)
            return fused_experts_mxfp4(x, m.w13_blocks.flatten(-2), m.w13_scales, m.w2_blocks.flatten(-2),
                                       m.w2_scales, topk_weights, topk_ids, "swigluoai", w13_bias=m.w13_bias,
                                       w2_bias=m.w2_bias)
        if m is None:
            return gpt_oss_experts_ref(x, self.w13, self.b13, self.w2, self.b2, topk_weights, topk_ids, self.alpha,
                                       self.limit)
        kernels = moe_mxfp4_kernels() if x.device.type == "cpu" else None
        if kernels is not None:
            return kernels.fused_experts(x.float(), m, topk_weights, topk_ids, self.alpha, self.limit).to(x.dtype)
        return mxfp4_experts_ref(x, m.w13_blocks, m.w13_scales, m.w13_bias, m.w2_blocks, m.w2_scales, m.w2_bias,
                                 topk_weights, topk_ids, self.alpha, self.limit)
