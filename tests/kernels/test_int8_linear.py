"""The int8 (W8A8) linear layer: the C++ quantization and epilogue against their torch
references, and Int8Linear against the dequantize-in-float64 oracle and plain fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.quantization import check_quantization
from actors.layers.quant_linear import ROW_BLOCK, Int8Linear, Int8Weight, int8_linear_reference, linear_method
from kernels.int8_linear import (_library, dequantize, dequantize_reference, quantize_rows,
                                 quantize_rows_reference)

native = pytest.mark.skipif(_library() is None, reason="no C++ compiler: the torch references run")


@native
@pytest.mark.parametrize("rows,cols", [(1, 8), (7, 768), (300, 3072), (33, 17)])
def test_native_quantization_equals_reference_bit_for_bit(rows, cols):
    generator = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0, :3] = torch.tensor([0.5, -0.5, 1.5])[: min(3, cols)] * x[0].abs().max() / 127  # ties: half to even
    if rows > 2:
        x[1] = 0  # an all-zero row: scale 1, zeros
    q, scale = quantize_rows(x)
    expected_q, expected_scale = quantize_rows_reference(x)
    assert q.dtype == torch.int8 and scale.shape == (rows, 1)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@native
def test_native_quantization_reads_strided_rows():
    x = torch.randn(40, 100)[:, 10:90]  # rows 100 apart, 80 wide
    for got, expected in zip(quantize_rows(x), quantize_rows_reference(x)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("with_bias", [True, False])
def test_dequantize_equals_reference(with_bias):
    accumulated = torch.randint(-50_000, 50_000, (70, 96), dtype=torch.int32)
    row_scale, col_scale = torch.rand(70, 1) + 0.01, torch.rand(96) + 0.01
    bias = torch.randn(96) if with_bias else None
    out = torch.empty(70, 200)[:, 50:146]  # a strided destination, as Int8Linear's row blocks are
    expected = torch.empty(70, 96)
    dequantize(accumulated, row_scale, col_scale, bias, out)
    dequantize_reference(accumulated, row_scale, col_scale, bias, expected)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 16, 17, ROW_BLOCK, ROW_BLOCK + 5, 3 * ROW_BLOCK - 1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_linear_matches_dequantized_reference_and_fp32(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(80, 96, generator=generator) * 0.05
    bias = torch.randn(80, generator=generator) if with_bias else None
    method = Int8Linear()
    prepared = method.prepare(weight)
    assert isinstance(prepared, Int8Weight) and prepared.qweight.dtype == torch.int8 and prepared.shape == (80, 96)
    out = method.apply(x, prepared, bias)
    torch.testing.assert_close(out, int8_linear_reference(x, prepared, bias), rtol=1e-3, atol=1e-4)
    exact = F.linear(x, weight, bias)
    assert (out - exact).norm() / exact.norm() < 0.02  # what 8 bits each side cost


def test_quantization_flag_checks():
    assert check_quantization(None) is None
    assert check_quantization("none") is None
    assert check_quantization("int8") == "int8"
    assert isinstance(linear_method("int8"), Int8Linear)
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        check_quantization("bitsandbytes")
