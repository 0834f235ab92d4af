"""A mixture-of-experts decoder's MoE shape (MoeConfig), read from config.json by
actors/models/moe_config.py and carried in ModelConfig.moe. Torch-free: msgspec decodes it
in every actor process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # each expert's (moe_intermediate_size; Mixtral's intermediate_size)
    norm_topk_prob: bool  # the top-k router weights renormalised to sum to 1 (always for Mixtral)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts; the others are dense
    # the checkpoint's names: "<block>.gate.weight" (the router), "<block>.experts.<e>.<gate|up|down>.weight"
    block: str = "mlp"  # Mixtral: "block_sparse_moe"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none), with its sigmoid gate
    whole_qk_norm: bool = False  # OLMoE: RMSNorm over the whole q and k projections, not per head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]


def check_moe_engine(moe: MoeConfig | None, architecture: str, *, tensor_parallel_size: int,
                     enable_expert_parallel: bool, enable_lora: bool, pipeline_parallel_size: int,
                     quantization: str | None = None) -> None:
    """ValueError naming the field, for what troupe does not run on a mixture-of-experts
    model (checked at start-up, before any worker loads a weight)."""
    if moe is None:
        if enable_expert_parallel:
            raise ValueError(f"enable_expert_parallel: {architecture} is not a mixture-of-experts model")
        return
    if enable_lora:
        raise ValueError(f"enable_lora: LoRA on a mixture-of-experts model ({architecture}) is not supported")
    # the experts run as fp32 (or bf16/fp16) stacks or as a GGUF file's blocks; no other method packs them
    if quantization not in (None, "none", "auto", "gguf"):
        raise ValueError(f"quantization {quantization!r} is not supported for a mixture-of-experts model "
                         f"({architecture}): 'none', or a GGUF file's own blocks ('auto' / 'gguf')")
    if pipeline_parallel_size > 1:
        raise ValueError(f"pipeline_parallel_size > 1 is not supported for a mixture-of-experts model ({architecture})")
    tp = tensor_parallel_size
    if architecture == "GptOssForCausalLM" and tp > 1:  # (its o_proj and expert biases are not split yet)
        raise ValueError(f"tensor_parallel_size {tp}: {architecture} runs on one device for now")
    if enable_expert_parallel and moe.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {tp} does not divide the model's "
                         f"{moe.num_experts} experts")
    if not enable_expert_parallel and moe.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the experts' intermediate size "
                         f"{moe.intermediate_size} (enable_expert_parallel places whole experts instead)")
    if moe.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the shared expert's intermediate size "
                         f"{moe.shared_expert_intermediate_size}")
