"""silu_mul: silu(gate) * up over the two halves of each row."""

from __future__ import annotations

import pytest
import torch

from kernels.silu_mul import silu_mul, silu_mul_cpu, silu_mul_ref
from tests.kernels.helpers import DEVICE, assert_close, generator, requires_triton

# outputs the launchers allocate start as NaN (see conftest.py)
pytestmark = pytest.mark.usefixtures("nan_filled_allocations")


def test_reference_matches_the_formula():
    x = torch.randn(6, 2 * 40, generator=generator(0), dtype=torch.float64)
    gate, up = x[:, :40], x[:, 40:]
    torch.testing.assert_close(silu_mul_ref(x), gate / (1 + torch.exp(-gate)) * up)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [64, 300, 1500])  # 1500: two column blocks per row
def test_triton_matches_reference(dtype, intermediate):
    # a strided view (rows wider than 2 * intermediate), as a slice of a wider matrix is
    wide = torch.randn(7, 2 * intermediate + 8, generator=generator(intermediate)).to(dtype).to(DEVICE)
    x = wide[:, : 2 * intermediate]
    out = silu_mul(x)
    assert out.shape == (7, intermediate) and out.is_contiguous()
    assert_close(out, silu_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_reference_bit_for_bit_in_the_gate_half(dtype):
    x = torch.randn(7, 2 * 300, generator=generator(5)).to(dtype).to(DEVICE)
    expected = silu_mul_ref(x)
    out = silu_mul_cpu(x)
    assert torch.equal(out, expected) and out.data_ptr() == x.data_ptr()


def test_cpu_kernel_matches_reference_in_the_gate_half(native_kernels):
    # rows wider than 2 * intermediate (a strided view), an intermediate size that is no
    # multiple of the kernel's 16 lanes, and gates far out in both tails of the exp
    wide = torch.randn(9, 2 * 300 + 8, generator=generator(6)) * 4
    wide[0, :8] = torch.tensor([-200.0, -90.0, -88.5, -20.0, 20.0, 88.5, 90.0, 200.0])
    x = wide[:, : 2 * 300]
    expected = silu_mul_ref(x.clone())
    out = silu_mul_cpu(x, native_kernels)
    assert out.shape == (9, 300) and out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
