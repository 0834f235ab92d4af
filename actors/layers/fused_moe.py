"""A sparse MoE layer's experts as the device multiplies them: the router's top-k
(kernels/fused_moe_ref.py's route) and the fused experts, through the CPU's C++
(kernels/moe_cpu.py: float32 in its packed panels, or a GGUF file's blocks as they are),
Triton on CUDA (kernels/fused_moe_triton.py), or the torch reference anywhere else.

The experts are stacked once at load in the kernels' layouts (w13 [E, 2I, H]: gate rows,
then up rows; w2 [E, H, I]). With expert parallelism a rank holds experts [first, first +
E_local) and routes every token over all of them: local_expert_ids turns the others into
-1, which add nothing, and the all-reduce after the block sums the ranks' parts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fused_moe_ref import fused_experts_ref, local_expert_ids, route


@dataclass
class FusedExperts:
    num_experts: int  # the model's, over every rank
    first_expert: int  # this rank's first (expert parallelism; else 0)
    num_local_experts: int
    w13: torch.Tensor | None  # [E_local, 2I, H]; None where the CPU kernel holds its own copy
    w2: torch.Tensor | None  # [E_local, H, I]
    cpu: object | None = None  # kernels/moe_cpu.py's ExpertWeights, where the C++ multiplies them

    @staticmethod
    def build(w13: torch.Tensor, w2: torch.Tensor, num_experts: int, first_expert: int) -> FusedExperts:
        """Float experts on their device: the CPU's float32 experts packed for moe_cpu.cpp
        (the stacked copies then dropped), where its kernels built."""
        experts = FusedExperts(num_experts, first_expert, w13.shape[0], w13.contiguous(), w2.contiguous())
        if w13.device.type == "cpu" and w13.dtype == torch.float32:
            from kernels.moe_cpu import fp32_experts, moe_cpu_kernels

            if moe_cpu_kernels() is not None:
                experts.cpu, experts.w13, experts.w2 = fp32_experts(w13, w2, packed=True), None, None
        return experts

    @staticmethod
    def from_gguf(w13_blocks: torch.Tensor, w13_type: int, w2_blocks: torch.Tensor, w2_type: int,
                  hidden_size: int, intermediate_size: int) -> FusedExperts:
        """A GGUF file's expert blocks (ffn_gate_exps and ffn_up_exps concatenated per expert,
        ffn_down_exps), multiplied as blocks by moe_cpu.cpp: never dequantized."""
        from kernels.moe_cpu import gguf_experts

        cpu = gguf_experts(w13_blocks, w13_type, w2_blocks, w2_type, hidden_size, intermediate_size)
        return FusedExperts(w13_blocks.shape[0], 0, w13_blocks.shape[0], None, None, cpu)

    def num_bytes(self) -> int:
        if self.cpu is not None:
            return self.cpu.num_bytes()
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2))

    def __call__(self, x: torch.Tensor,  # [num_tokens, hidden]
                 router_logits: torch.Tensor,  # [num_tokens, num_experts]
                 top_k: int, renormalize: bool) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
        """This rank's experts' share of sum_k weight_k * expert_k(x)."""
        topk_weights, topk_ids = route(router_logits, top_k, renormalize)
        if self.num_local_experts != self.num_experts:
            topk_ids = local_expert_ids(topk_ids, self.first_expert, self.num_local_experts)
        if self.cpu is not None:
            from kernels.moe_cpu import moe_cpu_kernels

            return moe_cpu_kernels().fused_experts(x.float().contiguous(), self.cpu, topk_weights,
                                                   topk_ids).to(x.dtype)
        if x.is_cuda:
            from kernels.fused_moe_triton import fused_experts

            return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)
        return fused_experts_ref(x, self.w13, self.w2, topk_weights, topk_ids)
