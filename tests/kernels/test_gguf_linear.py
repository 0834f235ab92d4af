"""kernels/gguf_linear.cpp against the plain-torch reference: the gguf package's dequantization
of the same blocks, times x quantized per block of 32, in float64; the VNNI build and the
portable loops, the dot-product path and the dequantized-sgemm one."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import gguf
import pytest
import torch

from kernels.cpu_kernels import torch_sgemm
from kernels.gguf_linear import (
    Q4_0, Q4_1, Q8_0, GGUFKernels, gguf_kernels, gguf_linear_reference, quantize_rows_reference,
)

TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}


def quantized(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType(ggml_type)))


def assert_matches_reference(kernels: GGUFKernels, ggml_type: int, rows: int, in_features: int,
                             out_features: int, bias: bool, dequantize_rows: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    blocks = quantized(torch.randn(out_features, in_features, generator=generator), ggml_type)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    b = torch.randn(out_features, generator=generator) if bias else None
    out = kernels.linear(x, blocks, ggml_type, in_features, b, dequantize_rows=dequantize_rows)
    # the sgemm path multiplies x unquantized: its reference is the dequantized weights alone
    expected = gguf_linear_reference(x, blocks, ggml_type, in_features, b) if rows <= dequantize_rows else \
        gguf_linear_reference(x, blocks, ggml_type, in_features, b, quantize_x=False)
    error = (out - expected).abs().max() / expected.abs().max()
    assert error < 1e-5, f"relative error {error}"


@pytest.fixture(scope="module")
def kernels() -> GGUFKernels:
    built = gguf_kernels()
    if built is None:
        pytest.skip("no C++ compiler")
    return built


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 40])
def test_block_dot_products_match_the_reference(kernels, type_name, rows):
    # 96 inputs: 3 blocks, an odd one out of the pairs the VNNI loop takes; 33 outputs: a
    # partial chunk of weight rows; 1536 x 576: SmolLM2's down projection, threads splitting it
    for in_features, out_features, bias in ((96, 33, True), (64, 40, False), (1536, 576, False)):
        assert_matches_reference(kernels, TYPES[type_name], rows, in_features, out_features, bias, 10**6)


@pytest.mark.parametrize("type_name", TYPES)
def test_many_rows_run_dequantized_tiles_through_sgemm(kernels, type_name):
    assert kernels.sgemm is not None
    for in_features, out_features, bias in ((96, 33, True), (576, 1000, False)):
        assert_matches_reference(kernels, TYPES[type_name], 40, in_features, out_features, bias, 8)


def test_activations_are_quantized_per_block_of_32_rounding_half_away_from_zero():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5] + [0.0] * 27])
    assert quantize_rows_reference(x)[0, :5].tolist() == [127.0, 1.0, -1.0, 2.0, -3.0]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_portable_loops_match_the_reference(tmp_path):
    """The build for a CPU without AVX-512 VNNI: plain loops the compiler vectorizes as it can."""
    source = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "gguf_linear.cpp")
    library = str(tmp_path / "gguf_linear_portable.so")
    subprocess.run(["g++", "-O3", "-march=x86-64-v2", "-fopenmp", "-std=c++17", "-shared", "-fPIC", source, "-o",
                    library], check=True, timeout=300)
    portable = GGUFKernels(ctypes.CDLL(library), torch_sgemm())
    assert not portable.uses_vnni
    for type_name, ggml_type in TYPES.items():
        for rows in (1, 5):
            assert_matches_reference(portable, ggml_type, rows, 96, 33, True, 10**6)


def test_a_type_without_a_kernel_has_no_row_size(kernels):
    assert kernels.row_bytes(int(gguf.GGMLQuantizationType.Q4_K), 256) == 0
    assert kernels.row_bytes(Q4_1, 48) == 0  # not whole blocks
    assert kernels.row_bytes(Q4_1, 64) == 40
