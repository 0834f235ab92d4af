"""Tiny random mixture-of-experts checkpoints of the four families troupe runs natively,
built with transformers (its per-expert tensor names) and the tests' tiny tokenizer."""

from __future__ import annotations

import torch

from tests.conftest import _TINY_CONFIG, _randomize_weights, build_tiny_tokenizer

# family -> (model_type, config overrides): 8 experts, top-2 (Mixtral top-3), one dense
# layer among three where the family has dense layers (Qwen's mlp_only_layers)
MOE_FAMILIES = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1], head_dim=32,
                                    rope_theta=1000000.0)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False,
                                    decoder_sparse_step=1, mlp_only_layers=[2], tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=32)),
    "olmoe": ("olmoe", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False,
                            clip_qkv=4.0)),
}


def build_tiny_moe(out_dir: str, family: str, seed: int = 0, **overrides) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, family_config = MOE_FAMILIES[family]
    tokenizer = build_tiny_tokenizer()
    config = AutoConfig.for_model(model_type, **{**_TINY_CONFIG, "num_hidden_layers": 3, "vocab_size": len(tokenizer),
                                                 **family_config, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_weights(model)
    model.generation_config.eos_token_id = [0, 2]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def gguf_expert_writer(expert_type):
    """write_gguf's write_experts for a Qwen3-MoE / Qwen2-MoE model: its metadata, and each
    sparse layer's experts stacked as llama.cpp's ffn_{gate,up,down}_exps, quantized to
    expert_type (a gguf.GGMLQuantizationType)."""
    import gguf
    import numpy as np

    def write(writer, config: dict, weights: dict) -> set[str]:
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob")))
        if config.get("shared_expert_intermediate_size"):  # Qwen2-MoE's shared expert
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        written = set()
        for layer in range(config["num_hidden_layers"]):
            prefix = f"model.layers.{layer}.mlp.experts."
            if f"{prefix}0.gate_proj.weight" not in weights:
                continue
            for projection, gguf_name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                          ("down_proj", "ffn_down_exps")):
                names = [f"{prefix}{e}.{projection}.weight" for e in range(num_experts)]
                stacked = np.stack([weights[name].numpy() for name in names])
                writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", gguf.quants.quantize(stacked, expert_type),
                                  raw_dtype=expert_type)
                written.update(names)
        return written

    return write
