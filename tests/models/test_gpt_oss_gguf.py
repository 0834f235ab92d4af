"""A GPT-OSS GGUF file as llama.cpp writes one (written here with gguf-py): experts MXFP4 in
ggml's blocks, gate and up split into ffn_gate_exps / ffn_up_exps with their biases, sinks
as attn_sinks. Converted once, the experts stay MXFP4 (repacked into GPT-OSS's checkpoint
layout, never dequantized: actors/models/gguf_gpt_oss.py) and match Hugging Face run on the
file's dequantized weights; a float GGUF converts back to the original weights exactly."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from actors import LLM, SamplingParams
from actors.models.loader import iter_weights, load_model_config, resolve_model
from tests.models.gpt_oss_models import build_tiny_gpt_oss
from tests.models.test_gguf_loader import write_gguf
from tests.models.test_loader import read_safetensors
from tests.models.test_sliding_window_matches_hf import run_every_way

MXFP4 = gguf.GGMLQuantizationType.MXFP4


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TROUPE_CACHE", str(tmp_path / "cache"))
    return str(tmp_path / "cache")


def gpt_oss_metadata(writer, config: dict):
    """What llama.cpp's converter writes for gpt-oss beside the Llama keys."""
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])
    rope = config["rope_parameters"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return None


def gpt_oss_tensors(expert_type) -> callable:
    """write_gguf's write_experts: sinks as attn_sinks, and the experts as llama.cpp splits
    them (gate rows even, up rows odd of Hugging Face's fused [E, H, 2I]), of expert_type.
    Returns also (in .dequantized) the expert weights as the file's blocks say, in Hugging
    Face's layout."""
    dequantized: dict[str, torch.Tensor] = {}

    def add(writer, name: str, values: np.ndarray) -> np.ndarray:  # -> the values the file holds
        values = np.ascontiguousarray(values, dtype=np.float32)
        if expert_type == MXFP4:
            blocks = gguf.quants.quantize(values, MXFP4)
            writer.add_tensor(name, blocks, raw_dtype=MXFP4)
            return gguf.quants.dequantize(blocks, MXFP4).reshape(values.shape)
        writer.add_tensor(name, values)
        return values

    def write(writer, config: dict, weights: dict) -> set[str]:
        written = set()
        for layer in range(config["num_hidden_layers"]):
            hf, blk = f"model.layers.{layer}.", f"blk.{layer}."
            writer.add_tensor(f"{blk}attn_sinks.weight", weights[f"{hf}self_attn.sinks"].numpy())
            rows = weights[f"{hf}mlp.experts.gate_up_proj"].transpose(1, 2).numpy()  # [E, 2I, H]
            bias = weights[f"{hf}mlp.experts.gate_up_proj_bias"].numpy()
            gate = add(writer, f"{blk}ffn_gate_exps.weight", rows[:, 0::2])
            up = add(writer, f"{blk}ffn_up_exps.weight", rows[:, 1::2])
            writer.add_tensor(f"{blk}ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2]))
            writer.add_tensor(f"{blk}ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
            down = add(writer, f"{blk}ffn_down_exps.weight", weights[f"{hf}mlp.experts.down_proj"].transpose(1, 2).numpy())
            writer.add_tensor(f"{blk}ffn_down_exps.bias", weights[f"{hf}mlp.experts.down_proj_bias"].numpy())
            interleaved = np.stack([gate, up], axis=2).reshape(rows.shape)
            dequantized[f"{hf}mlp.experts.gate_up_proj"] = torch.from_numpy(interleaved).transpose(1, 2).contiguous()
            dequantized[f"{hf}mlp.experts.down_proj"] = torch.from_numpy(down).transpose(1, 2).contiguous()
            written |= {f"{hf}self_attn.sinks", *(f"{hf}mlp.experts.{p}" for p in (
                "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))}
        return written

    write.dequantized = dequantized
    return write


def test_float_gguf_converts_back_exactly(tmp_path, private_cache):
    model_dir = build_tiny_gpt_oss(str(tmp_path / "hf"))
    path = str(tmp_path / "tiny-gpt-oss-f32.gguf")
    write_gguf(model_dir, path, family=gpt_oss_metadata, write_experts=gpt_oss_tensors(gguf.GGMLQuantizationType.F32))
    converted_dir = resolve_model(path)
    expected, converted = read_safetensors(model_dir), dict(iter_weights(converted_dir))
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[name], expected[name]) for name in expected)
    # the same config (windows, YaRN, experts), but for the single eos id a GGUF keeps
    original_config, converted_config = load_model_config(model_dir), load_model_config(converted_dir)
    for field in original_config.__dataclass_fields__.keys() - {"model_path", "eos_token_ids"}:
        assert getattr(converted_config, field) == getattr(original_config, field), field


def test_mxfp4_gguf_runs_its_experts_as_mxfp4_and_matches_hf(tmp_path, private_cache):
    model_dir = build_tiny_gpt_oss(str(tmp_path / "hf"), seed=2)
    path = str(tmp_path / "tiny-gpt-oss-mxfp4.gguf")
    writer = gpt_oss_tensors(MXFP4)
    write_gguf(model_dir, path, family=gpt_oss_metadata, write_experts=writer)
    # Hugging Face's run: the original model with the experts the file's blocks hold
    reference_dir = str(tmp_path / "dequantized")
    shutil.copytree(model_dir, reference_dir)
    weights = {**read_safetensors(model_dir), **writer.dequantized}
    save_file(weights, os.path.join(reference_dir, "model.safetensors"), metadata={"format": "pt"})

    llm = LLM(path, kv_cache_memory="16MiB")
    assert llm.config.quantization is None  # (attention F32: nothing for the GGUF linears; experts the model's)
    model = llm.engine.runner.model
    for experts in model.experts.values():
        assert experts.w13 is None and experts.mxfp4.w13_blocks.dtype == torch.uint8
        assert experts.mxfp4.w13_blocks.shape == (8, 128, 2, 16)
    del llm
    run_every_way(path, hf_dir=reference_dir)


def test_q8_0_attention_runs_on_the_gguf_linears_beside_the_mxfp4_experts(tmp_path, private_cache, monkeypatch):
    """Attention and LM head Q8_0 (kernels/gguf_linear.cpp, with q/k/v/o biases), experts
    MXFP4: close to the same file run dequantized (--quantization none), whose only difference
    is the Q8_0 linears quantizing their inputs per block of 32."""
    import tests.quantization.test_gguf_quantized as quantized

    monkeypatch.setattr(quantized, "write_gguf", lambda model_dir, path, write_experts=None: write_gguf(
        model_dir, path, family=gpt_oss_metadata, write_experts=write_experts))
    model_dir = build_tiny_gpt_oss(str(tmp_path / "hf"), seed=3)
    path = str(tmp_path / "tiny-gpt-oss-q8_0.gguf")
    quantized.write_quantized_gguf(model_dir, path, gguf.GGMLQuantizationType.Q8_0, write_experts=gpt_oss_tensors(MXFP4))
    prompt = [[(7 * i) % 300 + 3 for i in range(70)]]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    llm = LLM(path, kv_cache_memory="16MiB")
    assert llm.config.quantization == "gguf"
    layer = llm.engine.runner.model.layers[0]
    assert type(layer.qkv_proj).__name__ == "GGUFWeight" and layer.qkv_proj.blocks.dtype == torch.uint8
    blocks = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    del llm
    dequantized = LLM(path, kv_cache_memory="16MiB", quantization="none").generate(prompt, params, use_tqdm=False)
    expected = dequantized[0].outputs[0]
    for token, logprob in expected.logprobs[0].items():
        assert abs(blocks.logprobs[0][token].logprob - logprob.logprob) < 0.05
