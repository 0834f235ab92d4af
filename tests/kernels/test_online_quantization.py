"""`--quantization fp8` (and int8 on CUDA) on an unquantized checkpoint: each projection
quantized at load (actors/quantization/online_gpu.py) and run by the Triton GEMMs.

On the CPU the engine refuses fp8 at start-up (it needs FP8 hardware), so the worker-level
pieces run directly under triton's interpreter: an unquantized engine on the Triton backend has
its projections quantized by use_online_weights, and its greedy tokens and logprobs equal
Hugging Face's on the checkpoint whose weights are the same FP8 values dequantized (the
Triton fallback on the CPU quantizes weights only). The `gpu` tests run the whole engine on
CUDA against its bf16 self."""

from __future__ import annotations

import os

import pytest
import torch

from actors import LLM, SamplingParams
from actors.engine.args import EngineArgs
from actors.quantization.checkpoint_gpu import Fp8Weight, PackedWeightBackend, W8A8Weight
from actors.quantization.online_check import OnlineQuantError, check_online_fp8
from actors.quantization.online_gpu import fp8_weight, quantize_fp8_per_tensor, use_online_weights
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.kernels.helpers import DEVICE, requires_cuda, requires_triton
from tests.quant_checkpoints import assert_matches_reference, quantize_fp8, write_quantized_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)


def recapture_graphs(runner) -> None:
    """On CUDA the decode graphs were captured at start-up over the float weights; the
    engine quantizes before it captures, so a test that swaps the weights afterwards
    captures again (else the replays would run the float projections)."""
    runner.graphs.drop()
    runner.graphs.prepare()


def test_per_tensor_fp8_of_each_fused_part():
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randn(32, 64, generator=generator) * scale for scale in (0.1, 3.0, 0.02)]
    fused = fp8_weight(torch.cat(parts), [32, 32, 32])
    for index, part in enumerate(parts):
        expected_weight, expected_scale, dequantized = quantize_fp8(part, per_channel=False)
        rows = slice(32 * index, 32 * (index + 1))
        assert torch.equal(fused.weight[rows].view(torch.uint8), expected_weight.view(torch.uint8))
        assert torch.equal(fused.scale[rows], expected_scale.expand(32))
        assert torch.allclose(fused.weight[rows].float() * fused.scale[rows, None], dequantized)
        # E4M3 keeps 3 mantissa bits: each weight within 1/16 of itself (or of the smallest step)
        assert ((dequantized - part).abs() <= part.abs() / 16 + expected_scale * 2 ** -9).all()
    q, scale = quantize_fp8_per_tensor(torch.zeros(4, 4))
    assert scale > 0 and not q.float().any()


def test_fp8_is_refused_at_start_up_where_it_cannot_run(tiny_llama_dir):
    if not torch.cuda.is_available():
        with pytest.raises(OnlineQuantError, match=r"quantization 'fp8' .* compute capability >= 8.9; the device"):
            EngineArgs(model=tiny_llama_dir, quantization="fp8").build()
    with pytest.raises(OnlineQuantError, match="quantization 'fp8'.*needs a CUDA device.*the CPU"):
        EngineArgs(model=tiny_llama_dir, quantization="fp8", device="cpu").build()
    with pytest.raises(OnlineQuantError, match=r"this GPU has 8.0"):
        check_online_fp8("cuda", 1, (8, 0))
    check_online_fp8("cuda", 1, (8, 9))
    check_online_fp8("auto", 1, (9, 0))


@requires_triton
def test_fp8_quantized_at_load_matches_the_dequantized_checkpoint(tiny_llama_dir, tmp_path):
    # the tests' FP8 checkpoint writer quantizes each q/k/v/o/gate/up/down per tensor as
    # use_online_weights does; its reference directory holds those weights dequantized
    reference = os.path.join(write_quantized_checkpoint(tiny_llama_dir, str(tmp_path), "fp8", per_channel=False),
                             "reference")
    prompts = make_prompts(256, [3, 11])
    expected, expected_logprobs = hf_greedy(reference, prompts, GREEDY.max_tokens)
    # (on CUDA too: in float32 fp8_linear takes the Triton weight-only kernel, as on the CPU)
    with LLM(tiny_llama_dir, attention_backend="triton", dtype="float32", kv_cache_memory="16MiB",
             device=DEVICE.type) as llm:
        runner = llm.engine.runner
        float_qkv = runner.model.layers[0].qkv_proj
        runner.backend = use_online_weights(runner.model, runner.backend, "fp8")
        recapture_graphs(runner)
        assert isinstance(runner.backend, PackedWeightBackend)
        layer = runner.model.layers[0]
        assert type(layer.qkv_proj) is Fp8Weight and layer.qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.qkv_proj.weight.shape == float_qkv.shape
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, expected, expected_logprobs)


@requires_triton
def test_int8_quantized_at_load_on_the_triton_path_matches_w8a8_reference(tiny_llama_dir, tmp_path):
    """The int8 path CUDA runs (per-channel int8 weights, activations int8 per token, the
    Triton GEMM), against Hugging Face's Llama whose linears compute the W8A8 reference on the
    same int8 weights (the tests' compressed-tensors int8 writer quantizes as the CPU's int8)."""
    from tests.kernels.test_quant_checkpoint_triton_path import w8a8_reference_linears

    out = write_quantized_checkpoint(tiny_llama_dir, str(tmp_path), "compressed-tensors-int8", per_channel=True)
    prompts = make_prompts(256, [3, 11])
    with w8a8_reference_linears(os.path.join(out, "reference"), os.path.join(out, "quantized")):
        expected, expected_logprobs = hf_greedy(os.path.join(out, "reference"), prompts, GREEDY.max_tokens)
    with LLM(tiny_llama_dir, attention_backend="triton", dtype="float32", kv_cache_memory="16MiB",
             device=DEVICE.type) as llm:
        runner = llm.engine.runner
        runner.backend = use_online_weights(runner.model, runner.backend, "int8")
        recapture_graphs(runner)
        assert type(runner.model.layers[0].gate_up_proj) is W8A8Weight
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, expected, expected_logprobs)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("method,kind", [("fp8", Fp8Weight), ("int8", W8A8Weight)])
def test_quantized_at_load_on_cuda_in_bf16_follows_bf16(method, kind, tiny_llama_dir):
    """The whole engine on CUDA in bf16 (fp8: torch._scaled_mm with activations per token),
    teacher-forced against its unquantized bf16 self. A tiny random model amplifies
    quantization noise (8-bit weights alone leave ~77% of its top-1 choices, measured in
    fp32 on the CPU), so this only catches a broken path (garbage, NaN, a wrong scale): the
    numbers are checked by the float32 tests above, which run on CUDA too."""
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    windows = make_prompts(384, [128] * 4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = {}
    for quantization in (None, method):
        with LLM(tiny_llama_dir, quantization=quantization, dtype="bfloat16", device="cuda",
                 kv_cache_memory="256MiB") as llm:
            if quantization is not None:
                assert type(llm.engine.runner.model.layers[0].down_proj) is kind
            outputs = llm.generate(windows, params, use_tqdm=False)
        scored[quantization] = [
            (position[token].logprob, next(t for t, logprob in position.items() if logprob.rank == 1))
            for window, output in zip(windows, outputs) for token, position in
            zip(window[1:], output.prompt_logprobs[1:])]
    pairs = list(zip(scored[method], scored[None]))
    agreement = sum(q[1] == b[1] for q, b in pairs) / len(pairs)
    mean_difference = sum(abs(q[0] - b[0]) for q, b in pairs) / len(pairs)
    assert all(q[0] == q[0] and q[0] > -1e4 for q, _ in pairs)  # finite
    assert agreement >= 0.5 and mean_difference < 0.5, (agreement, mean_difference)
