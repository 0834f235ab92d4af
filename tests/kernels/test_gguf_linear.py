"""kernels/gguf_linear.cpp against the plain-torch reference: the gguf package's dequantization
of the same blocks, times x quantized per block of 32, in float64; the VNNI build and the
portable loops, the dot-product path and the dequantized-sgemm one."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch

from kernels.cpu_kernels import torch_sgemm
from kernels.gguf_linear import (
    Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, GGUFKernels, gguf_kernels, gguf_linear_reference,
    quantize_rows_reference,
)

TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
# types the gguf package cannot quantize (its K-quants raise NotImplementedError): blocks built by hand
HAND_BUILT = {"Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}


def hand_built_blocks(out_features: int, in_features: int, ggml_type: int, seed: int,
                      scale: float = 0.01) -> torch.Tensor:
    """Blocks of random bytes (every bit pattern of quants, scales and fifth bits is a valid
    block) whose fp16 super-scales (d, and Q5_1's m, K's dmin) are set to 0.5-1.5 x scale, so
    the weights are finite and of the size asked for. Layouts: ggml-common.h."""
    kind = gguf.GGMLQuantizationType(ggml_type)
    elements, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // elements, nbytes), dtype=np.uint8)

    def halves() -> np.ndarray:
        scales = (rng.uniform(0.5, 1.5, blocks.shape[:2]) * scale).astype(np.float16)
        return scales.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if ggml_type == Q6_K:  # d is the block's last 2 bytes
        blocks[:, :, nbytes - 2:] = halves()
    else:  # d first, then m (Q5_1) or dmin (Q4_K, Q5_K)
        blocks[:, :, 0:2] = halves()
        if ggml_type in (Q5_1, Q4_K, Q5_K):
            blocks[:, :, 2:4] = halves()
    return torch.from_numpy(blocks.reshape(out_features, -1))


def quantized(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    if ggml_type in HAND_BUILT.values():
        return hand_built_blocks(*weight.shape, ggml_type, seed=int(weight.shape[0] * 7 + weight.shape[1]))
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


@pytest.mark.parametrize("type_name", HAND_BUILT)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_q5_and_k_quants_match_the_reference(kernels, type_name, rows):
    # K-quants: 256-weight super-blocks (Q6_K's scales per 16 weights); Q5: 96 = 3 blocks, an odd one
    ggml_type = HAND_BUILT[type_name]
    small = 96 if ggml_type in (Q5_0, Q5_1) else 256
    for in_features, out_features, bias in ((small, 33, True), (1536, 576, False)):
        for dequantize_rows in (10**6, 8):  # the dot products, then (past 8 rows) dequantized tiles and sgemm
            assert_matches_reference(kernels, ggml_type, rows, in_features, out_features, bias, dequantize_rows)


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
    for type_name, ggml_type in {**TYPES, **HAND_BUILT}.items():
        in_features = 256 if type_name.endswith("_K") else 96
        for rows in (1, 5):
            assert_matches_reference(portable, ggml_type, rows, in_features, 33, True, 10**6)


def test_a_type_without_a_kernel_has_no_row_size(kernels):
    assert kernels.row_bytes(int(gguf.GGMLQuantizationType.Q2_K), 256) == 0
    assert kernels.row_bytes(Q4_K, 96) == 0  # not whole super-blocks of 256
    assert kernels.row_bytes(Q6_K, 512) == 420
    assert kernels.row_bytes(Q4_1, 48) == 0  # not whole blocks
    assert kernels.row_bytes(Q4_1, 64) == 40
