"""Multi-LoRA deltas over a batch whose tokens are grouped by adapter (the Punica/S-LoRA
way): the torch reference of the segmented shrink (x·Aᵀ) and expand (·Bᵀ, added into the
base layer's output). kernels/lora_triton.py has the same two operations as Triton kernels
for CUDA; the CPU's one-call step (kernels/cpu_kernels.cpp) runs them with sgemm.

Layout (actors/lora/slots.py builds it), for one layer and one group of projections that
share their input (q/k/v, o, gate/up, down):
- a [num_slots, group_rows, in_features]: slot s's A matrices, its modules' rows one after
  another (slot_rows[s] of them; the rest zero);
- b [num_slots, group_out, max_rank]: slot s's B matrices (scaled by alpha / r, or alpha /
  sqrt(r) with rsLoRA), module m's rows at the module's columns of the group's output;
- a segment is a run of consecutive batch rows (tokens) with one adapter: seg_start,
  seg_len, seg_slot (int32); rows outside every segment (base-model tokens) are untouched.
"""

from __future__ import annotations

import torch


def lora_shrink_reference(x: torch.Tensor,  # [num_tokens, in_features]
                          a: torch.Tensor,  # [num_slots, group_rows, in_features]
                          t: torch.Tensor,  # [num_tokens, group_rows]: written for segment rows
                          seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor,  # [segments]
                          slot_rows: torch.Tensor) -> None:  # [num_slots]: rows of a in use per slot
    """t[rows, :slot_rows[s]] = x[rows] @ a[s, :slot_rows[s]]ᵀ for each segment (rows, s)."""
    rows_of = slot_rows.tolist()
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()):
        rows = rows_of[slot]
        if length and rows:
            torch.mm(x[start:start + length], a[slot, :rows].t(), out=t[start:start + length, :rows])


def lora_expand_reference(t: torch.Tensor,  # [num_tokens, group_rows]: the shrink's output
                          b: torch.Tensor,  # [num_slots, group_out, max_rank]
                          y: torch.Tensor,  # [num_tokens, group_out]: the base output, added to
                          seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor,
                          col_offset: torch.Tensor, rank: torch.Tensor,  # [num_slots]: this module's
                          out_offset: int, out_size: int) -> None:
    """For one module (its out_size output columns at out_offset): y[rows, cols] +=
    t[rows, col_offset[s]:col_offset[s] + rank[s]] @ b[s, cols, :rank[s]]ᵀ per segment;
    a slot whose rank is 0 has no adapter on this module."""
    offsets, ranks = col_offset.tolist(), rank.tolist()
    cols = slice(out_offset, out_offset + out_size)
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()):
        r = ranks[slot]
        if length and r:
            rows = slice(start, start + length)
            y[rows, cols].addmm_(t[rows, offsets[slot]:offsets[slot] + r], b[slot, cols, :r].t())
