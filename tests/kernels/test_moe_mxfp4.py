"""GPT-OSS's MXFP4 experts: the torch dequantizer against hand-built bytes, the quantizer
round trip, and the C++ kernel (kernels/moe_mxfp4.cpp) against the torch reference on the
dequantized weights, at a decode's few rows, a prefill's many, one thread and several, with
experts held elsewhere (-1)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_mxfp4 import Mxfp4Experts, moe_mxfp4_kernels
from kernels.mxfp4_ref import gpt_oss_experts_ref, mxfp4_dequantize, mxfp4_experts_ref, mxfp4_quantize, route_gpt_oss

ALPHA, LIMIT = 1.702, 7.0


def test_dequantize_reads_low_nibble_first_and_the_e8m0_scale():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x92  # low nibble 2 (+1.0), high nibble 9 (-0.5)
    blocks[0, 0, 15] = 0x07  # +6.0, then +0.0
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** 1
    values = mxfp4_dequantize(blocks, scales)[0]
    assert values.shape == (32,)
    assert values[:2].tolist() == [2.0, -1.0] and values[30:].tolist() == [12.0, 0.0]
    assert values[2:30].abs().sum() == 0


def test_quantize_round_trips_fp4_values():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), generator=generator)
    exponents = torch.randint(-4, 3, (3, 5, 2), generator=generator)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes[..., 0] = 7  # every block reaches 6 * its scale: the scale the quantizer picks
    codes[..., 32] = 15
    weight = torch.ldexp(lut[codes], exponents.repeat_interleave(32, dim=-1))
    blocks, scales = mxfp4_quantize(weight)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    assert torch.equal(mxfp4_dequantize(blocks, scales), weight)


def random_experts(num_experts: int, hidden: int, intermediate: int, seed: int = 0) -> Mxfp4Experts:
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.3
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.3
    (w13_blocks, w13_scales), (w2_blocks, w2_scales) = mxfp4_quantize(w13), mxfp4_quantize(w2)
    return Mxfp4Experts(w13_blocks, w13_scales, torch.randn(num_experts, 2 * intermediate, generator=generator),
                        w2_blocks, w2_scales, torch.randn(num_experts, hidden, generator=generator))


def reference(x: torch.Tensor, experts: Mxfp4Experts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w13 = mxfp4_dequantize(experts.w13_blocks, experts.w13_scales)
    w2 = mxfp4_dequantize(experts.w2_blocks, experts.w2_scales)
    return gpt_oss_experts_ref(x, w13, experts.w13_bias, w2, experts.w2_bias, weights, ids, ALPHA, LIMIT)


# (1 token, top-1: fewer active experts than threads, so each projection splits its rows over
# them; else the experts split over the threads)
@pytest.mark.parametrize("num_tokens, top_k", [(1, 1), (1, 2), (3, 2), (37, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_matches_reference(num_tokens, top_k, threads):
    kernels = moe_mxfp4_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler")
    experts = random_experts(6, 64, 96)
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 64, generator=generator)
    weights, ids = route_gpt_oss(torch.randn(num_tokens, 6, generator=generator), top_k)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.fused_experts(x, experts, weights, ids, ALPHA, LIMIT)
    finally:
        torch.set_num_threads(old)
    expected = reference(x, experts, weights, ids)
    # large activations so that the clamps bind somewhere
    assert (x @ mxfp4_dequantize(experts.w13_blocks, experts.w13_scales)[0].T).abs().max() > LIMIT
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_cpu_kernel_skips_experts_held_elsewhere():
    kernels = moe_mxfp4_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler")
    experts = random_experts(4, 32, 32, seed=1)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, -1], [-1, -1], [3, 2], [1, -1], [2, 0]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
    out = kernels.fused_experts(x, experts, weights, ids, ALPHA, LIMIT)
    torch.testing.assert_close(out, reference(x, experts, weights, ids), rtol=1e-5, atol=1e-4)
    assert out[1].abs().sum() == 0
    with pytest.raises(ValueError, match="expert id"):
        kernels.fused_experts(x, experts, weights, ids.masked_fill(ids == 3, 4), ALPHA, LIMIT)


def test_reference_on_the_blocks_equals_the_reference_on_dequantized_weights():
    """mxfp4_experts_ref (what a device without the kernel runs: each routed expert
    dequantized as it runs) against the whole layer dequantized first."""
    experts = random_experts(5, 32, 64, seed=3)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=generator)
    weights, ids = route_gpt_oss(torch.randn(9, 5, generator=generator), 2)
    out = mxfp4_experts_ref(x, experts.w13_blocks, experts.w13_scales, experts.w13_bias, experts.w2_blocks,
                            experts.w2_scales, experts.w2_bias, weights, ids, ALPHA, LIMIT)
    assert torch.equal(out, reference(x, experts, weights, ids))
