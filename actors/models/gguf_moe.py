"""What gguf_convert.py adds for llama.cpp's mixture-of-experts files (`qwen3moe`,
`qwen2moe`): the experts' metadata as config.json keys, the router's and shared expert's
tensor names, and each [num_experts, ...] expert tensor (ffn_gate_exps, ffn_up_exps,
ffn_down_exps) split into Hugging Face's per-expert tensors. The quantized path runs the
same file's expert blocks as they are (actors/quantization/gguf.py, actors/models/moe.py)."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

# llama.cpp's Qwen3-MoE graph always renormalises the top-k weights; Qwen2-MoE's never
MOE_NORM_TOPK_PROB = {"qwen3moe": True, "qwen2moe": False}

MOE_TENSOR_TO_HF = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_NAME = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")


def moe_config(arch: str, field: Callable[[str], object], gguf_path: str) -> dict:
    """config.json's expert keys of a `qwen3moe` / `qwen2moe` file; field(key) reads
    `{arch}.{key}` (None where absent)."""
    num_experts, top_k = field("expert_count"), field("expert_used_count")
    expert_size = field("expert_feed_forward_length")
    if not num_experts or not top_k or not expert_size:
        raise ValueError(f"{gguf_path}: a {arch} file needs {arch}.expert_count, expert_used_count and "
                         "expert_feed_forward_length")
    config = {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_size,
              "norm_topk_prob": bool(field("expert_weights_norm") if field("expert_weights_norm") is not None
                                     else MOE_NORM_TOPK_PROB[arch]),
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = field("expert_shared_feed_forward_length") or 0
    return config


def split_experts(gguf_name: str, values: np.ndarray) -> dict[str, np.ndarray] | None:
    """An expert tensor ([num_experts, out, in], dequantized) as per-expert Hugging Face
    tensors; None for any other tensor. Qwen2-MoE's shared-expert gate ([hidden] in the
    file) is not one of these: reshape_shared_gate gives it HF's [1, hidden]."""
    match = _EXPERT_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    layer, kind = match.groups()
    return {f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_TENSORS[kind]}.weight": np.ascontiguousarray(values[e])
            for e in range(values.shape[0])}


def reshape_shared_gate(gguf_name: str, values: np.ndarray) -> np.ndarray:
    return values.reshape(1, -1) if ".ffn_gate_inp_shexp." in gguf_name and values.ndim == 1 else values
