"""A step's flat inputs, built from each running request's persistent row (vLLM V1's
persistent batch): what is known of a request between steps lives in fixed rows of host
arrays, so a step's input ids, positions, KV slots, sequence lengths and block tables
are numpy gathers and arithmetic over the step's rows, not per-token Python loops.

- BlockTables: each request's block ids in a row of one int32 array, kept as the plans'
  diffs arrive (a new request's table, a continuing one's new blocks).
- StepInputs: one step's arrays on the host, built by `build`; `stage` puts them on the
  device. On CUDA they go through pinned buffers in two copies (int64 and int32), never
  from pageable memory (a copy from pageable memory may wait for the stream, which would
  stall a step queued behind the previous one); the pinned buffers alternate between two
  halves, so a step can be staged while the one before it still runs. On the CPU the
  device tensors are views of the host arrays.
- A decode's input token may not be on the host yet (asynchronous steps: the token the
  previous step sampled is still on the device): `pending` lists those tokens' positions
  in the flat batch and their rows in the previous step's sampled tensor; `stage` copies
  them over on the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class BlockTables:
    """The block table of every live request of a worker, a row each (rows are reused); with
    layer groups (actors/config/kv_groups.py), a table per group in each row, whose ids come
    concatenated, as many per group (actors/scheduler/hybrid_kv_cache.py)."""

    def __init__(self, rows: int = 64, width: int = 64, groups: int = 1) -> None:
        self.tables = np.zeros((groups, rows, width), np.int32)  # [group, row, block]
        self.table = self.tables[0]  # group 0's (the only one without layer groups)
        self.num_groups = groups
        self.num_blocks = np.zeros(rows, np.int64)
        self.free = list(range(rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self.free:
            self._grow(rows=2 * len(self.num_blocks))
        row = self.free.pop()
        self.num_blocks[row] = 0
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        num_new = len(block_ids) // self.num_groups
        end = start + num_new
        if end > self.table.shape[1]:
            self._grow(width=max(end, 2 * self.table.shape[1]))
        if self.num_groups == 1:
            self.table[row, start:end] = block_ids
        else:
            self.tables[:, row, start:end] = np.asarray(block_ids, np.int32).reshape(self.num_groups, num_new)
        self.num_blocks[row] = end

    def remove(self, row: int) -> None:
        self.free.append(row)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width] int32: the rows' tables, each padded with what its row held
        before (block ids past a sequence's length are never read)."""
        return self.table[rows, :width]

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        groups, old_rows, old_width = self.tables.shape
        rows, width = rows or old_rows, width or old_width
        tables = np.zeros((groups, rows, width), np.int32)
        tables[:, :old_rows, :old_width] = self.tables
        self.tables, self.table = tables, tables[0]
        if rows > old_rows:
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(rows - old_rows, np.int64)])
            self.free = list(range(rows - 1, old_rows - 1, -1)) + self.free


@dataclass
class StepInputs:
    """One step's inputs on the host (numpy), in flat batch order (decodes first)."""

    input_ids: np.ndarray  # [num_tokens] int64 (a pending token's entry is a placeholder)
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    seq_lens: np.ndarray  # [num_seqs] int32: tokens in the cache after this step
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    block_tables: np.ndarray  # [num_seqs, width] int32
    query_lens: np.ndarray  # [num_seqs] int64
    pending_dst: np.ndarray  # [pending] int64: flat positions whose token the previous step sampled
    pending_src: np.ndarray  # [pending] int64: those tokens' rows in that step's sampled tensor
    # with layer groups: every group's slot_mapping [groups, num_tokens] and block_tables
    # [groups, num_seqs, width] (group 0's are the fields above); None with one group
    group_slot_mapping: np.ndarray | None = None
    group_block_tables: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def collect(batch: list, tables: BlockTables, block_size: int) -> StepInputs:
    """A step's inputs from its (request, tokens this step) pairs, decodes first. A request
    is a model_runner.CachedRequest: its row in tables, tokens computed, token ids, and
    sampled_row (its last token's row in the previous step's sampled tensor while that token
    is still on the device, else None)."""
    requests = [request for request, _ in batch]
    starts = [request.num_computed_tokens for request in requests]
    counts = [num_tokens for _, num_tokens in batch]
    tokens: list = []
    pending_dst: list[int] = []
    pending_src: list[int] = []
    offset = 0
    for request, start, num_tokens in zip(requests, starts, counts):
        ids = request.token_ids
        if start + num_tokens <= len(ids):
            tokens.append(ids[start] if num_tokens == 1 else ids[start: start + num_tokens])
        else:  # its last input token is the previous step's sample, still on the device
            pending_dst.append(offset + num_tokens - 1)
            pending_src.append(request.sampled_row)
            tokens.append(0 if num_tokens == 1 else ids[start:] + [0])
        offset += num_tokens
    return build(np.array(starts, np.int64), np.array(counts, np.int64),
                 np.array([request.row for request in requests], np.int64), tables, block_size, tokens,
                 pending_dst, pending_src)


def build(computed: np.ndarray,  # [seqs] int64: each sequence's tokens with KV before this step
          query_lens: np.ndarray,  # [seqs] int64: tokens computed this step
          rows: np.ndarray,  # [seqs] int64: each sequence's row in the block tables
          tables: BlockTables, block_size: int,
          token_ids: list,  # per sequence: its tokens [computed, computed + query_len) (a list), or an int: the one token
          pending_dst: list[int], pending_src: list[int]) -> StepInputs:
    num_seqs = len(query_lens)
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = (computed + query_lens).astype(np.int32)
    if num_seqs == num_tokens:  # one token a sequence (every decode step): no repeats
        positions = computed.copy()
        token_rows = rows
        input_ids = np.array(token_ids, np.int64)
    else:
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(computed - query_start_loc[:-1], query_lens)
        token_rows = np.repeat(rows, query_lens)
        input_ids = np.empty(num_tokens, np.int64)
        for seq, tokens in enumerate(token_ids):
            input_ids[query_start_loc[seq]: query_start_loc[seq + 1]] = tokens
    width = int(-(-int(seq_lens.max()) // block_size))
    if tables.num_groups > 1:
        # (contiguous: a mixed fancy index may come back with its groups innermost)
        group_slots = np.ascontiguousarray(tables.tables[:, token_rows, positions // block_size], np.int64) \
            * block_size + positions % block_size
        group_tables = np.ascontiguousarray(tables.tables[:, rows, :width])
        return StepInputs(input_ids, positions, group_slots[0], seq_lens, query_start_loc, group_tables[0],
                          query_lens, np.array(pending_dst, np.int64), np.array(pending_src, np.int64),
                          group_slots, group_tables)
    slot_mapping = tables.table[token_rows, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    return StepInputs(input_ids, positions, slot_mapping, seq_lens, query_start_loc, tables.gather(rows, width),
                      query_lens, np.array(pending_dst, np.int64), np.array(pending_src, np.int64))


@dataclass
class DeviceInputs:
    """A staged step's tensors on the device (views of the staging buffers: valid until the
    step after next is staged)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    decode_seqs: torch.Tensor  # [decodes] int32: sequences with one query token
    prefill_seqs: torch.Tensor  # [prefills] int32
    group_slot_mapping: torch.Tensor | None = None  # [groups, num_tokens] with layer groups
    group_block_tables: torch.Tensor | None = None  # [groups, num_seqs, width] with layer groups


class Stager:
    """Puts StepInputs on the device: two copies from alternating pinned halves on CUDA,
    views of the host arrays on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._halves: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0
        self._capacity = (0, 0)
        self._longs = self._ints = None
        self._index_halves: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._index_turn = 0

    def stage(self, step: StepInputs, previous_sampled: torch.Tensor | None) -> DeviceInputs:
        decode_seqs = np.flatnonzero(step.query_lens == 1).astype(np.int32)
        prefill_seqs = np.flatnonzero(step.query_lens > 1).astype(np.int32)
        grouped = step.group_block_tables is not None
        longs = (step.input_ids, step.positions, step.slot_mapping, step.pending_dst, step.pending_src)
        ints = (step.seq_lens, step.query_start_loc, decode_seqs, prefill_seqs, step.block_tables.reshape(-1))
        if not self.on_cuda:
            views = [torch.from_numpy(a) for a in longs[:3]] + [torch.from_numpy(a) for a in ints[:4]]
            tables = torch.from_numpy(step.block_tables)
            pending = (torch.from_numpy(step.pending_dst), torch.from_numpy(step.pending_src))
            groups = (torch.from_numpy(step.group_slot_mapping), torch.from_numpy(step.group_block_tables)) \
                if grouped else (None, None)
        else:
            if grouped:  # every group's slots and tables ride in the same two copies
                longs += (step.group_slot_mapping.reshape(-1),)
                ints += (step.group_block_tables.reshape(-1),)
            views, tables, pending, extra = self._copy(longs, ints, step.block_tables.shape)
            groups = (extra[0].view(step.group_slot_mapping.shape), extra[1].view(step.group_block_tables.shape)) \
                if grouped else (None, None)
        inputs = DeviceInputs(*views[:3], *views[3:5], tables, *views[5:7], *groups)
        if len(step.pending_dst):
            if previous_sampled is None:
                raise RuntimeError("a step takes tokens the step before it sampled, and that step is gone")
            inputs.input_ids.index_copy_(0, pending[0], previous_sampled.index_select(0, pending[1]))
        return inputs

    def index(self, values: np.ndarray) -> torch.Tensor:
        """int64 values as a device tensor (an index), through pinned memory on CUDA."""
        if not self.on_cuda:
            return torch.from_numpy(values)
        capacity = len(self._index_halves[0][0]) if self._index_halves else 0
        if len(values) > capacity:
            size = max(len(values), 2 * capacity, 256)
            for _, event in self._index_halves:
                if event is not None:
                    event.synchronize()
            self._index_halves = [(torch.empty(size, dtype=torch.long, pin_memory=True), None) for _ in range(2)]
        host, event = self._index_halves[self._index_turn]
        if event is not None:
            event.synchronize()
        host.numpy()[: len(values)] = values
        index = host[: len(values)].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._index_halves[self._index_turn] = (host, event)
        self._index_turn ^= 1
        return index

    def _copy(self, longs: tuple[np.ndarray, ...], ints: tuple[np.ndarray, ...], table_shape: tuple[int, int]):
        num_longs, num_ints = sum(len(a) for a in longs), sum(len(a) for a in ints)
        if num_longs > self._capacity[0] or num_ints > self._capacity[1]:
            self._allocate(max(num_longs, 2 * self._capacity[0]), max(num_ints, 2 * self._capacity[1]))
        host_longs, host_ints, event = self._halves[self._turn]
        if event is not None:
            event.synchronize()  # (the step that used this half two steps ago has its copies done)
        _pack(host_longs.numpy(), longs)
        _pack(host_ints.numpy(), ints)
        self._longs[:num_longs].copy_(host_longs[:num_longs], non_blocking=True)
        self._ints[:num_ints].copy_(host_ints[:num_ints], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._halves[self._turn] = (host_longs, host_ints, event)
        self._turn ^= 1
        long_views = _unpack(self._longs, longs)
        int_views = _unpack(self._ints, ints)
        tables = int_views[4].view(table_shape)
        extra = (long_views[5], int_views[5]) if len(longs) > 5 else None  # the layer groups' slots and tables
        return [*long_views[:3], *int_views[:4]], tables, (long_views[3], long_views[4]), extra

    def _allocate(self, num_longs: int, num_ints: int) -> None:
        self._capacity = (num_longs, num_ints)
        self._longs = torch.empty(num_longs, dtype=torch.long, device=self.device)
        self._ints = torch.empty(num_ints, dtype=torch.int32, device=self.device)
        for half in self._halves:  # (a half's last copies finish before it is dropped)
            if half[2] is not None:
                half[2].synchronize()
        self._halves = [(torch.empty(num_longs, dtype=torch.long, pin_memory=True),
                         torch.empty(num_ints, dtype=torch.int32, pin_memory=True), None) for _ in range(2)]


def _pack(buffer: np.ndarray, arrays: tuple[np.ndarray, ...]) -> None:
    offset = 0
    for array in arrays:
        buffer[offset: offset + len(array)] = array
        offset += len(array)


def _unpack(buffer: torch.Tensor, arrays: tuple[np.ndarray, ...]) -> list[torch.Tensor]:
    views, offset = [], 0
    for array in arrays:
        views.append(buffer[offset: offset + len(array)])
        offset += len(array)
    return views
