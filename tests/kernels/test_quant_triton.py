"""The quantized-checkpoint GEMMs (kernels/quant_triton.py) against plain torch: the packed
layouts' dequantization (kernels/quant_ref.py) times x, the FP8 weights' torch conversion,
and the int8 W8A8 reference of actors/quantization/linear.py. Small shapes with ragged
edges (rows, columns and inputs not multiples of the tiles), under the interpreter on a CPU."""

from __future__ import annotations

import pytest
import torch

from actors.layers.quant_linear import Int8Weight, int8_linear_reference
from kernels.int8_linear import quantize_rows_reference
from kernels.quant_ref import dequantize_awq, dequantize_gptq, dequantize_packed
from kernels.quant_triton import fp8_linear, fp8_weight_gemm, int8_scaled_gemm, int_group_gemm, quantize_fp8_rows
from tests.kernels.helpers import DEVICE, assert_close, generator, requires_cuda, requires_triton
from tests.quant_checkpoints import _group_of, _quantize_module

pytestmark = requires_triton


def _packed(fmt: str, out_features: int, in_features: int, bits: int, group_size: int, desc_act: bool, seed: int):
    """A random weight quantized into fmt's tensors (on DEVICE), g_idx [in] int32, and the
    float32 weight those tensors dequantize to by kernels/quant_ref.py."""
    w = torch.randn(out_features, in_features, generator=generator(seed)) * 0.1
    parts, _ = _quantize_module(w, fmt, bits, group_size, fmt != "awq", desc_act, False, generator(seed + 1))
    g_idx = parts.get("g_idx", parts.get("weight_g_idx"))
    if g_idx is None:
        g_idx = _group_of(in_features, group_size, False, generator(0)).to(torch.int32)
    if fmt == "gptq":
        dequantized = dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"], bits, group_size, g_idx)
        tensors = (parts["qweight"], parts["scales"], parts["qzeros"])
    elif fmt == "awq":
        dequantized = dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"], group_size)
        tensors = (parts["qweight"], parts["scales"], parts["qzeros"])
    else:
        dequantized = dequantize_packed(parts["weight_packed"], parts["weight_scale"], bits, group_size, g_idx)
        tensors = (parts["weight_packed"], parts["weight_scale"], None)
    return [t.to(DEVICE) if t is not None else None for t in tensors], g_idx.to(DEVICE), dequantized


@pytest.mark.parametrize("fmt,bits,group_size,desc_act", [
    ("gptq", 4, 32, False), ("gptq", 4, 32, True), ("gptq", 8, -1, False),
    ("awq", 4, 32, False), ("compressed-tensors", 4, 32, True), ("compressed-tensors", 8, -1, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int_group_gemm_matches_the_dequantized_weight(fmt, bits, group_size, desc_act, dtype):
    out_features, in_features, rows = 40, 96, 19  # 40 columns: a partial tile of 32
    (qweight, scales, qzeros), g_idx, dequantized = _packed(fmt, out_features, in_features, bits, group_size,
                                                            desc_act, seed=3)
    x = torch.randn(rows, in_features, generator=generator(5)).to(dtype)
    bias = torch.randn(out_features, generator=generator(6)).to(dtype)
    layout = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "pack"}[fmt]
    actual = int_group_gemm(x.to(DEVICE), layout, bits, qweight, scales, qzeros, g_idx, out_features,
                            bias.to(DEVICE))
    expected = (x.double() @ dequantized.double().T + bias.double()).to(dtype)
    assert_close(actual.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weight_gemm_decodes_e4m3_bits(dtype):
    out_features, in_features, rows = 36, 72, 5
    # every E4M3 byte but NaN (0x7f, 0xff): normals, subnormals, both zeros, both signs
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    picks = torch.randint(0, len(codes), (out_features, in_features), generator=generator(1))
    weight = codes[picks].view(torch.float8_e4m3fn)
    scale = torch.rand(out_features, generator=generator(2)) * 0.01 + 1e-3
    x = torch.randn(rows, in_features, generator=generator(3)).to(dtype)
    actual = fp8_weight_gemm(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE))
    expected = (x.double() @ (weight.double() * scale.double()[:, None]).T).to(dtype)
    assert_close(actual.cpu(), expected)


def test_int8_scaled_gemm_matches_the_w8a8_reference():
    out_features, in_features, rows = 40, 80, 18
    w = torch.randn(out_features, in_features, generator=generator(1))
    wq, w_scale = quantize_rows_reference(w)
    x = torch.randn(rows, in_features, generator=generator(2))
    bias = torch.randn(out_features, generator=generator(3))
    xq, x_scale = quantize_rows_reference(x)
    actual = int8_scaled_gemm(xq.to(DEVICE), x_scale.to(DEVICE), wq.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE))
    expected = int8_linear_reference(x, Int8Weight(wq, w_scale.view(-1)), bias)
    assert_close(actual.cpu(), expected)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_int_group_gemm_compiles_on_cuda_at_a_decode_and_a_prefill_shape(fmt):
    (qweight, scales, qzeros), g_idx, dequantized = _packed(fmt, 512, 1024, 4, 128, False, seed=7)
    layout = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "pack"}[fmt]
    for rows in (1, 300):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        actual = int_group_gemm(x, layout, 4, qweight, scales, qzeros, g_idx, 512)
        expected = (x.float() @ dequantized.cuda().T).to(torch.bfloat16)
        torch.testing.assert_close(actual, expected, rtol=3e-2, atol=3e-2)


@requires_cuda
@pytest.mark.gpu
def test_fp8_linear_on_cuda_scaled_mm_or_fallback():
    w = torch.randn(256, 512, device="cuda") * 0.05
    scale = (w.abs().amax(1) / 448.0).float()
    weight = (w / scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    # the oracle quantizes the activations per token as _scaled_mm's path does (E4M3's 3 mantissa
    # bits are the error that matters here, not the GEMM's); the Triton fallback quantizes none
    x_fp8, x_scale = quantize_fp8_rows(x)
    activations = x_fp8.float() * x_scale if torch.cuda.get_device_capability() >= (8, 9) else x.float()
    expected = (activations @ (weight.float() * scale[:, None]).T).to(torch.bfloat16)
    torch.testing.assert_close(fp8_linear(x, weight, scale), expected, rtol=2e-2, atol=2e-2)
