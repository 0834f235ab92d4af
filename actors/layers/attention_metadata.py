"""The attention inputs of one step, built once by the model runner and read by every
layer of whichever forward runs the step (the model's op by op, or a whole-step fast path).

The runner knows each sequence's lengths as Python numbers before it makes any tensor, so
the host copies are kept beside the device tensors: a backend derives its bookkeeping
(grid sizes, the CPU kernels' plan) from the host numbers, and never reads a device
tensor back (a sync on CUDA). On the CPU the "device" tensors are the host tensors.

The batch is ordered decodes first (sequences with one query token), then prefill
chunks, so the decodes' tokens are the first num_decode_tokens of the flat batch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.paged_attention import PagedAttentionLaunch
from kernels.paged_attention_cpu import CpuAttentionPlan
from kernels.paged_attention_ref import PagedAttentionPlan, SequenceSplit

if TYPE_CHECKING:
    from actors.worker.step_inputs import DeviceInputs, StepInputs

# what each backend's prepare() derives: torch's plan, the cpu backend's, Triton's launch
BackendPlan = PagedAttentionPlan | CpuAttentionPlan | PagedAttentionLaunch


@dataclass
class AttentionMetadata:
    """Attention inputs of one step, in the flat token order of the batch."""

    num_decodes: int  # the first num_decodes sequences have one query token each
    num_prefills: int  # the rest: prefill chunks of several
    num_decode_tokens: int  # == num_decodes: the decodes' tokens lead the batch
    max_query_len: int  # longest query of the step (1 when it only decodes)
    max_seq_len: int  # longest sequence, this step's tokens included
    block_size: int  # tokens per KV cache block
    host: SequenceSplit  # seq_lens and query_start_loc on the host, and the split
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32 on the device, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32 on the device: tokens in the cache after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 on the device
    plan: BackendPlan | None = None  # the backend's bookkeeping from the above, made once per step (prepare)
    # [num_decodes] and [num_prefills] int32 on the device, when the step's inputs were staged
    # with them (actors/worker/step_inputs.py); else the backend makes them from host
    decode_seqs: torch.Tensor | None = None
    prefill_seqs: torch.Tensor | None = None
    # the torch backend's plans of windowed layers, one per window, made on a layer's first
    # ask (the decodes' block pairs differ by window; the plain plan above is the window None's)
    window_plans: dict[int, BackendPlan] = field(default_factory=dict)
    # with layer groups (actors/config/kv_groups.py): each group's metadata (its block tables,
    # slots and plan; groups[0] is this object) and each layer's group; None: one group
    groups: list[AttentionMetadata] | None = None
    layer_groups: list[int] | None = None
    # ... and all groups' tables [groups, num_seqs, width] and slots [groups, num_tokens] in
    # one tensor each (the CPU's one-call step reads a layer's group from them)
    group_block_tables: torch.Tensor | None = None
    group_slot_mapping: torch.Tensor | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer reads: its group's."""
        return self if self.groups is None else self.groups[self.layer_groups[layer]]

    @property
    def kv_groups(self) -> list[AttentionMetadata]:
        """Every group's metadata (a backend prepares each)."""
        return [self] if self.groups is None else self.groups

    @staticmethod
    def build(seq_lens: list[int],  # [num_seqs]: tokens in the cache after this step
              query_start_loc: list[int],  # [num_seqs + 1]: cumulative query lengths
              block_tables: list[list[int]],  # [num_seqs][max_blocks_per_seq], already padded
              slot_mapping: list[int],  # [num_tokens]
              block_size: int, device: torch.device) -> AttentionMetadata:
        host = SequenceSplit.of(seq_lens, query_start_loc)
        num_decodes = len(host.decode_seqs)

        def on_device(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return AttentionMetadata(
            num_decodes=num_decodes, num_prefills=len(host.prefill_seqs), num_decode_tokens=num_decodes,
            # the longest query is a prefill chunk's, when there is one
            max_query_len=max((query_start_loc[seq + 1] - query_start_loc[seq] for seq in host.prefill_seqs),
                              default=1),
            max_seq_len=max(seq_lens), block_size=block_size, host=host,
            slot_mapping=on_device(slot_mapping, torch.long), block_tables=on_device(block_tables, torch.int32),
            seq_lens=on_device(seq_lens, torch.int32), query_start_loc=on_device(query_start_loc, torch.int32))

    @staticmethod
    def staged(step: StepInputs, device: DeviceInputs, block_size: int,
               layer_groups: list[int] | None = None) -> AttentionMetadata:
        """The metadata of a step staged by step_inputs.Stager: its device tensors, and the
        host numbers from the step's arrays; with layer groups, a metadata per group, which
        differ in their block tables and slots only."""
        query_lens = step.query_lens
        decodes = query_lens == 1
        host = SequenceSplit(step.seq_lens.tolist(), step.query_start_loc.tolist(),
                             decode_seqs=np.flatnonzero(decodes).tolist(), prefill_seqs=np.flatnonzero(~decodes).tolist())
        num_decodes = len(host.decode_seqs)
        metadata = AttentionMetadata(
            num_decodes=num_decodes, num_prefills=len(host.prefill_seqs), num_decode_tokens=num_decodes,
            max_query_len=int(query_lens.max()) if num_decodes < len(query_lens) else 1,
            max_seq_len=int(step.seq_lens.max()), block_size=block_size, host=host,
            slot_mapping=device.slot_mapping, block_tables=device.block_tables, seq_lens=device.seq_lens,
            query_start_loc=device.query_start_loc, decode_seqs=device.decode_seqs, prefill_seqs=device.prefill_seqs)
        if device.group_block_tables is not None:
            metadata.groups = [metadata] + [
                replace(metadata, slot_mapping=device.group_slot_mapping[group],
                        block_tables=device.group_block_tables[group], window_plans={})
                for group in range(1, len(device.group_block_tables))]
            metadata.layer_groups = layer_groups
            metadata.group_block_tables, metadata.group_slot_mapping = device.group_block_tables, \
                device.group_slot_mapping
        return metadata
