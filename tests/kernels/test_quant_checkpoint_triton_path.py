"""The Triton path of quantized checkpoints (actors/quantization/checkpoint_gpu.py): the
engine on the Triton backend keeps the checkpoint's packed weights and runs them through
kernels/quant_triton.py; on a CPU, under triton's interpreter (tests/kernels/conftest.py).
Greedy tokens and logprobs equal Hugging Face's on the dequantized weights, and each
tensor-parallel slice of a packed weight multiplies as the same slice of the dequantized one."""

from __future__ import annotations

import contextlib
import functools
import os
import unittest.mock

import pytest
import torch

from actors import LLM, SamplingParams
from actors.config.quantization import CheckpointQuant
from actors.quantization.checkpoint_gpu import (Fp8Weight, PackedWeight, PackedWeightBackend, W8A8Weight, fuse,
                                                slice_module)
from actors.layers.quant_linear import Int8Weight, int8_linear_reference
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.kernels.helpers import DEVICE, generator, requires_triton
from tests.quant_checkpoints import assert_matches_reference, _quantize_module, write_quantized_checkpoint

pytestmark = requires_triton

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("fmt,options", [
    ("gptq", dict(bits=4, group_size=32, sym=False)),
    ("awq", dict(group_size=32, sym=False)),
    ("compressed-tensors", dict(bits=4, group_size=32)),
    ("fp8", dict(per_channel=True)),
    ("compressed-tensors-int8", dict(per_channel=True)),  # W8A8
])
def test_triton_backend_runs_the_packed_weights(fmt, options, tiny_llama_dir, tmp_path):
    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path), fmt, **options)
    quantized, reference = os.path.join(out, "quantized"), os.path.join(out, "reference")
    prompts = make_prompts(256, [3, 11])
    if fmt == "compressed-tensors-int8":  # W8A8: Hugging Face's linears quantize activations alike
        with w8a8_reference_linears(reference, quantized):
            expected, expected_logprobs = hf_greedy(reference, prompts, GREEDY.max_tokens)
    else:
        expected, expected_logprobs = hf_greedy(reference, prompts, GREEDY.max_tokens)
    # on CUDA (a `gpu` run) the compiled kernels, in float32 (tl.dot in IEEE precision, not tf32)
    with LLM(quantized, attention_backend="triton", dtype="float32", kv_cache_memory="16MiB",
             device=DEVICE.type) as llm:
        runner = llm.engine.runner
        assert isinstance(runner.backend, PackedWeightBackend)
        kind = {"fp8": Fp8Weight, "compressed-tensors-int8": W8A8Weight}.get(fmt, PackedWeight)
        assert type(runner.model.layers[0].qkv_proj) is kind
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, expected, expected_logprobs)


@contextlib.contextmanager
def w8a8_reference_linears(reference: str, quantized: str):
    """Hugging Face's Llama, while it is loaded from reference, with each int8-quantized
    projection computing int8_linear_reference (activations int8 per token, the checkpoint's
    int8 weights and scales, in float64)."""
    from safetensors.torch import load_file
    from transformers.models.llama import modeling_llama

    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    original = modeling_llama.LlamaForCausalLM.from_pretrained

    def linear(x, weight, bias):
        return int8_linear_reference(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], -1)

    def loading(*args, **kwargs):
        model = original(*args, **kwargs)
        for name, module in model.named_modules():
            if f"{name}.weight_scale" in tensors:
                weight = Int8Weight(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"].view(-1))
                module.forward = functools.partial(linear, weight=weight, bias=module.bias)
        return model

    with unittest.mock.patch.object(modeling_llama.LlamaForCausalLM, "from_pretrained", loading):
        yield


QUANTS = {
    "gptq": CheckpointQuant("gptq", "gptq", 4, 32, sym=False, desc_act=True),
    "awq": CheckpointQuant("awq", "awq", 4, 32, sym=False),
    "compressed-tensors": CheckpointQuant("compressed-tensors", "pack", 4, 32, desc_act=True),
    "fp8": CheckpointQuant("fp8", "fp8", 8, 0),
}


@pytest.mark.parametrize("fmt", list(QUANTS))
def test_tensor_parallel_slices_multiply_as_the_dequantized_slices(fmt):
    quant = QUANTS[fmt]
    out_features, in_features = 48, 128
    w = torch.randn(out_features, in_features, generator=generator(1)) * 0.1
    parts, dequantized = _quantize_module(w, fmt, 4, 32, fmt == "compressed-tensors", quant.desc_act, True,
                                          generator(2))
    parts, dequantized = {name: t.to(DEVICE) for name, t in parts.items()}, dequantized.to(DEVICE)
    x = torch.randn(5, 64, generator=generator(3)).to(DEVICE)
    backend = PackedWeightBackend(None)
    # column-parallel: output features 16..40; row-parallel: input features 64..128
    columns = slice_module(parts, quant, 0, 16, 40, in_features)
    rows = slice_module(parts, quant, 1, 64, 128, in_features)
    x_full = torch.randn(5, in_features, generator=generator(4)).to(DEVICE)
    torch.testing.assert_close(backend.linear(x_full, columns), x_full @ dequantized[16:40].T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(backend.linear(x, rows), x @ dequantized[:, 64:].T, rtol=1e-4, atol=1e-4)
    # fused: the two column slices side by side
    both = fuse([slice_module(parts, quant, 0, 0, 16, in_features), columns], "fused")
    torch.testing.assert_close(backend.linear(x_full, both), x_full @ dequantized[:40].T, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's gloo ranks, the kernels interpreted")
async def test_tensor_parallel_ranks_run_their_packed_slices(tiny_llama_dir, tmp_path, monkeypatch):
    from tests.worker.test_tensor_parallel import greedy_tokens

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the worker processes interpret the kernels too
    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path), "gptq", bits=4, group_size=32, sym=False)
    quantized, reference = os.path.join(out, "quantized"), os.path.join(out, "reference")
    prompts = make_prompts(256, [5, 12])
    expected, _ = hf_greedy(reference, prompts, 10)  # greedy_tokens' 10 tokens
    tokens, ready = await greedy_tokens(quantized, prompts, tensor_parallel_size=2, attention_backend="triton",
                                        dtype="float32", kv_cache_memory="16MiB")
    assert tokens == expected
    with LLM(reference, kv_cache_memory="16MiB") as llm:
        float_bytes = llm.engine.runner.model.num_weight_bytes()
    # each rank: half the float embeddings and head, and its packed slices, ~1/6 of their floats
    assert len(ready) == 2 and all(info["weight_bytes"] < 0.4 * float_bytes for info in ready.values())
