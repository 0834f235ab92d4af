"""The segmented multi-LoRA shrink and expand (kernels/lora_triton.py) against their torch
references (kernels/lora_ref.py), and LoRABatch's CUDA branch, which calls them with the
slots' tables, against its reference branch."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from actors.lora.batch import LoRABatch, segments_of
from kernels.lora_ref import lora_expand_reference, lora_shrink_reference
from kernels.lora_triton import lora_expand, lora_shrink
from tests.kernels.helpers import DEVICE, assert_close, generator, poisoned, requires_cuda, requires_triton

pytestmark = [requires_triton, pytest.mark.usefixtures("nan_filled_allocations")]

# a batch of 60 rows: base-model tokens between segments, slot 2 twice, one segment longer
# than a 16-token tile, single-token (decode) segments
SEGMENTS = [(0, 3, 1), (5, 1, 2), (6, 21, 0), (30, 1, 3), (40, 17, 2)]
NUM_TOKENS = 60


def _tables(segments, device=DEVICE):
    starts, lengths, slots = zip(*segments)
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (starts, lengths, slots))


def _segment_rows(segments):
    return [row for start, length, _ in segments for row in range(start, start + length)]


def _draw(seed, *shape, dtype):
    return (torch.randn(*shape, generator=generator(seed)) * 0.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("in_features,group_rows", [(64, 48), (200, 96)])  # 96: two column tiles
def test_shrink_matches_reference(dtype, split_k, in_features, group_rows):
    num_slots = 4
    x = _draw(1, NUM_TOKENS, in_features, dtype=dtype)
    a = _draw(2, num_slots, group_rows, in_features, dtype=dtype)
    slot_rows = torch.tensor([group_rows, group_rows // 3, 16, 0], dtype=torch.int32, device=DEVICE)
    segments = _tables(SEGMENTS)
    expected = torch.zeros(NUM_TOKENS, group_rows, dtype=dtype, device=DEVICE)
    lora_shrink_reference(x, a, expected, *segments, slot_rows)
    t = poisoned(NUM_TOKENS, group_rows, dtype=dtype)
    lora_shrink(x, a, t, *segments, slot_rows, max_seg_len=21, split_k=split_k)
    rows_of = slot_rows.tolist()
    for start, length, slot in SEGMENTS:  # what expand reads: each segment's rows, its slot's columns
        used = slice(start, start + length), slice(0, rows_of[slot])
        assert_close(t[used], expected[used])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_rank", [16, 80])  # 80: two reduction steps for the largest rank
def test_expand_matches_reference_and_leaves_other_rows_and_columns(dtype, max_rank):
    num_slots, group_rows, group_out = 4, 3 * max_rank, 150
    out_offset, out_size = 20, 110  # one module's columns inside the group's output
    t = _draw(3, NUM_TOKENS, group_rows, dtype=dtype)
    b = _draw(4, num_slots, group_out, max_rank, dtype=dtype)
    y = _draw(5, NUM_TOKENS, group_out, dtype=dtype)
    col_offset = torch.tensor([0, max_rank, 2 * max_rank, 5], dtype=torch.int32, device=DEVICE)
    rank = torch.tensor([max_rank, max_rank // 2, 0, 7], dtype=torch.int32, device=DEVICE)  # slot 2: no adapter here
    segments = _tables(SEGMENTS)
    expected = y.clone()
    lora_expand_reference(t, b, expected, *segments, col_offset, rank, out_offset, out_size)
    lora_expand(t, b, y, *segments, col_offset, rank, out_offset, out_size, max_seg_len=21)
    assert_close(y, expected)
    untouched = torch.ones(NUM_TOKENS, group_out, dtype=torch.bool, device=DEVICE)
    for start, length, slot in SEGMENTS:
        if rank[slot]:
            untouched[start:start + length, out_offset:out_offset + out_size] = False
    assert torch.equal(y[untouched], expected[untouched])


def test_no_segments_is_a_no_op():
    x, a = torch.randn(4, 32, device=DEVICE), torch.randn(2, 16, 32, device=DEVICE)
    t = torch.zeros(4, 16, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    lora_shrink(x, a, t, empty, empty, empty, torch.tensor([16, 16], dtype=torch.int32, device=DEVICE), 0)
    assert not t.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_batch_kernel_branch_matches_its_reference_branch(dtype):
    """LoRABatch.add on CUDA calls the Triton kernels with the slots' device tables (per
    layer, group and module); forced onto the kernels here (interpreted on a CPU), it must
    add what its reference branch adds."""
    num_layers, num_groups, num_slots, max_rank, hidden = 2, 2, 3, 16, 48
    shapes = (types.SimpleNamespace(outputs=((0, 32), (32, 16), (48, 16))),  # a q/k/v-like group
              types.SimpleNamespace(outputs=((0, hidden),)))
    a = [[_draw(10 + layer * 2 + g, num_slots, len(shapes[g].outputs) * max_rank, hidden, dtype=dtype)
          for g in range(num_groups)] for layer in range(num_layers)]
    b = [[_draw(20 + layer * 2 + g, num_slots, sum(size for _, size in shapes[g].outputs), max_rank, dtype=dtype)
          for g in range(num_groups)] for layer in range(num_layers)]
    rank = np.zeros((num_layers, num_groups, 3, num_slots), dtype=np.int32)
    col_offset = np.zeros_like(rank)
    rank[:, 0, :, 0], rank[:, 0, :2, 1], rank[1, 1, 0, 2] = 8, 16, 4  # slot 1 adapts q and k only
    col_offset[:, 0, 1, :] = 16
    col_offset[:, 0, 2, :] = 32
    rows = (rank[:, :, :, :] > 0).sum(axis=2).astype(np.int32) * max_rank
    slots = types.SimpleNamespace(
        a=a, b=b, rank=rank, shapes=shapes, device=DEVICE,
        device_meta=tuple(torch.from_numpy(v).to(DEVICE) for v in (rows, col_offset, rank)))
    segments = segments_of([(1, 3), (-1, 2), (0, 18), (2, 1), (1, 1)])
    x = _draw(30, 25, hidden, dtype=dtype)
    for layer in range(num_layers):
        for group in range(num_groups):
            width = b[layer][group].shape[1]
            expected = _draw(40 + group, 25, width, dtype=dtype)
            actual = expected.clone()
            batch = LoRABatch(slots, segments)
            batch._use_triton = False
            batch.add(layer, group, x, expected)
            batch._use_triton = True
            batch.add(layer, group, x, actual)
            # bf16: t is rounded before the expand, one rounding more than a single kernel makes
            assert_close(actual, expected, **({"atol": 4e-2} if dtype == torch.bfloat16 else {}))


@requires_cuda
@pytest.mark.gpu
def test_kernels_compile_on_cuda_at_a_decode_shape():
    """A decode step's shape (one token per request, a long reduction: split-K) compiled
    for the GPU, against the reference."""
    num_tokens, hidden, rank, slots = 64, 2048, 16, 4
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(slots, 3 * rank, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    segments = _tables([(i * 16, 16, i % slots) for i in range(4)], device="cuda")
    slot_rows = torch.full((slots,), 3 * rank, dtype=torch.int32, device="cuda")
    expected = torch.zeros(num_tokens, 3 * rank, device="cuda", dtype=torch.bfloat16)
    lora_shrink_reference(x, a, expected, *segments, slot_rows)
    t = torch.zeros_like(expected)
    lora_shrink(x, a, t, *segments, slot_rows, max_seg_len=16)
    assert_close(t, expected)
