"""MoeConfig (actors/config/moe.py) from a mixture-of-experts model's config.json: where each
family keeps its expert count, expert width, router convention and dense layers, as its
Hugging Face modeling code reads them. None for a dense model."""

from __future__ import annotations

from actors.config.moe import MoeConfig
from actors.config.quantization import native_mxfp4

# architecture -> the config.json key of its expert count
_EXPERT_COUNT_KEYS = {"Qwen3MoeForCausalLM": "num_experts", "Qwen2MoeForCausalLM": "num_experts",
                      "OlmoeForCausalLM": "num_experts", "MixtralForCausalLM": "num_local_experts",
                      "GptOssForCausalLM": "num_local_experts"}
MOE_ARCHITECTURES = tuple(_EXPERT_COUNT_KEYS)


def read_moe_config(config: dict, architecture: str, config_path: str) -> MoeConfig | None:
    """The experts' shape; ValueError naming the key for what troupe cannot run."""
    if architecture not in _EXPERT_COUNT_KEYS:
        return None
    quant = config.get("quantization_config")
    if architecture == "GptOssForCausalLM" and native_mxfp4(quant):
        quant = None  # (GPT-OSS's MXFP4 experts: read as they are by actors/models/gpt_oss.py)
    if quant:  # (GPTQ/AWQ/FP8 experts: no kernel stacks them)
        raise ValueError(f"{config_path}: quantization_config is not supported for {architecture} (a mixture-of-"
                         "experts model); a GGUF file's blocks are")
    num_layers = config["num_hidden_layers"]
    # transformers 5 saves each family's count as num_local_experts (an attribute_map alias)
    num_experts = config.get(_EXPERT_COUNT_KEYS[architecture], config.get("num_local_experts"))
    top_k = config.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{config_path}: {_EXPERT_COUNT_KEYS[architecture]} must be a positive integer, "
                         f"got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{config_path}: num_experts_per_tok must be in [1, {num_experts}], got {top_k!r}")
    if architecture == "MixtralForCausalLM":
        # every layer sparse; softmax over the top-k logits = the renormalised top-k
        return MoeConfig(num_experts, top_k, config["intermediate_size"], True, tuple(range(num_layers)),
                         block="block_sparse_moe", projections=("w1", "w3", "w2"))
    if architecture == "GptOssForCausalLM":
        # every layer sparse; softmax over the top-k logits (the router's bias added first)
        return MoeConfig(num_experts, top_k, config["intermediate_size"], True, tuple(range(num_layers)))
    if architecture == "OlmoeForCausalLM":
        return MoeConfig(num_experts, top_k, config["intermediate_size"], bool(config.get("norm_topk_prob", False)),
                         tuple(range(num_layers)), whole_qk_norm=True, clip_qkv=config.get("clip_qkv"))
    # Qwen2-MoE and Qwen3-MoE: a layer is sparse unless listed in mlp_only_layers, every
    # decoder_sparse_step-th layer (HF's Qwen3MoeDecoderLayer)
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = config.get("shared_expert_intermediate_size") or 0 if architecture == "Qwen2MoeForCausalLM" else 0
    return MoeConfig(num_experts, top_k, config["moe_intermediate_size"], bool(config.get("norm_topk_prob", False)),
                     sparse, shared_expert_intermediate_size=shared)
