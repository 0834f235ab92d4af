"""The Triton fused MoE (kernels/fused_moe_triton.py) against the torch reference
(kernels/fused_moe_ref.py), under triton's interpreter on a CPU and for real on CUDA; the
routers' conventions; and the block alignment's invariants."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe_ref import dense_mlp_ref, fused_experts_ref, local_expert_ids, route, route_mixtral
from kernels.fused_moe_triton import fused_experts, moe_align_block_size
from tests.kernels.helpers import DEVICE, TOLERANCES, generator, moe_routing, requires_cuda, requires_triton

# fp16's 11-bit mantissa: between fp32's and bf16's
TOLERANCES_ALL = {**TOLERANCES, torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _weights(num_experts, hidden, intermediate, dtype, seed=0, device=DEVICE):
    g = generator(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    return w13.to(dtype).to(device), w2.to(dtype).to(device)


def _assert_matches(x, w13, w2, weights, ids, **kwargs):
    expected = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, **kwargs), expected,
                               **TOLERANCES_ALL[x.dtype])



# (experts, top_k, tokens): fewer tokens than experts, a single decode token, more tokens than
# a 16-row block for one expert, top-1
GRID = [(8, 2, 3), (4, 1, 1), (8, 3, 21), (3, 2, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_experts,top_k,num_tokens", GRID)
@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_fused_experts_match_reference(dtype, num_experts, top_k, num_tokens):
    # hidden 48, intermediate 40: neither a multiple of the 32/64-wide tiles
    w13, w2 = _weights(num_experts, 48, 40, dtype)
    x = torch.randn(num_tokens, 48, generator=generator(num_tokens)).to(dtype).to(DEVICE)
    weights, ids = moe_routing(num_tokens, num_experts, top_k, seed=num_experts * 100 + num_tokens)
    _assert_matches(x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_reductions_over_several_k_tiles(dtype):
    # hidden 200 and intermediate 72: both GEMMs loop over k tiles of 64, the last one partial;
    # intermediate 72 also needs two column tiles of the gate/up kernel
    w13, w2 = _weights(4, 200, 72, dtype, seed=3)
    x = torch.randn(9, 200, generator=generator(8)).to(dtype).to(DEVICE)
    weights, ids = moe_routing(9, 4, 2, seed=12)
    _assert_matches(x, w13, w2, weights, ids)


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_every_token_routed_to_one_expert_and_the_rest_empty():
    # top-2 over experts 5 and 2 only: every token picks both, six experts get no block, and
    # each chosen expert's 20 rows span two blocks
    w13, w2 = _weights(8, 32, 32, torch.float32)
    x = torch.randn(20, 32, generator=generator(7)).to(DEVICE)
    weights, ids = moe_routing(20, 8, 2, seed=3, experts=[5, 2])
    assert set(ids.flatten().tolist()) == {2, 5}
    _assert_matches(x, w13, w2, weights, ids)
    # top-1: every token to expert 5
    ones = torch.ones(20, 1, device=DEVICE)
    fives = torch.full((20, 1), 5, dtype=torch.int64, device=DEVICE)
    _assert_matches(x, w13, w2, ones, fives, block_m=16)


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_block_of_64_rows_and_int64_ids():
    w13, w2 = _weights(2, 32, 16, torch.float32, seed=1)
    x = torch.randn(50, 32, generator=generator(2)).to(DEVICE)
    weights, ids = moe_routing(50, 2, 2, seed=5)
    _assert_matches(x, w13, w2, weights, ids.long(), block_m=64)


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
@pytest.mark.parametrize("allowed", [None, [0, 1, 2]])  # [0, 1, 2]: rank 1 gets no token at all
def test_expert_parallel_ranks_sum_to_the_whole(allowed):
    w13, w2 = _weights(8, 32, 32, torch.float32, seed=2)
    x = torch.randn(10, 32, generator=generator(4)).to(DEVICE)
    weights, ids = moe_routing(10, 8, 3, seed=9, experts=allowed)
    ranks = []
    for first in (0, 4):  # two ranks of 4 experts each; the other rank's experts are -1 here
        local = local_expert_ids(ids, first, 4)
        ranks.append(fused_experts(x, w13[first:first + 4], w2[first:first + 4], weights, local))
        torch.testing.assert_close(ranks[-1], fused_experts_ref(x, w13[first:first + 4], w2[first:first + 4],
                                                                weights, local), **TOLERANCES[torch.float32])
    torch.testing.assert_close(ranks[0] + ranks[1], fused_experts_ref(x, w13, w2, weights, ids),
                               **TOLERANCES[torch.float32])
    if allowed is not None:
        assert torch.equal(ranks[1], torch.zeros_like(ranks[1]))


@pytest.mark.usefixtures("nan_filled_allocations")
@requires_triton
def test_expert_offsets_past_two_to_the_31():
    # three experts 2**30 + 64 elements apart (a view with that stride over 4 GiB of bf16 each
    # for w13 and w2): expert 2's offset, expert * stride, overflows int32 though the stride does
    # not. Allocated, never filled: only the experts' pages become memory (skips where 8 GiB
    # cannot be reserved)
    hidden, intermediate, stride = 64, 32, 2**30 + 64
    try:
        w13, w2 = (torch.empty(2 * stride + rows * cols, dtype=torch.bfloat16, device=DEVICE).as_strided(
            (3, rows, cols), (stride, cols, 1)) for rows, cols in ((2 * intermediate, hidden), (hidden, intermediate)))
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve the weights: {error}")
    small13, small2 = _weights(3, hidden, intermediate, torch.bfloat16, seed=6)
    w13.copy_(small13)
    w2.copy_(small2)
    x = torch.randn(6, hidden, generator=generator(13)).to(torch.bfloat16).to(DEVICE)
    weights, ids = moe_routing(6, 3, 2, seed=14)
    assert 2 in ids
    _assert_matches(x, w13, w2, weights, ids)


def test_alignment_lists_each_slot_once_padded_per_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]], dtype=torch.int32)  # slots 0..5; expert 2 empty
    sorted_ids, expert_ids, total = moe_align_block_size(ids, block_m=4, num_experts=4)
    pad = 6
    # expert 0: slots 1, 4; expert 1: slot 3; expert 3: slots 0, 2, 5; each run padded to 4
    assert sorted_ids.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert sorted_ids.shape == (6 + 4 * 3,) and (sorted_ids[12:] == pad).all()
    assert expert_ids.tolist()[:3] == [0, 1, 3] and (expert_ids[3:] == -1).all()
    assert total.tolist() == [12]
    # expert 3 on another rank (-1): its slots sit past the total, and no block runs them
    sorted_ids, expert_ids, total = moe_align_block_size(torch.where(ids == 3, -1, ids), block_m=4, num_experts=3)
    assert sorted_ids.tolist()[:8] == [1, 4, pad, pad, 3, pad, pad, pad] and total.tolist() == [8]
    assert expert_ids.tolist()[:2] == [0, 1] and (expert_ids[2:] == -1).all()


def test_routers_conventions():
    logits = torch.randn(5, 8, generator=generator(11))
    weights, ids = route(logits, 2, renormalize=False)
    probabilities = torch.softmax(logits, dim=-1)
    assert torch.equal(weights, probabilities.gather(1, ids.long()))
    renormalized, same_ids = route(logits, 2, renormalize=True)
    assert torch.equal(ids, same_ids)
    torch.testing.assert_close(renormalized.sum(-1), torch.ones(5))
    mixtral_weights, mixtral_ids = route_mixtral(logits, 2)
    assert torch.equal(mixtral_ids, ids)
    torch.testing.assert_close(mixtral_weights, renormalized)


def test_one_expert_top_1_is_the_dense_mlp():
    w13, w2 = _weights(1, 32, 16, torch.float32, device="cpu")
    x = torch.randn(4, 32, generator=generator(3))
    gate, up = (x @ w13[0].T).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ w2[0].T
    torch.testing.assert_close(dense_mlp_ref(x, w13[0], w2[0]), expected)


@pytest.mark.gpu
@requires_cuda
@requires_triton
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 1000])
def test_cuda_qwen3_moe_shapes(num_tokens):
    # Qwen3-30B-A3B's layer: 128 experts, top-8, hidden 2048, moe_intermediate 768
    w13, w2 = _weights(128, 2048, 768, torch.bfloat16)
    x = torch.randn(num_tokens, 2048, generator=generator(num_tokens)).to(torch.bfloat16).to(DEVICE)
    weights, ids = moe_routing(num_tokens, 128, 8, seed=num_tokens)
    _assert_matches(x, w13, w2, weights, ids)


@pytest.mark.gpu
@requires_cuda
@requires_triton
def test_cuda_graph_replays_new_routing():
    w13, w2 = _weights(32, 256, 128, torch.bfloat16)
    x = torch.randn(8, 256, generator=generator(1)).to(torch.bfloat16).to(DEVICE)
    weights, ids = moe_routing(8, 32, 4, seed=1)
    fused_experts(x, w13, w2, weights, ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    new_weights, new_ids = moe_routing(8, 32, 4, seed=2)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn(8, 256, generator=generator(2)).to(torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), **TOLERANCES[torch.bfloat16])
