"""The CUDA graphs' inputs: persistent device buffers (a graph holds their addresses), filled
for each replayed step from a pinned host copy in two copies, the host copy alternating
between two halves so that a step is staged while the one before it still runs.

Two kinds of graph read them (cuda_graphs.py):
- a decode graph of B sequences (B captured sizes): one token per sequence, padding rows
  past the step's with no KV written (slot -1) and one cached key read, its query offsets
  and decode list constant (0..B);
- a mixed graph of T tokens (prefill chunks and decodes, at most MAX_PREFILLS chunks): the
  step's tokens padded to T, its sequences' lengths, offsets and tables, and the decode and
  prefill lists padded with a dummy sequence (index max_seqs: no tokens, no keys, an empty
  query range), so every attention program past the step's sequences exits at once.
"""

from __future__ import annotations

import numpy as np
import torch

from actors.worker.step_inputs import StepInputs

MAX_PREFILLS = 8  # prefill chunks a mixed graph takes (a step with more runs eagerly)


class GraphInputs:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int,
                 num_groups: int = 1) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.dummy = max_seqs  # the dummy sequence's index
        # int64 rows: token ids, positions, KV slots, pending tokens' places and sources; then
        # the KV slots of layer groups 1.. (actors/config/kv_groups.py)
        rows = 5 + num_groups - 1
        self.longs = torch.zeros(rows, max_tokens, dtype=torch.long, device=device)
        # int32: sequence lengths, query offsets, decode list, prefill list, block tables (one
        # region a layer group)
        sizes = (max_seqs + 1, max_seqs + 2, max_seqs, MAX_PREFILLS) + ((max_seqs + 1) * max_blocks,) * num_groups
        self.offsets = np.cumsum((0,) + sizes)
        self.ints = torch.zeros(int(self.offsets[-1]), dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self.host = [(torch.zeros(rows, max_tokens, dtype=torch.long, pin_memory=pinned),
                      torch.zeros(int(self.offsets[-1]), dtype=torch.int32, pin_memory=pinned), None)
                     for _ in range(2)]
        self._turn = 0
        self.input_ids, self.positions, self.slot_mapping = self.longs[:3]
        self.seq_lens, self.query_start_loc, self.decode_seqs, self.prefill_seqs = (
            self.ints[self.offsets[i]: self.offsets[i + 1]] for i in range(4))
        # each group's slots and tables (group 0's are slot_mapping and block_tables)
        self.group_slot_mappings = [self.slot_mapping] + [self.longs[5 + g] for g in range(num_groups - 1)]
        self.group_block_tables = [self.ints[self.offsets[4 + g]: self.offsets[5 + g]].view(max_seqs + 1, max_blocks)
                                   for g in range(num_groups)]
        self.block_tables = self.group_block_tables[0]
        # a decode graph's constant query offsets and decode list: one token per sequence
        self.one_token_offsets = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.one_token_seqs = torch.arange(max_seqs, dtype=torch.int32, device=device)
        for slots in self.group_slot_mappings:
            slots.fill_(-1)  # (the captures write no KV)
        self.seq_lens[:max_seqs].fill_(1)
        for longs, _, _ in self.host:
            longs[2].fill_(-1)
            longs[5:].fill_(-1)

    def stage_decode(self, step: StepInputs, size: int, previous_sampled: torch.Tensor | None) -> None:
        """A decode step of step.num_seqs sequences (one token each) into the graph of `size`."""
        count = step.num_seqs
        longs, ints = self._host_half()
        self._fill_tokens(longs, step, size)
        ints[:count], ints[count:size] = step.seq_lens, 1  # padding rows: one cached token read
        self._send(longs, ints, count, step, previous_sampled)

    def stage_mixed(self, step: StepInputs, size: int, previous_sampled: torch.Tensor | None) -> None:
        """A step of prefill chunks and decodes (decodes first) into the mixed graph of `size` tokens."""
        count, offsets, dummy = step.num_seqs, self.offsets, self.dummy
        decodes = int((step.query_lens == 1).sum())
        prefills = count - decodes
        longs, ints = self._host_half()
        self._fill_tokens(longs, step, size)
        ints[:count], ints[dummy] = step.seq_lens, 0
        query_offsets = ints[offsets[1]: offsets[2]]
        query_offsets[: count + 1] = step.query_start_loc
        # the dummy's query range is empty: [end, end) of the last sequence when the step holds
        # max_seqs of them (offset max_seqs is then that sequence's end, which must stay), else [0, 0)
        if count < dummy:
            query_offsets[dummy] = 0
        query_offsets[dummy + 1] = query_offsets[dummy]
        decode_list = ints[offsets[2]: offsets[3]]
        decode_list[:decodes], decode_list[decodes: min(size, self.max_seqs)] = np.arange(decodes), dummy
        prefill_list = ints[offsets[3]: offsets[4]]
        prefill_list[:prefills], prefill_list[prefills:] = np.arange(decodes, count), dummy
        self._send(longs, ints, count, step, previous_sampled)

    def _host_half(self) -> tuple[np.ndarray, np.ndarray]:
        host_longs, host_ints, event = self.host[self._turn]
        if event is not None:
            event.synchronize()  # (this half's copies, two steps ago, are done)
        return host_longs.numpy(), host_ints.numpy()

    @staticmethod
    def _fill_tokens(longs: np.ndarray, step: StepInputs, size: int) -> None:
        count = step.num_tokens
        longs[0, :count], longs[1, :count], longs[2, :count] = step.input_ids, step.positions, step.slot_mapping
        longs[2, count:size] = -1  # padding rows: no KV written
        if step.group_slot_mapping is not None:  # layer groups 1..: their slots, padding alike
            longs[5:, :count] = step.group_slot_mapping[1:]
            longs[5:, count:size] = -1
        longs[1, count:size] = 0
        num_pending = len(step.pending_dst)
        longs[3, :num_pending], longs[4, :num_pending] = step.pending_dst, step.pending_src

    def _send(self, longs: np.ndarray, ints: np.ndarray, num_seqs: int, step: StepInputs,
              previous_sampled: torch.Tensor | None) -> None:
        groups = [step.block_tables] if step.group_block_tables is None else step.group_block_tables
        for group, step_tables in enumerate(groups):
            tables = ints[self.offsets[4 + group]: self.offsets[5 + group]].reshape(self.max_seqs + 1, self.max_blocks)
            tables[:num_seqs, : step_tables.shape[1]] = step_tables
        host_longs, host_ints, _ = self.host[self._turn]
        # (whole buffers, contiguous: a strided copy would go through pageable memory; the
        # tables up to the last group's rows in use, the earlier groups' regions whole)
        self.longs.copy_(host_longs, non_blocking=True)
        end = int(self.offsets[-2]) + num_seqs * self.max_blocks
        self.ints[:end].copy_(host_ints[:end], non_blocking=True)
        event = None
        if self.longs.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.host[self._turn] = (host_longs, host_ints, event)
        self._turn ^= 1
        num_pending = len(step.pending_dst)
        if num_pending:
            if previous_sampled is None:
                raise RuntimeError("a step takes tokens the step before it sampled, and that step is gone")
            self.input_ids.index_copy_(0, self.longs[3, :num_pending],
                                       previous_sampled.index_select(0, self.longs[4, :num_pending]))
