"""kernels/gguf_gemm.cpp, the many-row tiles over GGUF weights: each block's int32 sums equal
torch's integer products exactly, the outputs equal kernels/gguf_mirror.py's tile order to the
last bits and the float64 reference (the gguf package's dequantization, x quantized per block)
within 1e-3, over row counts that fill a tile or leave part of one and output counts that are
not whole channel blocks."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from actors.config import cache_dir
from kernels._native import load_library
from kernels.gguf_gemm import TILE_ROWS, GGUFTiledKernels, block_parts, gguf_tiled_kernels
from kernels.gguf_linear import Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_0, dequantize_reference, \
    gguf_linear_reference
from kernels.gguf_mirror import gguf_gemm_mirror
from tests.kernels.test_gguf_linear import quantized

TILED = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q5_K": Q5_K}
ROWS = [1, 7, 9, 64, 300]


@pytest.fixture(scope="module")
def kernels() -> GGUFTiledKernels:
    built = gguf_tiled_kernels()
    if built is None:
        pytest.skip("no C++ compiler, or no AVX-512 VNNI (the tiles' only build)")
    return built


def weight(ggml_type: int, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return quantized(torch.randn(out_features, in_features, generator=generator), ggml_type)


def shape_for(ggml_type: int) -> tuple[int, int]:
    """(out, in): 50 outputs, 3 channel blocks and a part; K-quants take super-blocks of 256."""
    return 50, 256 if ggml_type in (Q4_K, Q5_K, Q6_K) else 96


@pytest.mark.parametrize("type_name", TILED)
def test_the_parts_are_the_files_weights(kernels, type_name):
    ggml_type = TILED[type_name]
    out_features, in_features = shape_for(ggml_type)
    blocks = weight(ggml_type, out_features, in_features, seed=1)
    parts = block_parts(blocks, ggml_type, in_features, kernels)
    u = parts.u.double().reshape(out_features, in_features // 32, 32)
    values = (u * parts.d.double()[..., None] + parts.c.double()[..., None]).reshape(out_features, in_features)
    expected = dequantize_reference(blocks, ggml_type, in_features).double()
    assert ((values - expected).abs().max() / expected.abs().max()).item() < 1e-6


@pytest.mark.parametrize("type_name", TILED)
@pytest.mark.parametrize("rows", ROWS)
def test_block_sums_are_exact(kernels, type_name, rows):
    ggml_type = TILED[type_name]
    out_features, in_features = shape_for(ggml_type)
    blocks = weight(ggml_type, out_features, in_features, seed=rows)
    tiles = kernels.tiles(blocks, ggml_type, in_features)
    xq = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    sums = kernels.block_sums(xq, tiles, in_features)
    u = block_parts(blocks, ggml_type, in_features, kernels).u.long().reshape(out_features, -1, 32)
    expected = torch.einsum("rbk,obk->rob", xq.long().reshape(rows, -1, 32), u)
    assert torch.equal(sums.long(), expected)


@pytest.mark.parametrize("type_name", TILED)
@pytest.mark.parametrize("rows", ROWS)
def test_outputs_equal_the_mirror_and_match_the_reference(kernels, type_name, rows):
    ggml_type = TILED[type_name]
    out_features, in_features = shape_for(ggml_type)
    blocks = weight(ggml_type, out_features, in_features, seed=rows + 7)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0
    bias = torch.randn(out_features, generator=generator)
    out = kernels.tiled_linear(x, kernels.tiles(blocks, ggml_type, in_features, tile_rows=1), in_features, bias)
    mirrored = gguf_gemm_mirror(x, block_parts(blocks, ggml_type, in_features, kernels), bias)
    expected = gguf_linear_reference(x, blocks, ggml_type, in_features, bias)
    assert ((out - mirrored).abs().max() / mirrored.abs().max()).item() < 1e-6
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-3


def test_smollm2_shapes_across_threads(kernels):
    # SmolLM2's down projection (576 x 1536) and its gate/up (3072 x 576), Q4_1, a decode batch of 64
    for out_features, in_features in ((576, 1536), (3072, 576)):
        blocks = weight(Q4_1, out_features, in_features, seed=out_features)
        x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(5))
        out = kernels.tiled_linear(x, kernels.tiles(blocks, Q4_1, in_features), in_features)
        mirrored = gguf_gemm_mirror(x, block_parts(blocks, Q4_1, in_features, kernels))
        assert ((out - mirrored).abs().max() / mirrored.abs().max()).item() < 1e-6


def test_a_few_rows_and_scales_of_16_go_to_the_file_blocks_kernel(kernels):
    """Below TILE_ROWS rows, and a Q6_K weight (a scale per 16 weights: no tiles) at any count,
    give what gguf_linear.cpp gives for the file's blocks (the dot products up to its
    dequantize_rows, dequantized sgemm past them)."""
    for ggml_type, rows in ((Q4_1, TILE_ROWS - 1), (Q6_K, 8), (Q6_K, 40)):
        out_features, in_features = shape_for(ggml_type)
        blocks = weight(ggml_type, out_features, in_features, seed=3)
        tiles = kernels.tiles(blocks, ggml_type, in_features)
        assert (tiles.packed is None) == (ggml_type == Q6_K)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(4))
        assert torch.equal(kernels.tiled_linear(x, tiles, in_features),
                           kernels.linear(x, blocks, ggml_type, in_features))


def test_u8x16_of_a_type_with_scales_of_32_has_tiles(kernels):
    blocks = weight(Q4_K, 50, 256, seed=9)
    decoded = kernels.decode_rows(blocks, Q4_K, 256)
    from kernels.gguf_linear import U8X16

    parts, direct = block_parts(decoded, U8X16, 256, kernels), block_parts(blocks, Q4_K, 256, kernels)
    assert parts is not None and all(np.array_equal(a.numpy(), b.numpy()) for a, b in
                                     ((parts.u, direct.u), (parts.d, direct.d), (parts.c, direct.c)))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_a_build_without_vnni_hands_every_step_to_the_file_blocks_kernel(kernels, tmp_path):
    source = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "gguf_gemm.cpp")
    library = str(tmp_path / "gguf_gemm_portable.so")
    subprocess.run(["g++", "-O3", "-march=x86-64-v2", "-fopenmp", "-std=c++17", "-shared", "-fPIC", source, "-o",
                    library], check=True, timeout=300)
    portable = ctypes.CDLL(library)
    assert portable.gguf_gemm_uses_vnni() == 0
    forwarding = GGUFTiledKernels(load_library("gguf_linear", os.path.join(cache_dir(), "kernels")), kernels.sgemm,
                                  portable)
    blocks = weight(Q4_1, 50, 96, seed=6)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(6))
    assert torch.equal(forwarding.tiled_linear(x, forwarding.tiles(blocks, Q4_1, 96), 96),
                       kernels.linear(x, blocks, Q4_1, 96))
