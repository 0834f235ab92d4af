"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) on the CPU: tiny random Llamas
quantized in the test into each format's layout (tests/quant_checkpoints.py) run through the
engine, their weights dequantized at load; greedy tokens equal, and logprobs within 1e-3
relative of, Hugging Face transformers running the same dequantized weights as a float
checkpoint. Every unsupported variant fails at start-up, naming its field."""

from __future__ import annotations

import json
import os

import pytest
import torch

from actors import LLM, SamplingParams
from actors.engine.args import EngineArgs
from actors.config.quantization import QuantConfigError
from actors.quantization.gguf import GGUFWeight
from kernels.gguf_linear import dequantize_reference
from tests.quantization.test_gguf_quantized import one_mixed_step, relative_error
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.quant_checkpoints import assert_matches_reference, write_quantized_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
LENGTHS = [3, 17, 40]

CASES = {
    "gptq-4bit-g32": ("gptq", dict(bits=4, group_size=32, sym=False)),
    "gptq-4bit-sym-g32": ("gptq", dict(bits=4, group_size=32, sym=True)),
    "gptq-4bit-sym-desc_act": ("gptq", dict(bits=4, group_size=32, sym=True, desc_act=True)),
    "gptq-8bit-channel": ("gptq", dict(bits=8, group_size=-1, sym=False)),
    "awq-4bit-g32": ("awq", dict(group_size=32, sym=False)),
    "ct-int4-g32-actorder": ("compressed-tensors", dict(bits=4, group_size=32, desc_act=True)),
    "ct-int4-g32": ("compressed-tensors", dict(bits=4, group_size=32)),
    "ct-int8-channel": ("compressed-tensors", dict(bits=8, group_size=-1)),
    "ct-fp8-channel": ("compressed-tensors-fp8", dict(per_channel=True)),
    "ct-int8-w8a8": ("compressed-tensors-int8", dict(per_channel=True)),  # activations float on the CPU
    "fp8-tensor": ("fp8", dict(per_channel=False)),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, tmp_path_factory):
    built = {}

    def make(case: str) -> tuple[str, str]:
        if case not in built:
            fmt, options = CASES[case]
            out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path_factory.mktemp(case)), fmt, **options)
            built[case] = (os.path.join(out, "quantized"), os.path.join(out, "reference"))
        return built[case]

    return make


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_the_dequantized_weights(case, checkpoints):
    """Float activations: cases whose integers make GGUF blocks run on the torch backend,
    which keeps the dequantized weights (test_gguf_blocks_... has the blocks)."""
    quantized, reference = checkpoints(case)
    backend = "torch" if case in GGUF_BLOCK_CASES else "auto"
    llm = LLM(quantized, kv_cache_memory="64MiB", attention_backend=backend)
    assert llm.config.quantization == CASES[case][0].removesuffix("-fp8").removesuffix("-int8")
    assert not isinstance(llm.engine.runner.model.layers[0].qkv_proj, GGUFWeight)
    prompts = make_prompts(llm.config.model.vocab_size, LENGTHS)
    expected, expected_logprobs = hf_greedy(reference, prompts, GREEDY.max_tokens)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, expected, expected_logprobs)


# the cases whose integers are GGUF blocks on the CPU, exactly: Q4_0 where the zero point is 8
GGUF_BLOCK_CASES = {"gptq-4bit-g32": "Q8_0", "awq-4bit-g32": "Q8_0", "ct-int8-channel": "Q8_0",
                    "gptq-4bit-sym-g32": "Q4_0", "ct-int4-g32": "Q4_0"}


@pytest.mark.parametrize("case", list(GGUF_BLOCK_CASES))
def test_gguf_blocks_hold_the_weights_exactly_and_run_on_the_cpu_kernels(case, checkpoints):
    """The blocks, dequantized by the gguf package, are the reference's float weights bit for
    bit; a step's logits through the fused C++ step equal the op-by-op forward with torch
    reference linears (activations quantized per block of 32 as the kernel does) within 1e-3."""
    from safetensors.torch import load_file

    quantized, reference = checkpoints(case)
    llm = LLM(quantized, kv_cache_memory="16MiB", block_size=4)
    runner = llm.engine.runner
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv_proj, GGUFWeight) and layer.qkv_proj.type_name == GGUF_BLOCK_CASES[case]
    assert runner.model_step is not None
    floats = load_file(os.path.join(reference, "model.safetensors"))
    expected = torch.cat([floats[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    weight = layer.qkv_proj
    assert torch.equal(dequantize_reference(weight.blocks, weight.ggml_type, weight.in_features), expected)
    generator = torch.Generator().manual_seed(0)
    for shapes in ([(9, 1), (16, 1), (3, 1)], [(9, 1), (3, 1), (0, 11), (7, 6)]):
        fused, reference_logits = one_mixed_step(runner, shapes, generator)
        assert relative_error(fused, reference_logits) < 1e-3


def test_a_projection_left_float_runs_every_projection_dequantized(tiny_llama_dir, tmp_path):
    """AWQ's modules_to_not_convert: that projection stays float; the GGUF blocks need every
    fused group quantized alike, so the model runs dequantized, as Hugging Face does."""
    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path), "awq", group_size=32, sym=False,
                                     keep_float=("model.layers.1.mlp.down_proj",))
    llm = LLM(os.path.join(out, "quantized"), kv_cache_memory="64MiB")
    assert isinstance(llm.engine.runner.model.layers[0].qkv_proj, torch.Tensor)
    prompts = make_prompts(llm.config.model.vocab_size, LENGTHS)
    expected, expected_logprobs = hf_greedy(os.path.join(out, "reference"), prompts, GREEDY.max_tokens)
    assert_matches_reference(llm.generate(prompts, GREEDY, use_tqdm=False), expected, expected_logprobs)


def test_quantized_weights_differ_from_the_float_model(checkpoints, tiny_llama_dir):
    """The reference is not the float model itself: the quantizer moved the weights."""
    from safetensors.torch import load_file

    _, reference = checkpoints("awq-4bit-g32")
    original = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    dequantized = load_file(os.path.join(reference, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(original[name], dequantized[name])
    assert torch.allclose(original[name], dequantized[name], atol=0.1)


def _with_config(quantized_dir: str, tmp_path, **changes) -> str:
    """A copy of a quantized checkpoint's directory with quantization_config fields changed."""
    import shutil

    target = str(tmp_path / "changed")
    shutil.copytree(quantized_dir, target)
    path = os.path.join(target, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return target


@pytest.mark.parametrize("case,changes,message", [
    ("gptq-4bit-g32", {"bits": 3}, "bits=3"),
    ("gptq-4bit-g32", {"checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
    ("gptq-4bit-g32", {"group_size": 12}, "group_size=12"),
    ("awq-4bit-g32", {"zero_point": False}, "zero_point=False"),
    ("awq-4bit-g32", {"version": "gemv"}, "version='gemv'"),
    ("fp8-tensor", {"activation_scheme": "static"}, "activation_scheme='static'"),
    ("fp8-tensor", {"weight_block_size": [128, 128]}, "weight_block_size=[128, 128]"),
    ("ct-int8-channel", {"format": "marlin-24"}, "format='marlin-24'"),
    ("ct-int8-channel", {"quantization_status": "frozen"}, "quantization_status='frozen'"),
    ("ct-int8-channel", {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme="),
    ("ct-int8-channel", {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config="),
    ("fp8-tensor", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
])
def test_unsupported_variants_fail_at_start_up_naming_the_field(case, changes, message, checkpoints, tmp_path):
    quantized, _ = checkpoints(case)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineArgs(model=_with_config(quantized, tmp_path, **changes)).build()


def test_compressed_tensors_asymmetric_static_and_group_size_per_rank_are_refused(checkpoints, tmp_path):
    quantized, _ = checkpoints("ct-int4-g32-actorder")
    config_path = os.path.join(quantized, "config.json")
    with open(config_path) as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    groups["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(QuantConfigError, match=r"config_groups.group_0.weights.symmetric=False"):
        EngineArgs(model=_with_config(quantized, tmp_path, config_groups=groups)).build()
    w8a8, _ = checkpoints("ct-int8-w8a8")
    with open(os.path.join(w8a8, "config.json")) as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    groups["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(QuantConfigError, match=r"config_groups.group_0.input_activations=.*'dynamic': False"):
        EngineArgs(model=_with_config(w8a8, tmp_path / "static", config_groups=groups)).build()
    # 64 attention features over 4 ranks: 16 per rank, not whole groups of 32
    gptq, _ = checkpoints("gptq-4bit-g32")
    with pytest.raises(QuantConfigError, match=r"group_size=32 does not divide o_proj's 16 input features per rank"):
        EngineArgs(model=gptq, tensor_parallel_size=4).build()


def test_flag_against_the_checkpoint(checkpoints, tiny_llama_dir):
    gptq, _ = checkpoints("gptq-4bit-g32")
    with pytest.raises(QuantConfigError, match="quantization 'awq' does not match .* quant_method 'gptq'"):
        EngineArgs(model=gptq, quantization="awq").build()
    for flag in (None, "none", "auto", "gptq"):
        assert EngineArgs(model=gptq, quantization=flag).build().quantization == "gptq"
    with pytest.raises(QuantConfigError, match="quantization 'awq' needs a checkpoint quantized so"):
        EngineArgs(model=tiny_llama_dir, quantization="awq").build()
    # (fp8 on a float checkpoint quantizes at load: tests/kernels/test_online_quantization.py)


def test_tensor_parallel_runs_the_dequantized_shards(checkpoints):
    quantized, reference = checkpoints("gptq-4bit-g32")
    prompts = make_prompts(256, [5, 21])
    expected, _ = hf_greedy(reference, prompts, GREEDY.max_tokens)
    with LLM(quantized, kv_cache_memory="64MiB", tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
