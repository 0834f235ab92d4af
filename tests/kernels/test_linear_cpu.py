"""The C++ linear for a few rows (the CPU's decode steps) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.layers.attention import CpuBackend


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize("in_features, out_features", [(64, 96), (576, 960), (37, 10), (48, 4099), (16, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_few_rows_matches_f_linear(native_kernels, num_rows, in_features, out_features, with_bias):
    generator = torch.Generator().manual_seed(num_rows * 1000 + in_features + out_features)
    x = torch.randn(num_rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = native_kernels.linear_few_rows(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4 * in_features**0.5)


def test_strided_rows_and_a_weight_slice_are_read_in_place(native_kernels):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(6, 200, generator=generator)[::2, :128]  # row stride 400, 3 rows
    weight = torch.randn(50, 256, generator=generator)[:, 64:192]  # row stride 256
    torch.testing.assert_close(native_kernels.linear_few_rows(x, weight), F.linear(x, weight), rtol=1e-4, atol=1e-4)


def test_cpu_backend_takes_the_cpp_linear_for_few_rows_only(native_kernels, monkeypatch):
    backend = CpuBackend(native_kernels)
    calls = []
    monkeypatch.setattr(native_kernels, "linear_few_rows",
                        lambda *args: calls.append(args[0].shape[0]) or F.linear(*args))
    weight = torch.randn(32, 64)
    for num_rows in (1, 16, 17, 300):
        torch.testing.assert_close(backend.linear(torch.randn(num_rows, 64), weight).shape,
                                   torch.Size([num_rows, 32]))
    backend.linear(torch.randn(4, 64, dtype=torch.float64), weight.double())  # not fp32: torch's
    assert calls == [1, 16]
