"""GGUF files of issue 39's families (gemma2, gemma3, phi3), written in the test as llama.cpp
writes them (Gemma's norms as 1 + w, Phi-3's fused projections and LongRoPE factor
tensors, the windows and soft caps as metadata), convert back to their Hugging Face models
and run equal to Hugging Face on the original (dequantized: F32) weights."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable

import numpy as np
import pytest

from actors import LLM, SamplingParams
from actors.models.loader import load_model_config, resolve_model
from tests.models.test_gguf_loader import private_cache, write_gguf  # noqa: F401 - private_cache is a fixture
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.models.test_sliding_window_matches_hf import _LONGROPE

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


def gemma_metadata(writer, config: dict) -> Callable:
    writer.add_sliding_window(config["sliding_window"])
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if config.get(key) is not None:
            add(config[key])
    # llama.cpp's RMSNorm multiplies by w: its convert script stores Gemma's 1 + w
    return lambda name, values: values + np.float32(1.0) if name.endswith("norm.weight") else values


def phi3_metadata(writer, config: dict) -> None:
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    rope = config["rope_parameters"]
    if rope.get("rope_type") == "longrope":  # as convert_hf_to_gguf.py's Phi3MiniModel writes it
        original = config["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(config["max_position_embeddings"] / original) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def use_original_tokenizer(model_dir: str, converted: str) -> None:
    """The tiny models' byte-level BPE vocabulary under a Gemma architecture is no tokenizer a
    real Gemma GGUF holds (SentencePiece's): transformers' Gemma converter rebuilds it without
    an unknown token, which detokenizing needs. The weights and config are what is tested here."""
    for file_name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model_dir, file_name), os.path.join(converted, file_name))


# (query_pre_attn_scalar is head_dim and Gemma 3's local base 10000: what llama.cpp assumes)
FAMILIES = {
    "gemma2": ("gemma2", gemma_metadata, dict(sliding_window=16, num_hidden_layers=3, query_pre_attn_scalar=16,
                                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                              tie_word_embeddings=True)),
    "gemma3": ("gemma3", gemma_metadata, dict(sliding_window=24, num_hidden_layers=7, query_pre_attn_scalar=16,
                                              tie_word_embeddings=True)),
    "phi3": ("phi3", phi3_metadata, dict(sliding_window=32, pad_token_id=0, rope_scaling=_LONGROPE,
                                         max_position_embeddings=2048, original_max_position_embeddings=700)),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_of_each_family_runs_equal_to_hugging_face(name, make_tiny_model, tmp_path, private_cache):  # noqa: F811
    arch, metadata, overrides = FAMILIES[name]
    model_dir = make_tiny_model(arch, **{"max_position_embeddings": 1024, **overrides})
    gguf_path = str(tmp_path / f"{name}.gguf")
    write_gguf(model_dir, gguf_path, metadata)
    converted = resolve_model(gguf_path)
    original, read_back = load_model_config(model_dir), load_model_config(converted)
    assert (read_back.architecture, read_back.sliding_windows) == (original.architecture, original.sliding_windows)
    if name == "phi3":  # (the factors went through float32)
        assert read_back.family["longrope"]["long_factor"] == original.family["longrope"]["long_factor"]
    else:
        assert read_back.family == original.family

    use_original_tokenizer(model_dir, converted)
    llm = LLM(converted, kv_cache_memory="64MiB", max_num_batched_tokens=48, block_size=8)
    prompts = make_prompts(original.vocab_size, [260, 31, 120], seed=43)
    expected_tokens, expected_logprobs = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens
    for output, steps in zip(outputs, expected_logprobs):
        for token, position, hf_logprobs in zip(output.outputs[0].token_ids, output.outputs[0].logprobs, steps):
            assert abs(position[token].logprob - float(hf_logprobs[token])) < 1e-3


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_quantized_gguf_of_each_family_runs_its_blocks(name, make_tiny_model, tmp_path, private_cache):  # noqa: F811
    """A Q8_0 file runs its blocks by default (--quantization auto): Phi-3's fused attn_qkv and
    ffn_up as the decoder's fused projections, each equal, dequantized, to the float path's."""
    import gguf
    import torch

    from kernels.gguf_linear import dequantize_reference
    from tests.quantization.test_gguf_quantized import write_quantized_gguf

    arch, _, overrides = FAMILIES[name]
    model_dir = make_tiny_model(arch, **{"max_position_embeddings": 1024, **overrides})
    path = str(tmp_path / f"{name}-q8_0.gguf")
    write_quantized_gguf(model_dir, path, gguf.GGMLQuantizationType.Q8_0)
    use_original_tokenizer(model_dir, resolve_model(path))
    llm = LLM(path, kv_cache_memory="16MiB", block_size=8)
    assert llm.config.quantization == "gguf"
    fp32 = LLM(path, quantization="none", kv_cache_memory="16MiB").engine.runner.model.layers
    for quantized, dense in zip(llm.engine.runner.model.layers, fp32):
        for projection in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weight = getattr(quantized, projection)
            assert torch.equal(dequantize_reference(weight.blocks, weight.ggml_type, weight.in_features),
                               getattr(dense, projection))
    outputs = llm.generate([list(range(5, 90))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 6
