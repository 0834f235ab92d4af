"""SmoothQuant-style smoothing before int8 W8A8 (actors/quantization/int8_smoothing.py): the
smoothed fp32 model computes the same function (each division folded exactly into the norm,
v_proj or up_proj before it), on Llama (GQA: q heads sharing a kv head share o_proj's
factors), Qwen2 (q/k/v biases) and Qwen3 (q/k norms); it moves an activation outlier into the
weights, where int8 with smoothing then stays nearer fp32 than without; and the engine's
`--quantization int8` runs smoothed weights (its fused step held to the torch reference by
test_int8_decoder.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors import LLM
from actors.quantization.int8_decoder import use_int8_weights
from actors.quantization.int8_smoothing import (CALIBRATION_TEXT, activation_maxima, calibration_token_ids,
                                                smooth_model)
from kernels.int8_gemm import int8_gemm_kernels
from tests.quantization.test_gguf_quantized import one_mixed_step, relative_error

# prompts alone, nothing cached: one_mixed_step fills cached keys and values at random, which
# smoothing would not have divided as the smoothed v_proj does
SHAPES = [(0, 11), (0, 6), (0, 1), (0, 17)]


def random_ids(count: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_smoothed_fp32_model_computes_the_same_logits(make_tiny_model, arch):
    runner = LLM(make_tiny_model(arch, intermediate_size=96), quantization="none", kv_cache_memory="16MiB",
                 block_size=4).engine.runner
    before, _ = one_mixed_step(runner, SHAPES, torch.Generator().manual_seed(3), reference=False)
    original = runner.model.layers
    smooth_model(runner.model, random_ids(64, 0))
    assert runner.model.layers is not original
    for old, new in zip(original, runner.model.layers):
        assert not torch.equal(old.input_norm, new.input_norm) and not torch.equal(old.down_proj, new.down_proj)
        assert not torch.equal(old.o_proj, new.o_proj)
    fused, op_by_op = one_mixed_step(runner, SHAPES, torch.Generator().manual_seed(3), reference=False)
    assert relative_error(fused, before) < 1e-5 and relative_error(op_by_op, before) < 1e-5


def test_an_activation_outlier_moves_into_the_weights_and_int8_stays_nearer_fp32(make_tiny_model):
    if int8_gemm_kernels() is None:
        pytest.skip("no C++ compiler")
    engine = dict(quantization="none", kv_cache_memory="16MiB", block_size=4)
    model_dir = make_tiny_model("llama", intermediate_size=96)
    runners = [LLM(model_dir, **engine).engine.runner for _ in range(3)]
    for runner in runners:  # an outlier channel in every normalized input, as real LLMs have
        runner.model.layers = [dataclasses.replace(layer, input_norm=layer.input_norm.clone().index_fill_(0, torch.tensor([5]), 40.0),
                                                   post_attention_norm=layer.post_attention_norm.clone().index_fill_(0, torch.tensor([9]), 40.0))
                               for layer in runner.model.layers]
    fp32, plain, smoothed = runners
    calibration = random_ids(64, 1)
    seen = activation_maxima(smoothed.model, calibration)[0]
    assert seen["qkv_proj"][5] > 5 * seen["qkv_proj"].median()
    plain.backend = use_int8_weights(plain.model, plain.backend)
    smoothed.backend = use_int8_weights(smoothed.model, smoothed.backend, calibration_ids=calibration)
    after = first_layer_input_maxima(smoothed)
    assert after[5] < seen["qkv_proj"][5] / 2  # the outlier shrank (moved into qkv_proj's column 5)
    logits = [one_mixed_step(runner, SHAPES, torch.Generator().manual_seed(4), reference=False)[0]
              for runner in runners]
    assert relative_error(logits[2], logits[0]) < relative_error(logits[1], logits[0])


def first_layer_input_maxima(runner) -> torch.Tensor:
    """Layer 0's normalized input maxima after smoothing: the smoothed norm weight over the
    original's times the original maxima (the norm is elementwise)."""
    layer = runner.model.layers[0]
    hidden = runner.model.embed_tokens[torch.tensor(random_ids(64, 1))]
    normalized = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + runner.model.config.rms_norm_eps)
    return (normalized * layer.input_norm).abs().amax(0)


def test_the_engine_smooths_with_the_shipped_calibration_text(tiny_llama_dir):
    assert open(CALIBRATION_TEXT, encoding="utf-8").read().strip()
    ids = calibration_token_ids(tiny_llama_dir)
    assert len(ids) > 100
    fp32 = LLM(tiny_llama_dir, quantization="none", kv_cache_memory="16MiB").engine.runner.model.layers
    int8 = LLM(tiny_llama_dir, quantization="int8", kv_cache_memory="16MiB").engine.runner.model.layers
    assert not torch.equal(fp32[0].input_norm, int8[0].input_norm)
