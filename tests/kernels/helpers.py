"""What the kernel tests share: the device, per-dtype tolerances, poisoned outputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# On the CPU the Triton kernels run under the interpreter (see conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# bf16 has an 8-bit mantissa: one rounding is up to 0.4%, and a kernel rounds at other
# points than torch does (the interpreter also truncates fp32 -> bf16 instead of rounding
# to nearest), so a few roundings apart is still right.
TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}

requires_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                     reason="the Triton kernels need the triton package")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **kwargs) -> None:
    torch.testing.assert_close(actual, expected, **{**TOLERANCES[expected.dtype], **kwargs})


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer of NaNs: an element a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def generator(seed: int) -> torch.Generator:
    """A CPU generator: every case draws its own fresh inputs, reproducibly."""
    return torch.Generator().manual_seed(seed)
