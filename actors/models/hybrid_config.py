"""What the engine reads of a config.json beyond the Llama shape, for the families whose
layers differ in their attention (issue 39): each layer's sliding window, and the
family's own numbers (Gemma's soft caps, query scalar and RoPE bases; Phi-3's LongRoPE;
GPT-OSS's YaRN and clamped SwiGLU).
Torch-free: the loader calls it in the launching process, so a config the engine cannot run
fails at start-up, naming the field.

The rules are Hugging Face's (transformers 5's configuration_*.py), one per family:
- Mistral (and Phi-3): every layer is windowed when `sliding_window` is set.
- Qwen2, Qwen3: only with `use_sliding_window`; then the layers `layer_types` names
  "sliding_attention", or (no layer_types) those at or past `max_window_layers`.
- Gemma 2 and GPT-OSS: `layer_types`, else alternating sliding (even layers) and full (odd).
- Gemma 3: `layer_types`, else `sliding_window_pattern` (6): five local layers to one global.
A window at least max_position_embeddings long never masks a key: it counts as none, so
the layer keeps the plain (fastest) attention path."""

from __future__ import annotations

GEMMA_FAMILIES = ("Gemma2", "Gemma3")
_SLIDING, _FULL = "sliding_attention", "full_attention"


def layer_windows(config: dict, architecture: str, config_path: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention); () when no layer has one."""
    num_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    if architecture.startswith(("Qwen2", "Qwen3")) and not config.get("use_sliding_window", False):
        window = None
    if window is None:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{config_path}: sliding_window must be a positive integer, got {window!r}")
    if window >= (config.get("max_position_embeddings") or 0):
        return ()
    layer_types = config.get("layer_types")
    if architecture.startswith(("Mistral", "Phi3")):
        layer_types = None  # (Hugging Face's Mistral and Phi-3 window every layer, whatever layer_types says)
        sliding = [True] * num_layers
    elif architecture.startswith(("Qwen2", "Qwen3")):
        sliding = [i >= config.get("max_window_layers", 28) for i in range(num_layers)]
    elif architecture.startswith(("Gemma2", "GptOss")):
        sliding = [(i + 1) % 2 != 0 for i in range(num_layers)]
    elif architecture.startswith("Gemma3"):
        pattern = config.get("sliding_window_pattern", 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        raise ValueError(f"{config_path}: sliding_window is not supported for {architecture}")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {_SLIDING, _FULL})
        if len(layer_types) != num_layers or unknown:
            raise ValueError(f"{config_path}: layer_types must name {num_layers} layers, each "
                             f"{_SLIDING!r} or {_FULL!r} (got {len(layer_types)}; unknown: {unknown})")
        sliding = [kind == _SLIDING for kind in layer_types]
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


def family_config(config: dict, architecture: str, config_path: str) -> dict | None:
    """The family's own numbers (what its model file reads from ModelConfig.family), or None
    for a Llama-shaped family that has none."""
    if architecture.startswith(GEMMA_FAMILIES):
        return _gemma(config, architecture, config_path)
    if architecture.startswith("Phi3"):
        return _phi3(config, config_path)
    if architecture.startswith("GptOss"):
        return _gpt_oss(config, config_path)
    return None


def _gemma(config: dict, architecture: str, config_path: str) -> dict:
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{config_path}: hidden_activation {activation!r} is not supported (only gelu_pytorch_tanh)")
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{config_path}: use_bidirectional_attention is not supported (a decoder is causal)")
    gemma3 = architecture.startswith("Gemma3")
    # Gemma 2's defaults are its config class's: soft caps 50 and 30; Gemma 3 keeps neither
    family = {"query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
              "attn_logit_softcapping": config.get("attn_logit_softcapping", None if gemma3 else 50.0),
              "final_logit_softcapping": config.get("final_logit_softcapping", None if gemma3 else 30.0),
              "qk_norm": gemma3}
    rope = config.get("rope_parameters") or {}
    if gemma3:
        if _SLIDING in rope or _FULL in rope:  # transformers 5: one dict per layer kind
            local, global_ = rope.get(_SLIDING) or {}, rope.get(_FULL) or {}
        else:  # older configs: rope_theta, rope_local_base_freq and rope_scaling (the global layers')
            local = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
            global_ = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 1000000.0)}
        family["local_rope"] = _plain_or_linear(local, 10000.0, config_path)
        family["global_rope"] = _plain_or_linear(global_, 1000000.0, config_path)
    else:
        family["global_rope"] = family["local_rope"] = _plain_or_linear(
            rope or {"rope_theta": config.get("rope_theta", 10000.0)}, 10000.0, config_path)
    return family


def _plain_or_linear(rope: dict, default_theta: float, config_path: str) -> dict:
    """{"rope_theta", "factor"}: default RoPE, or "linear" (positions divided by factor)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(f"{config_path}: Gemma rope type {rope_type!r} is not supported (default, linear)")
    factor = float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0
    return {"rope_theta": float(rope.get("rope_theta", default_theta)), "factor": factor}


def _phi3(config: dict, config_path: str) -> dict:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{config_path}: partial_rotary_factor {partial} is not supported (only 1.0)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type  # (Hugging Face's old names)
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return {"rope_theta": theta, "longrope": None}
    if rope_type != "longrope":
        raise ValueError(f"{config_path}: Phi-3 rope type {rope_type!r} is not supported (default, longrope)")
    missing = [key for key in ("short_factor", "long_factor") if not rope.get(key)]
    if missing:
        raise ValueError(f"{config_path}: longrope rope scaling lacks {', '.join(missing)}")
    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if not original:
        raise ValueError(f"{config_path}: longrope needs original_max_position_embeddings")
    return {"rope_theta": theta, "longrope": {
        "short_factor": [float(f) for f in rope["short_factor"]], "long_factor": [float(f) for f in rope["long_factor"]],
        "factor": rope.get("factor"), "attention_factor": rope.get("attention_factor"),
        "original_max_position_embeddings": int(original)}}


def _gpt_oss(config: dict, config_path: str) -> dict:
    """GPT-OSS: RoPE default or YaRN (Hugging Face's _compute_yarn_parameters' keys), and its
    experts' clamped SwiGLU (actors/models/gpt_oss.py)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 150000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    family = {"rope_theta": theta, "yarn": None, "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
              "swiglu_limit": float(config.get("swiglu_limit", 7.0))}
    if rope_type == "default":
        return family
    if rope_type != "yarn":
        raise ValueError(f"{config_path}: GPT-OSS rope type {rope_type!r} is not supported (default, yarn)")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0 or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError(f"{config_path}: yarn with partial_rotary_factor, mscale or mscale_all_dim is not supported")
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise ValueError(f"{config_path}: yarn rope scaling needs original_max_position_embeddings")
    factor = rope.get("factor") or config["max_position_embeddings"] / original
    family["yarn"] = {"factor": float(factor), "original_max_position_embeddings": int(original),
                      "attention_factor": rope.get("attention_factor"), "beta_fast": rope.get("beta_fast") or 32,
                      "beta_slow": rope.get("beta_slow") or 1, "truncate": bool(rope.get("truncate", True))}
    return family
