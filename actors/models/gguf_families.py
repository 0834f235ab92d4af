"""What gguf_convert.py does differently for the GGUF families of issue 39: Gemma 2 and 3,
Phi-3. Their tensor names where they differ from Llama's, the norms llama.cpp stored as
(1 + w), and the config.json keys their metadata holds (or llama.cpp fixes in its code).

- gemma2, gemma3: llama.cpp's convert script adds 1 to every norm weight (its RMSNorm
  multiplies by w, Gemma's by 1 + w); it is taken off here. The feed-forward norms have their
  own names. query_pre_attn_scalar is not in the file: llama.cpp scales by head_dim ** -0.5
  (hidden / heads for the 46-layer 27B models), so that is the value written. Gemma 3's local
  RoPE base and its five-to-one pattern are fixed in llama.cpp (10000, 6) unless the file
  says otherwise (sliding_window_pattern).
- phi3: q/k/v stay fused as attn_qkv and gate/up as ffn_up, which are Hugging Face's Phi-3
  names too (qkv_proj, gate_up_proj: phi3.py splits them). LongRoPE's factors are the
  rope_factors_long / rope_factors_short tensors, read back into rope_scaling."""

from __future__ import annotations

import numpy as np

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

# llama.cpp name -> Hugging Face module, where a family's differ from the Llama table
LAYER_TENSOR_OVERRIDES = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
LAYER_TENSOR_OVERRIDES["gemma3"] = LAYER_TENSOR_OVERRIDES["gemma2"]


def restore_values(arch: str, gguf_name: str, values: np.ndarray) -> np.ndarray:
    """A dequantized tensor as Hugging Face keeps it (Gemma's norms less llama.cpp's 1)."""
    if arch in GEMMA_ARCHITECTURES and gguf_name.endswith("norm.weight"):
        return values - np.float32(1.0)
    return values


def family_config(field, arch: str, config: dict, tensors: dict, as_float) -> None:
    """Adds the family's keys to config (field(key, default) reads the GGUF metadata;
    as_float turns a stored float32 into the decimal its authors wrote)."""
    if arch in GEMMA_ARCHITECTURES:
        config["hidden_activation"] = "gelu_pytorch_tanh"
        del config["hidden_act"]
        window = field(f"{arch}.attention.sliding_window")
        config["sliding_window"] = window if window is not None else config["max_position_embeddings"]
        wide = config["num_hidden_layers"] == 46  # (llama.cpp's 27B rule)
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if wide \
            else config["head_dim"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = field(f"{arch}.{key}")
            config[key] = as_float(value) if value is not None else None
        if arch == "gemma3":
            config["rope_local_base_freq"] = 10000.0
            pattern = field(f"{arch}.attention.sliding_window_pattern")
            if isinstance(pattern, list):  # per layer: True where sliding
                config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                config["sliding_window_pattern"] = pattern or 6
        return
    if arch == "phi3":
        config["original_max_position_embeddings"] = field(
            "phi3.rope.scaling.original_context_length", config["max_position_embeddings"])
        window = field("phi3.attention.sliding_window")
        if window:
            config["sliding_window"] = window
        if ROPE_FACTOR_TENSORS[0] in tensors:
            import gguf

            long, short = (gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type).reshape(-1)
                           for name in ROPE_FACTOR_TENSORS)
            attention_factor = field("phi3.rope.scaling.attn_factor")
            config["rope_scaling"] = {
                "rope_type": "longrope", "long_factor": [as_float(f) for f in long],
                "short_factor": [as_float(f) for f in short],
                "original_max_position_embeddings": config["original_max_position_embeddings"],
                **({"attention_factor": as_float(attention_factor)} if attention_factor is not None else {})}
