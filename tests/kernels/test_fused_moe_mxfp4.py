"""MXFP4 experts (GPT-OSS's): the format against Hugging Face's dequantizer, the quantizer's
rounding, the "swigluoai" reference against Hugging Face's GptOssExperts, and the Triton fused
MoE kernel on MXFP4 weights (with and without biases) against the torch reference, under
triton's interpreter on a CPU and for real on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe_ref import fused_experts_ref, local_expert_ids, route
from kernels.fused_moe_triton import fused_experts, fused_experts_mxfp4
from kernels.mxfp4 import FP4_VALUES, dequantize_mxfp4, fused_experts_mxfp4_ref, quantize_mxfp4
from tests.kernels.helpers import DEVICE, TOLERANCES, generator, moe_routing, requires_cuda, requires_triton


def _experts(num_experts, hidden, intermediate, seed=0, device=DEVICE):
    """MXFP4 w13 and w2 (blocks, scales) quantized from random float weights, and float
    biases of either projection, every tensor on the device."""
    g = generator(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    w13_bias = torch.randn(num_experts, 2 * intermediate, generator=g) / 4
    w2_bias = torch.randn(num_experts, hidden, generator=g) / 4
    return [t.to(device) for t in (*quantize_mxfp4(w13), *quantize_mxfp4(w2), w13_bias, w2_bias)]


def _assert_matches(x, experts, weights, ids, activation="swigluoai", biases=True, **kwargs):
    w13_blocks, w13_scales, w2_blocks, w2_scales, w13_bias, w2_bias = experts
    bias = dict(w13_bias=w13_bias, w2_bias=w2_bias) if biases else {}
    expected = fused_experts_mxfp4_ref(x, w13_blocks, w13_scales, w2_blocks, w2_scales, weights, ids, activation,
                                       **bias)
    actual = fused_experts_mxfp4(x, w13_blocks, w13_scales, w2_blocks, w2_scales, weights, ids, activation,
                                 **bias, **kwargs)
    torch.testing.assert_close(actual, expected, **TOLERANCES[x.dtype])


def _representable(shape, seed, force_six=False):
    """A weight [..., K] whose every group of 32 is E2M1 values times one power of two;
    force_six: each group holds a +-6, so the quantizer must choose the same scale back."""
    g = generator(seed)
    codes = torch.randint(0, 16, shape, generator=g)
    if force_six:
        codes.view(-1, 32)[:, 0] = torch.randint(0, 2, (codes.numel() // 32,), generator=g) * 8 + 7
    exponents = torch.randint(-20, 10, (*shape[:-1], shape[-1] // 32, 1), generator=g)
    values = torch.tensor(FP4_VALUES)[codes].reshape(*shape[:-1], -1, 32)
    return torch.ldexp(values, exponents).flatten(-2), codes


def test_round_trip_is_exact_on_representable_values():
    w, codes = _representable((3, 5, 96), seed=1)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 5, 48) and scales.shape == (3, 5, 3)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(blocks, scales), w)
    # with a +-6 in each group the bytes come back too: low nibble the even element
    w, codes = _representable((4, 64), seed=2, force_six=True)
    blocks, _ = quantize_mxfp4(w)
    assert torch.equal(blocks & 15, codes[:, 0::2].to(torch.uint8)) and torch.equal(blocks >> 4,
                                                                                  codes[:, 1::2].to(torch.uint8))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w), dtype=torch.bfloat16), w.to(torch.bfloat16))


def test_quantize_rounds_to_nearest_with_ties_to_even_and_saturates():
    # one group whose largest magnitude, 6, keeps the scale at 2**0: then the values round on
    # E2M1's grid, midpoints to the code with mantissa 0
    inputs = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -0.3, 0.2, -2.9, 0.1, 1.1]
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 0.0, -3.0, 0.0, 1.0]
    w = torch.zeros(32)
    w[:len(inputs)] = torch.tensor(inputs)
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [127]
    assert dequantize_mxfp4(blocks, scales)[:len(inputs)].tolist() == expected
    # amax 7 also keeps 2**0 (floor(log2 7) = 2 = E2M1's top exponent): it saturates to 6;
    # amax 0.75 gets 2**-3, so 0.75 is 6 * 2**-3; an all-zero group gets the scale 1
    w = torch.tensor([7.0] + [1.0] * 31 + [0.75] + [0.0] * 31 + [0.0] * 32)
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [127, 124, 127]
    assert dequantize_mxfp4(blocks, scales)[[0, 1, 32]].tolist() == [6.0, 1.0, 0.75]


def test_layout_is_the_one_hugging_face_dequantizes():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = generator(5)
    blocks = torch.randint(0, 256, (2, 8, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 135, (2, 8, 4), dtype=torch.uint8, generator=g)
    # the checkpoint's [E, rows, K // 32, 16] blocks; Hugging Face returns [E, K, rows]
    theirs = mxfp4.convert_moe_packed_tensors(blocks.reshape(2, 8, 4, 16), scales, dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), dequantize_mxfp4(blocks, scales))


def test_swigluoai_reference_is_hugging_face_gpt_oss_experts():
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
    experts = modeling.GptOssExperts(config)
    g = generator(6)
    w13 = torch.randn(4, 64, 64, generator=g)  # large enough that the clamps at +-7 bite
    w2 = torch.randn(4, 64, 32, generator=g) / 4
    w13_bias, w2_bias = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    with torch.no_grad():  # Hugging Face multiplies x @ W: the transposes of troupe's rows
        experts.gate_up_proj.copy_(w13.transpose(1, 2))
        experts.down_proj.copy_(w2.transpose(1, 2))
        experts.gate_up_proj_bias.copy_(w13_bias)
        experts.down_proj_bias.copy_(w2_bias)
        x = torch.randn(6, 64, generator=g)
        weights, ids = route(torch.randn(6, 4, generator=g), 2, renormalize=True)
        theirs = experts(x, router_indices=ids.long(), routing_weights=weights)
    ours = fused_experts_ref(x, w13, w2, weights, ids, "swigluoai", w13_bias=w13_bias, w2_bias=w2_bias)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# (experts, top_k, tokens): fewer tokens than experts, a single decode token, more tokens than
# a 16-row block for one expert
GRID = [(8, 2, 3), (4, 1, 1), (8, 4, 21), (3, 2, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("biases", [True, False])
@pytest.mark.parametrize("num_experts,top_k,num_tokens", GRID)
@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_mxfp4_experts_match_reference(dtype, biases, num_experts, top_k, num_tokens):
    experts = _experts(num_experts, 64, 32, seed=num_experts)
    x = torch.randn(num_tokens, 64, generator=generator(num_tokens)).to(dtype).to(DEVICE)
    weights, ids = moe_routing(num_tokens, num_experts, top_k, seed=num_experts * 100 + num_tokens)
    _assert_matches(x, experts, weights, ids, biases=biases)


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_partial_k_tiles_and_the_silu_activation():
    # hidden 96 and intermediate 96: each GEMM's second k tile of 64 is half empty, and the
    # gate/up kernel needs two column tiles; "silu" reads w13 as gate rows, then up rows
    experts = _experts(4, 96, 96, seed=3)
    x = torch.randn(9, 96, generator=generator(8)).to(DEVICE)
    weights, ids = moe_routing(9, 4, 2, seed=12)
    _assert_matches(x, experts, weights, ids)
    _assert_matches(x, experts, weights, ids, activation="silu", biases=False)


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_every_token_routed_to_one_expert_and_the_rest_empty():
    experts = _experts(8, 32, 32, seed=4)
    x = torch.randn(20, 32, generator=generator(7)).to(DEVICE)
    # top-2 over experts 5 and 2 only: six experts get no block, each chosen one two blocks
    weights, ids = moe_routing(20, 8, 2, seed=3, experts=[5, 2])
    assert set(ids.flatten().tolist()) == {2, 5}
    _assert_matches(x, experts, weights, ids)
    # top-1: every token to expert 5, in blocks of 16 and of 64
    ones = torch.ones(20, 1, device=DEVICE)
    fives = torch.full((20, 1), 5, dtype=torch.int64, device=DEVICE)
    _assert_matches(x, experts, ones, fives, block_m=16)
    _assert_matches(x, experts, ones, fives, block_m=64)


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_expert_parallel_ranks_sum_to_the_whole():
    w13_blocks, w13_scales, w2_blocks, w2_scales, w13_bias, w2_bias = _experts(8, 32, 32, seed=2)
    x = torch.randn(10, 32, generator=generator(4)).to(DEVICE)
    weights, ids = moe_routing(10, 8, 3, seed=9)
    ranks = []
    for first in (0, 4):  # two ranks of 4 experts; the other rank's slots are -1 and add nothing
        mine = slice(first, first + 4)
        ranks.append(fused_experts_mxfp4(x, w13_blocks[mine], w13_scales[mine], w2_blocks[mine], w2_scales[mine],
                                         weights, local_expert_ids(ids, first, 4), w13_bias=w13_bias[mine],
                                         w2_bias=w2_bias[mine]))
    expected = fused_experts_mxfp4_ref(x, w13_blocks, w13_scales, w2_blocks, w2_scales, weights, ids,
                                       w13_bias=w13_bias, w2_bias=w2_bias)
    torch.testing.assert_close(ranks[0] + ranks[1], expected, **TOLERANCES[torch.float32])


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_float_experts_take_the_gpt_oss_activation_and_biases():
    # the same options on the float kernel (a GPT-OSS checkpoint saved in bf16)
    g = generator(10)
    w13, w2 = torch.randn(4, 64, 48, generator=g) / 4, torch.randn(4, 48, 32, generator=g) / 4
    w13_bias, w2_bias = torch.randn(4, 64, generator=g), torch.randn(4, 48, generator=g)
    x = torch.randn(7, 48, generator=g)
    weights, ids = moe_routing(7, 4, 2, seed=11)
    w13, w2, w13_bias, w2_bias, x = (t.to(DEVICE) for t in (w13, w2, w13_bias, w2_bias, x))
    bias = dict(w13_bias=w13_bias, w2_bias=w2_bias)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, "swigluoai", **bias),
                               fused_experts_ref(x, w13, w2, weights, ids, "swigluoai", **bias),
                               **TOLERANCES[torch.float32])


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_expert_offsets_past_two_to_the_31():
    # w13's and w2's blocks for three experts 2**30 + 64 bytes apart (views over 2 GiB each,
    # never filled but for the experts' pages): expert 2's offset overflows int32
    hidden, intermediate, stride = 64, 32, 2**30 + 64
    experts = _experts(3, hidden, intermediate, seed=6)
    try:
        for index in (0, 2):  # w13_blocks, w2_blocks
            small = experts[index]
            rows, cols = small.shape[1:]
            experts[index] = torch.empty(2 * stride + rows * cols, dtype=torch.uint8, device=DEVICE).as_strided(
                small.shape, (stride, cols, 1))
            experts[index].copy_(small)
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve the weights: {error}")
    x = torch.randn(6, hidden, generator=generator(13)).to(torch.bfloat16).to(DEVICE)
    weights, ids = moe_routing(6, 3, 2, seed=14)
    assert 2 in ids
    _assert_matches(x, experts, weights, ids)


def test_widths_off_the_group_size_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    w13_blocks, w13_scales = quantize_mxfp4(torch.zeros(2, 32, 64))
    w2_blocks, w2_scales = torch.zeros(2, 64, 8, dtype=torch.uint8), torch.zeros(2, 64, 0, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiples of 32"):  # intermediate 16
        fused_experts_mxfp4(torch.zeros(1, 64), w13_blocks, w13_scales, w2_blocks, w2_scales,
                            torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_cuda_gpt_oss_20b_shapes(num_tokens):
    # GPT-OSS-20B's layer: 32 experts, top-4, hidden and intermediate 2880 (90 groups of 32)
    experts = _experts(32, 2880, 2880, seed=num_tokens)
    x = torch.randn(num_tokens, 2880, generator=generator(num_tokens)).to(torch.bfloat16).to(DEVICE)
    weights, ids = moe_routing(num_tokens, 32, 4, seed=num_tokens)
    _assert_matches(x, experts, weights, ids)
