"""One step's LoRA deltas: the batch's runs of tokens with one adapter (segments; the model
runner orders the batch so each adapter's tokens are together), and add(), which the
model's forward calls after each group of projections: the base output y gets
x·Aᵀ·Bᵀ of each token's adapter (the segmented shrink and expand of kernels/lora_ref.py,
or on CUDA kernels/lora_triton.py's kernels). The CPU's one-call step reads the same
segments and slots (actors/models/cpu_step.py)."""

from __future__ import annotations

import numpy as np
import torch

from actors.lora.slots import LoRASlots
from kernels.lora_ref import lora_expand_reference, lora_shrink_reference


def segments_of(slots_and_tokens: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(start, length, slot) of each run of consecutive rows with one slot; the batch's
    requests as (slot or -1 for the base model, tokens), in batch order."""
    segments: list[tuple[int, int, int]] = []
    row = 0
    for slot, num_tokens in slots_and_tokens:
        if slot >= 0:
            if segments and segments[-1][2] == slot and segments[-1][0] + segments[-1][1] == row:
                start, length, _ = segments[-1]
                segments[-1] = (start, length + num_tokens, slot)
            else:
                segments.append((row, num_tokens, slot))
        row += num_tokens
    return segments


class LoRABatch:
    def __init__(self, slots: LoRASlots, segments: list[tuple[int, int, int]]) -> None:
        self.slots = slots
        self.segments = segments
        starts, lengths, slot_ids = zip(*segments)
        device = slots.device
        self.seg_start, self.seg_len, self.seg_slot = (torch.tensor(values, dtype=torch.int32, device=device)
                                                        for values in (starts, lengths, slot_ids))
        self.max_seg_len = max(lengths)
        # [layer, group, module]: some adapter of the step adapts it (else its kernels are skipped)
        self.active = slots.rank[:, :, :, sorted(set(slot_ids))].any(axis=3)
        self._use_triton = device.type == "cuda"

    def add(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each segment's adapter's delta for this layer's group of projections."""
        active = self.active[layer, group]
        if not active.any():
            return
        slots = self.slots
        a, b = slots.a[layer][group], slots.b[layer][group]
        rows, col_offset, rank = slots.device_meta
        t = torch.empty(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
        segments = (self.seg_start, self.seg_len, self.seg_slot)
        if self._use_triton:
            from kernels.lora_triton import lora_expand, lora_shrink

            lora_shrink(x, a, t, *segments, rows[layer, group], self.max_seg_len)
            for module in np.flatnonzero(active):
                offset, size = slots.shapes[group].outputs[module]
                lora_expand(t, b, y, *segments, col_offset[layer, group, module], rank[layer, group, module],
                            offset, size, self.max_seg_len)
            return
        lora_shrink_reference(x, a, t, *segments, rows[layer, group])
        for module in np.flatnonzero(active):
            offset, size = slots.shapes[group].outputs[module]
            lora_expand_reference(t, b, y, *segments, col_offset[layer, group, module], rank[layer, group, module],
                                  offset, size)
