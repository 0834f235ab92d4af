"""Tiny random GPT-OSS checkpoints: Hugging Face's float format (save_pretrained), and the
same model with its experts in MXFP4 as GPT-OSS's own checkpoints store them
(quantization_config {"quant_method": "mxfp4"}; *_blocks [E, rows, in / 32, 16] and
*_scales [E, rows, in / 32]), beside a float copy of the dequantized weights for Hugging
Face to run."""

from __future__ import annotations

import json
import os
import shutil

import torch

from kernels.mxfp4_ref import mxfp4_dequantize, mxfp4_quantize
from tests.conftest import _TINY_CONFIG, _randomize_weights, build_tiny_tokenizer

_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 256, "rope_theta": 150000.0}
# three layers (sliding, full, sliding: the config's default layer_types), a 24-key window,
# 8 experts of width 64 (MXFP4 blocks of 32 divide it and the hidden size), top-2, YaRN
GPT_OSS_CONFIG = dict(num_hidden_layers=3, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                      sliding_window=24, max_position_embeddings=1024, rope_parameters=_YARN, rms_norm_eps=1e-5)


def build_tiny_gpt_oss(out_dir: str, seed: int = 0, **overrides) -> str:
    """A seeded random GptOssForCausalLM saved by transformers (float experts)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    tokenizer = build_tiny_tokenizer()
    base = {k: v for k, v in _TINY_CONFIG.items() if k not in ("rope_theta", "intermediate_size")}
    config = GptOssConfig(**{**base, "vocab_size": len(tokenizer), **GPT_OSS_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_weights(model)
    with torch.no_grad():
        for layer in model.model.layers:
            # gate/up values past swiglu_limit (7) somewhere, so the clamps bind; sinks of
            # either sign and a size that moves the softmax
            layer.mlp.experts.gate_up_proj.mul_(4.0)
            layer.self_attn.sinks.normal_(0.0, 1.5)
    model.generation_config.eos_token_id = [0, 2]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_gpt_oss_mxfp4(out_dir: str, seed: int = 0) -> tuple[str, str]:
    """(an MXFP4 checkpoint, the float checkpoint of the same weights dequantized): the random
    experts quantized here, the dequantized copy saved by transformers for its own run."""
    from safetensors.torch import load_file, save_file

    float_dir = build_tiny_gpt_oss(os.path.join(out_dir, "dequantized"), seed)
    mxfp4_dir = os.path.join(out_dir, "mxfp4")
    os.makedirs(mxfp4_dir)
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors[name].transpose(1, 2).contiguous()  # Hugging Face's [E, in, out] -> [E, out, in]
        blocks, scales = mxfp4_quantize(rows)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        # the float copy holds exactly what the blocks say
        tensors[name] = mxfp4_dequantize(blocks, scales).transpose(1, 2).contiguous()
    float_weights = {n: t for n, t in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    save_file(float_weights, os.path.join(float_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file({n: t for n, t in tensors.items() if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))},
              os.path.join(mxfp4_dir, "model.safetensors"), metadata={"format": "pt"})
    for file in os.listdir(float_dir):
        if file != "model.safetensors":
            shutil.copy(os.path.join(float_dir, file), mxfp4_dir)
    config_path = os.path.join(mxfp4_dir, "config.json")
    with open(config_path) as file:
        config = json.load(file)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(config_path, "w") as file:
        json.dump(config, file, indent=2)
    return mxfp4_dir, float_dir
