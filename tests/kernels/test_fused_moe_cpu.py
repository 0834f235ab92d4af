"""The CPU's fused experts (kernels/moe_cpu.cpp) against the torch reference
(kernels/fused_moe_ref.py): float32 weights on the few-rows and the sgemm paths, int8 W8A8
and GGUF blocks against the reference on the dequantized weights with the activations
quantized as the quantized linears quantize them."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import gguf
import pytest
import torch

from kernels.cpu_kernels import torch_sgemm
from kernels.fused_moe_ref import fused_experts_ref, local_expert_ids
from kernels.gguf_gemm import gguf_tiled_kernels
from kernels.gguf_linear import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    dequantize_reference,
)
from kernels.gguf_linear import quantize_rows_reference as gguf_quantize_rows
from kernels.int8_linear import quantize_rows_reference as int8_quantize_rows
from kernels.moe_cpu import (
    MoeCpuKernels,
    fp32_experts,
    gguf_experts,
    int8_experts,
    moe_cpu_kernels,
)
from tests.kernels.helpers import generator, moe_routing
from tests.kernels.test_gguf_linear import HAND_BUILT, hand_built_blocks

# (experts, top_k, tokens): fewer tokens than experts, a single decode token, top-1, a batch
# spreading over every expert (the threads split the experts), one expert past 16 rows (sgemm)
GRID = [(8, 2, 3), (4, 1, 1), (8, 3, 21), (16, 4, 64)]


@pytest.fixture(scope="module")
def kernels() -> MoeCpuKernels:
    built = moe_cpu_kernels()
    if built is None:
        pytest.skip("the C++ kernels did not build (no C++ compiler?)")
    return built


def _weights(num_experts, hidden, intermediate, seed=0):
    g = generator(seed)
    return (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5,
            torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5)


def _assert_relative(actual, expected, bound):
    error = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert error < bound, f"relative error {error}"


# the packed panels; rows, with the few-rows kernel up to 16 rows; rows, every projection by sgemm
LAYOUTS = {"packed": (True, 16), "rows": (False, 16), "rows-sgemm": (False, 0)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_experts,top_k,num_tokens", GRID)
def test_fp32_matches_reference(kernels, layout, num_experts, top_k, num_tokens):
    packed, few_rows = LAYOUTS[layout]
    w13, w2 = _weights(num_experts, 96, 40)  # 96, 40: no multiple of a 16-float vector
    x = torch.randn(num_tokens, 96, generator=generator(num_tokens))
    weights, ids = moe_routing(num_tokens, num_experts, top_k, seed=num_experts + num_tokens, device="cpu")
    out = kernels.fused_experts(x, fp32_experts(w13, w2, packed), weights, ids, few_rows=few_rows)
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)


def test_every_token_to_one_expert_empty_experts_and_strided_rows(kernels):
    w13, w2 = _weights(8, 64, 32, seed=4)
    x = torch.randn(12, 2 * 64, generator=generator(5))[:, :64]  # rows strided, as a fused qkv slice
    weights, ids = moe_routing(12, 8, 2, seed=6, experts=[6, 1], device="cpu")
    assert set(ids.flatten().tolist()) == {1, 6}
    experts = fp32_experts(w13, w2)
    out = torch.full((12, 80), float("nan"))[:, 8:72]  # written into a strided view
    kernels.fused_experts(x, experts, weights, ids.long(), out=out)
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)
    top1 = kernels.fused_experts(x, experts, torch.ones(12, 1), torch.full((12, 1), 3))
    torch.testing.assert_close(top1, fused_experts_ref(x, w13, w2, torch.ones(12, 1), torch.full((12, 1), 3)),
                               rtol=1e-4, atol=1e-5)


def test_a_long_prefill_runs_in_chunks_of_tokens(kernels):
    # 2100 tokens x top-8 x hidden 1024 floats pass the C++'s 2^24-float combine buffer: two chunks
    w13, w2 = _weights(4, 1024, 16, seed=20)
    x = torch.randn(2100, 1024, generator=generator(21))
    weights, ids = moe_routing(2100, 4, 4, seed=22, device="cpu")
    ids = torch.cat([ids, ids], dim=1)  # top-8 over 4 experts: each twice, at half the weight
    weights = torch.cat([weights, weights], dim=1) / 2
    out = kernels.fused_experts(x, fp32_experts(w13, w2), weights, ids)
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_result_does_not_depend_on_threads(kernels, packed):
    # one thread runs the experts in turn, two split them; the kernels' sums and the
    # combine's top-k order are per row, so the bits are the same
    w13, w2 = _weights(16, 64, 32, seed=8)
    x = torch.randn(24, 64, generator=generator(9))
    weights, ids = moe_routing(24, 16, 4, seed=10, device="cpu")
    experts = fp32_experts(w13, w2, packed)
    threads = torch.get_num_threads()
    # every expert busy (threads split the experts), then all tokens to one (threads split its projections)
    for routed in (ids, torch.full_like(ids, 3)):
        try:
            torch.set_num_threads(1)
            alone = kernels.fused_experts(x, experts, weights, routed)
            torch.set_num_threads(max(2, threads))
            shared = kernels.fused_experts(x, experts, weights, routed)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone, shared)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])  # AVX2's 4 x 1 tile; no FMA at all
def test_builds_without_avx512_match_reference(kernels, tmp_path, march):
    source = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "moe_cpu.cpp")
    library = str(tmp_path / f"moe_cpu_{march}.so")
    subprocess.run(["g++", "-O3", f"-march={march}", "-fopenmp", "-std=c++17", "-shared", "-fPIC", source, "-o",
                    library], check=True, timeout=300)
    portable = MoeCpuKernels(ctypes.CDLL(library), kernels.few_rows_linear, torch_sgemm())
    w13, w2 = _weights(8, 96, 40, seed=23)
    x = torch.randn(21, 96, generator=generator(24))
    weights, ids = moe_routing(21, 8, 3, seed=25, device="cpu")
    experts = fp32_experts(w13, w2)  # the panels' layout is the same in every build
    out = portable.fused_experts(x, experts, weights, ids)
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5)


def test_an_expert_id_out_of_range_is_an_error(kernels):
    w13, w2 = _weights(4, 32, 32)
    for bad in (4, -2):  # -1 is another rank's expert
        with pytest.raises(ValueError, match="expert id"):
            kernels.fused_experts(torch.randn(2, 32), fp32_experts(w13, w2), torch.ones(2, 1),
                                  torch.tensor([[0], [bad]]))


@pytest.mark.parametrize("allowed", [None, [0, 1, 2]])  # [0, 1, 2]: rank 1 gets no token at all
def test_expert_parallel_ranks_sum_to_the_whole(kernels, allowed):
    w13, w2 = _weights(8, 64, 32, seed=17)
    x = torch.randn(10, 64, generator=generator(18))
    weights, ids = moe_routing(10, 8, 3, seed=19, experts=allowed, device="cpu")
    ranks = []
    for first in (0, 4):  # two ranks of 4 experts each; the other rank's experts are -1 here
        local = local_expert_ids(ids, first, 4)
        experts = fp32_experts(w13[first:first + 4], w2[first:first + 4])
        ranks.append(kernels.fused_experts(x, experts, weights, local))
        torch.testing.assert_close(ranks[-1], fused_experts_ref(x, w13[first:first + 4], w2[first:first + 4],
                                                                weights, local), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ranks[0] + ranks[1], fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-4,
                               atol=1e-5)
    if allowed is not None:
        assert torch.equal(ranks[1], torch.zeros_like(ranks[1]))


def test_int8_matches_reference_on_dequantized_weights(kernels):
    w13, w2 = _weights(8, 64, 48, seed=11)
    x = torch.randn(21, 64, generator=generator(12))
    weights, ids = moe_routing(21, 8, 3, seed=13, device="cpu")
    out = kernels.fused_experts(x, int8_experts(w13, w2), weights, ids)

    def dequantized(w):
        q, scale = int8_quantize_rows(w)
        return q.float() * scale

    def quantize(rows):
        q, scale = int8_quantize_rows(rows)
        return q.float() * scale

    expected = fused_experts_ref(x, torch.stack([dequantized(w) for w in w13]),
                                 torch.stack([dequantized(w) for w in w2]), weights, ids, quantize_activations=quantize)
    _assert_relative(out, expected, 1e-3)


def _blocks(weight: torch.Tensor, ggml_type: int, seed: int) -> torch.Tensor:
    """[E, out, in] floats as [E, out, row bytes] blocks: the gguf package's quantization, or
    random blocks for the K-quants it cannot make."""
    if ggml_type in HAND_BUILT.values():
        return torch.stack([hand_built_blocks(*w.shape, ggml_type, seed=seed + e) for e, w in enumerate(weight)])
    kind = gguf.GGMLQuantizationType(ggml_type)
    return torch.stack([torch.from_numpy(gguf.quants.quantize(w.numpy(), kind)) for w in weight])


def _dequantized(blocks: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    return torch.stack([dequantize_reference(b, ggml_type, in_features) for b in blocks])


@pytest.mark.parametrize("types", [(Q8_0, Q8_0), (Q4_0, Q4_0), (Q4_1, Q8_0), (Q4_K, Q6_K), (Q5_0, Q5_K)],
                         ids=["Q8_0", "Q4_0", "Q4_1+Q8_0", "Q4_K+Q6_K", "Q5_0+Q5_K"])
# the block dot products; dequantized tiles + sgemm; gguf_gemm.cpp's int8 tiles from 2 rows
@pytest.mark.parametrize("path", ["blocks", "sgemm", "tiles"])
def test_gguf_blocks_match_reference_on_dequantized_weights(kernels, types, path):
    w13_type, w2_type = types
    if path == "tiles" and gguf_tiled_kernels() is None:
        pytest.skip("the int8 tiles need AVX-512 VNNI")
    hidden, intermediate = 256, 256  # whole K-quant super-blocks
    w13, w2 = _weights(8, hidden, intermediate, seed=14)
    w13_blocks, w2_blocks = _blocks(w13, w13_type, seed=1), _blocks(w2, w2_type, seed=100)
    experts = gguf_experts(w13_blocks, w13_type, w2_blocks, w2_type, hidden, intermediate, tiles=path == "tiles")
    # the weights stay blocks (and int8 tiles), at most 8.5 + 10 bits a weight, never float32's 32
    blocks_bytes = w13_blocks.numel() + w2_blocks.numel()
    assert experts.num_bytes() == blocks_bytes if path != "tiles" else \
        blocks_bytes < experts.num_bytes() <= (w13.numel() + w2.numel()) * (8.5 + 10) / 8
    x = torch.randn(13, hidden, generator=generator(15))
    weights, ids = moe_routing(13, 8, 2, seed=16, device="cpu")
    out = kernels.fused_experts(x, experts, weights, ids, dequantize_rows=0 if path == "sgemm" else 1 << 30)
    expected = fused_experts_ref(x, _dequantized(w13_blocks, w13_type, hidden),
                                 _dequantized(w2_blocks, w2_type, intermediate), weights, ids,
                                 quantize_activations=None if path == "sgemm" else gguf_quantize_rows)
    # the tiles scale int32 sums of u = q + offset in float32 and subtract the offset's term
    # (Q8_0: 128 * sum(x)), which cancels: tests/kernels/test_gguf_gemm.py holds them to 1e-3
    # of the reference a GEMM, here two in a row
    _assert_relative(out, expected, 5e-3 if path == "tiles" else 1e-4)
