"""rms_norm: weight * x / rms(x), optionally over x + residual (returned as the next residual)."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm, rms_norm_cpu, rms_norm_ref
from tests.kernels.helpers import DEVICE, assert_close, generator, requires_triton

# outputs the launchers allocate start as NaN (see conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_allocations")


def make_inputs(num_tokens: int, hidden_size: int, dtype: torch.dtype, seed: int, weight_dtype=None,
                row_stride: int | None = None, device: torch.device = DEVICE):
    """x may be a strided view (rows row_stride apart), as a slice of a wider matrix is."""
    g = generator(seed)
    wide = torch.randn(num_tokens, row_stride or hidden_size, generator=g).to(dtype).to(device)
    x = wide[:, :hidden_size]
    weight = (1 + 0.5 * torch.randn(hidden_size, generator=g)).to(weight_dtype or dtype).to(device)
    residual = torch.randn(num_tokens, hidden_size, generator=g).to(dtype).to(device)
    return x, weight, residual


@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_matches_the_formula(with_residual):
    x, weight, residual = make_inputs(5, 48, torch.float32, seed=1)
    x64 = x.double() + (residual.double() if with_residual else 0)
    expected = weight.double() * x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + 1e-6)
    result = rms_norm_ref(x, weight, 1e-6, residual if with_residual else None)
    if with_residual:
        result, new_residual = result
        torch.testing.assert_close(new_residual.double(), x64)
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-6)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 200, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_reference(dtype, hidden_size, with_residual):
    x, weight, residual = make_inputs(9, hidden_size, dtype, seed=hidden_size + with_residual,
                                      row_stride=hidden_size + 24)
    x_before, residual_before = x.clone(), residual.clone()
    expected = rms_norm_ref(x, weight, 1e-5, residual if with_residual else None)
    result = rms_norm(x, weight, 1e-5, residual if with_residual else None)
    if with_residual:
        assert_close(result[0], expected[0])
        assert_close(result[1], expected[1])
    else:
        assert_close(result, expected)
    # the launcher allocates its outputs: the inputs are left as they were
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@requires_triton
def test_triton_promotes_like_the_reference_with_an_fp32_weight():
    x, weight, residual = make_inputs(4, 96, torch.bfloat16, seed=7, weight_dtype=torch.float32)
    result, new_residual = rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert result.dtype == expected.dtype == torch.float32 and new_residual.dtype == torch.bfloat16
    assert_close(result, expected, rtol=2e-2, atol=2e-2)
    assert_close(new_residual, expected_residual)


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("path", ["torch", "native"])
def test_cpu_path_matches_reference(dtype, weight_dtype, with_residual, path, request):
    """Bit for bit on torch's ops; to fp32 rounding in C++ (fp32 only; it sums in another order)."""
    native = request.getfixturevalue("native_kernels") if path == "native" else None
    x, weight, residual = make_inputs(9, 200, dtype, seed=11 + with_residual, weight_dtype=weight_dtype,
                                      row_stride=224, device=torch.device("cpu"))  # (the CPU's path, on a GPU too)
    residual_before = residual.clone()
    expected = rms_norm_ref(x, weight, 1e-5, residual if with_residual else None)
    result = rms_norm_cpu(x, weight, 1e-5, residual if with_residual else None, native)
    results, expectations = (result, expected) if with_residual else ((result,), (expected,))
    for got, want in zip(results, expectations):
        if native is not None and dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        else:
            assert torch.equal(got, want)
    if with_residual:
        assert result[1].data_ptr() == x.data_ptr()  # the sum was made in x
    assert torch.equal(residual, residual_before)
