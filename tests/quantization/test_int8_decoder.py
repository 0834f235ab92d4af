"""--quantization int8 for decoders on the CPU (W8A8: actors/quantization/int8_decoder.py,
kernels/int8_gemm.cpp). The VNNI kernel's int32 sums equal torch's integer matmul exactly
(and so do the portable fallback's), its float outputs the reference epilogue's to float
rounding; a step's logits through the fused C++ step equal a plain torch reference (the same
int8 weights dequantized, each linear's input quantized per row the same way) within 1e-3,
on tiny Llama, Qwen2 (biases) and Qwen3 (q/k norms); the actor processes generate what the
in-process engine does; where it cannot run it fails at start-up, naming what it needs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors import LLM, AsyncClient, SamplingParams
from actors.engine.args import EngineArgs
from actors.quantization.int8_check import Int8Error
from actors.quantization.int8_decoder import PROJECTIONS, Int8CpuBackend, int8_linear_reference, use_int8_weights
from kernels.int8_gemm import PackedInt8Weight, int8_gemm_kernels
from kernels.int8_linear import quantize_rows_reference
from tests.quantization.test_gguf_quantized import relative_error
from tests.models.test_llm_matches_hf import make_prompts
from tests.quantization.test_gguf_quantized import one_mixed_step as gguf_mixed_step


@pytest.fixture(scope="module")
def kernels():
    found = int8_gemm_kernels()
    if found is None:
        pytest.skip("no C++ compiler")
    return found


# rows: 1 (decode), 7 (a partial 6-row tile), 13; out/in features: whole blocks, and a last
# block of 16 channels and 4 inputs cut short; 64 x 1536 and 256 rows as SmolLM2's down_proj
@pytest.mark.parametrize("rows,out_features,in_features", [
    (1, 96, 64), (7, 50, 70), (13, 200, 36), (64, 576, 1536), (256, 960, 576)])
def test_int32_sums_equal_torch_integer_matmul_and_outputs_the_epilogue(kernels, rows, out_features,
                                                                         in_features):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, :5] = 0.0  # zeros among the values; and a row of zeros where there are several rows
    if rows > 2:
        x[2] = 0.0
    packed = kernels.pack(weight)
    qweight, scale = quantize_rows_reference(weight)
    assert torch.equal(packed.qweight, qweight) and torch.equal(packed.scale[:out_features], scale.view(-1))
    qx, x_scale = quantize_rows_reference(x)
    expected = qx.int() @ qweight.int().T  # exact: |sum| < 127 * 127 * in_features
    assert torch.equal(kernels.gemm_int32(qx.contiguous(), packed), expected)
    assert torch.equal(kernels.gemm_int32(qx.contiguous(), packed, portable=True), expected)
    bias = torch.randn(out_features, generator=generator)
    epilogue = expected.double() * x_scale.double() * scale.view(-1).double() + bias.double()
    out = kernels.linear(x, packed, bias)
    assert torch.allclose(out.double(), epilogue, rtol=1e-6, atol=1e-5 * epilogue.abs().max().item())
    assert relative_error(out, int8_linear_reference(x, packed, bias)) < 1e-5
    strided = torch.randn(rows, in_features + 8, generator=generator)[:, :in_features]  # a row stride
    assert torch.equal(kernels.linear(strided, packed), kernels.linear(strided.contiguous(), packed))


class ReferenceBackend(Int8CpuBackend):
    """The op-by-op forward with each int8 linear as the plain torch reference."""

    def linear(self, x, weight, bias=None):
        if not isinstance(weight, PackedInt8Weight):
            return super().linear(x, weight, bias)
        return int8_linear_reference(x, weight, bias)


def one_mixed_step(runner, shapes, generator, reference: bool = True):
    """test_gguf_quantized's step (fused, and op by op), the reference linears int8's."""
    from tests.quantization import test_gguf_quantized

    original = test_gguf_quantized.ReferenceBackend
    test_gguf_quantized.ReferenceBackend = ReferenceBackend
    try:
        return gguf_mixed_step(runner, shapes, generator, reference)
    finally:
        test_gguf_quantized.ReferenceBackend = original


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_decoder_logits_match_the_torch_reference(make_tiny_model, arch):
    # 96 intermediate features: down_proj's 96 inputs, gate_up's 192 outputs (whole 64-column
    # panels and a part one); qwen2's q/k/v biases go through the kernel's epilogue
    model_dir = make_tiny_model(arch, intermediate_size=96)
    llm = LLM(model_dir, quantization="int8", kv_cache_memory="16MiB", block_size=4)
    runner = llm.engine.runner
    assert llm.config.quantization == "int8" and isinstance(runner.backend, Int8CpuBackend)
    assert all(isinstance(getattr(layer, name), PackedInt8Weight) for layer in runner.model.layers
               for name in PROJECTIONS)
    assert isinstance(runner.model.lm_head, torch.Tensor)  # (QUANTIZE_LM_HEAD)
    assert runner.model_step is not None
    generator = torch.Generator().manual_seed(0)
    # decodes only, then decodes with prefill chunks (more rows than a register tile); then
    # with the LM head in int8 too
    for shapes in ([(9, 1), (16, 1), (3, 1)], [(9, 1), (16, 1), (3, 1), (0, 11), (7, 6)], [(9, 1), (0, 11)]):
        if len(shapes) == 2:
            use_int8_weights(runner.model, runner.backend, lm_head=True)
            assert isinstance(runner.model.lm_head, PackedInt8Weight)
        fused, reference = one_mixed_step(runner, shapes, generator)
        assert relative_error(fused, reference) < 1e-3
    fp32 = LLM(model_dir, quantization="none", kv_cache_memory="16MiB", block_size=4).engine.runner
    # prompts alone: cached values filled at random are not divided as smoothed v_proj's are
    fused, fp32_logits = one_mixed_step(fp32, [(0, 9), (0, 11)], torch.Generator().manual_seed(2), reference=False)
    quantized, _ = one_mixed_step(runner, [(0, 9), (0, 11)], torch.Generator().manual_seed(2), reference=False)
    assert 0 < relative_error(quantized, fused) < 0.1  # int8 ran, and stays near fp32


async def test_actor_processes_generate_what_the_in_process_engine_does(make_tiny_model):
    """Per-row activation scales and exact int32 sums: a row's result does not depend on what
    else the step batches, so the two engines' greedy tokens agree whatever they schedule."""
    model_dir = make_tiny_model("llama")
    prompts = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 3, 9, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine = dict(kv_cache_memory="16MiB", seed=0)
    in_process = LLM(model_dir, quantization="int8", **engine).generate(prompts, params, use_tqdm=False)
    fp32 = LLM(model_dir, quantization="none", **engine).generate(prompts, params, use_tqdm=False)
    async with asyncio.timeout(180):
        async with AsyncClient(model_dir, quantization="int8", **engine) as client:
            served = await client.generate_batch(prompts, params, use_tqdm=False)
    tokens = [[o.outputs[0].token_ids for o in outputs] for outputs in (in_process, served)]
    assert tokens[0] == tokens[1]
    logprobs = [[o.outputs[0].cumulative_logprob for o in outputs] for outputs in (in_process, fp32)]
    assert logprobs[0] != logprobs[1]


def test_int8_decoders_are_refused_where_they_cannot_run(tiny_llama_dir):
    with pytest.raises(Int8Error, match="needs dtype 'float32'"):
        EngineArgs(model=tiny_llama_dir, quantization="int8", dtype="bfloat16").build()
    if not torch.cuda.is_available():  # (on CUDA: the Triton W8A8 GEMM, tests/kernels/test_online_quantization.py)
        with pytest.raises(Int8Error, match=r"on device 'cuda' needs a CUDA device; none is visible"):
            EngineArgs(model=tiny_llama_dir, quantization="int8", device="cuda").build()
    with pytest.raises(Int8Error, match="needs pipeline_parallel_size 1"):
        EngineArgs(model=tiny_llama_dir, quantization="int8", pipeline_parallel_size=2).build()
    assert EngineArgs(model=tiny_llama_dir, quantization="int8").build().quantization == "int8"


def test_tensor_parallel_int8_follows_one_device(tiny_llama_dir):
    """Each rank smooths with one device's factors and quantizes its shards (the row-parallel
    o/down slices get scales of their own, their inputs quantized over the rank's slice, as
    vLLM's W8A8 does): not the same integers as one device, so the tokens are held to one
    device's mostly, the logprobs closely."""
    prompts = make_prompts(256, [5, 21, 9])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = []
    for tensor_parallel_size in (1, 2):
        with LLM(tiny_llama_dir, quantization="int8", kv_cache_memory="16MiB",
                 tensor_parallel_size=tensor_parallel_size) as llm:
            runs.append(llm.generate(prompts, params, use_tqdm=False))
    one, two = ([o.outputs[0] for o in outputs] for outputs in runs)
    first = [(a.token_ids[0], b.token_ids[0]) for a, b in zip(one, two)]
    assert all(a == b for a, b in first)
    agreement = sum(x == y for a, b in zip(one, two) for x, y in zip(a.token_ids, b.token_ids)) / (8 * len(prompts))
    assert agreement >= 0.75
    for a, b in zip(one, two):
        token = a.token_ids[0]
        assert abs(a.logprobs[0][token].logprob - b.logprobs[0][token].logprob) < 0.05


class CheckingBackend(Int8CpuBackend):
    """The kernel's linears, each checked against the reference on the same input."""

    errors: list[float] = []

    def linear(self, x, weight, bias=None):
        out = super().linear(x, weight, bias)
        if isinstance(weight, PackedInt8Weight):
            self.errors.append(relative_error(out, int8_linear_reference(x, weight, bias)))
        return out


def test_smollm2_linears_match_the_torch_reference(smollm2_dir):
    """As test_gguf_quantized's SmolLM2 test says, 30 layers measure the model's sensitivity
    (one activation rounded to the other int8 value grows layer by layer) more than the
    kernel: every linear of a real step is held to the reference on its own input, and the
    fused step to the op-by-op forward (perplexity and greedy agreement with fp32:
    benchmarks/quality.py, docs/quantization.md)."""
    llm = LLM(smollm2_dir, quantization="int8", kv_cache_memory="64MiB", block_size=4)
    runner = llm.engine.runner
    model = runner.model
    quantized_backend = model.backend
    model.backend = CheckingBackend(quantized_backend, quantized_backend.kernels)
    try:
        for shapes in ([(20, 1), (5, 1)], [(20, 1), (5, 1), (3, 12)]):
            CheckingBackend.errors = []
            fused, op_by_op = one_mixed_step(runner, shapes, torch.Generator().manual_seed(1), reference=False)
            assert len(CheckingBackend.errors) == 4 * 30 and max(CheckingBackend.errors) < 1e-3
            assert relative_error(fused, op_by_op) < 1e-5
    finally:
        model.backend = quantized_backend
