"""The sampler's per-request state, kept between steps: each live request holds a slot
(a row index, reused once its request leaves) in host arrays of its scalar parameters
and in the logits processors' tensors on the logits' device. The model runner adds a
request when it joins and removes it when it leaves; a step names its requests in the
order of its logits rows, and everything per row is a gather by slot (numpy on the host,
an index tensor on the device), so a step costs no per-request Python work.

The scalars (temperature, top-k, top-p, min-p, seeds, output counts) stay on the host:
they steer which rows take which path (greedy or random, truncated or not), decided
without waiting on the device; what is per token (penalty counts, masks, biases) lives
with the processors, on the device."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from messages.common import SamplingParams


@dataclass
class StepRows:
    """One step's logits rows: the slot of each row, and per row what the sampler reads."""

    slots: np.ndarray  # [rows] int64: the slot of each logits row
    num_output: np.ndarray  # [rows] int64: tokens the row's request generated before this step
    device: torch.device
    _index: torch.Tensor | None = field(default=None, repr=False)

    def index(self) -> torch.Tensor:  # [rows] int64 slots, on the logits' device
        if self._index is None:
            self._index = torch.tensor(self.slots, dtype=torch.long, device=self.device)
        return self._index

    def where(self, flags: np.ndarray) -> np.ndarray:  # [slots] bool -> row numbers whose slot is flagged
        return np.flatnonzero(flags[self.slots])


class SamplingBatch:
    """Slots of the live requests and their scalar sampling parameters."""

    def __init__(self) -> None:
        self.slot_of: dict[Hashable, int] = {}  # request key -> slot
        self.free: list[int] = []  # slots of requests that left, reused first
        self.capacity = 0
        self.params: list[SamplingParams | None] = []
        self.output_ids: list[list[int]] = []  # per slot: the tokens its request generated
        self.temperature = np.ones(0, np.float64)
        self.top_k = np.zeros(0, np.int64)
        self.top_p = np.ones(0, np.float64)
        self.min_p = np.zeros(0, np.float64)
        self.greedy = np.zeros(0, bool)
        self.seeded = np.zeros(0, bool)
        self.seed = np.zeros(0, object)  # Python ints: a seed is any signed 64-bit value
        self.num_output = np.zeros(0, np.int64)
        self.num_logprobs = np.zeros(0, np.int64)  # top logprobs asked for; -1: none

    def __len__(self) -> int:
        return len(self.slot_of)

    def add(self, key: Hashable, params: SamplingParams, output_ids: Sequence[int]) -> int:
        """A joining request's slot (a preempted request comes back with its output so far)."""
        if key in self.slot_of:
            raise ValueError(f"request {key!r} is already in the sampling batch")
        slot = self.free.pop() if self.free else self._grow()
        self.slot_of[key] = slot
        self.params[slot] = params
        self.output_ids[slot] = list(output_ids)
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.greedy[slot] = params.is_greedy
        self.seeded[slot] = params.seed is not None
        self.seed[slot] = params.seed
        self.num_output[slot] = len(output_ids)
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        return slot

    def remove(self, key: Hashable) -> int | None:
        """The slot a leaving request held (None if it had none), now free."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.params[slot] = None
            self.output_ids[slot] = []
            self.free.append(slot)
        return slot

    def rows(self, keys: list[Hashable], device: torch.device) -> StepRows:
        slots = np.fromiter((self.slot_of[key] for key in keys), np.int64, len(keys))
        return StepRows(slots, self.num_output[slots], device)

    def append_tokens(self, rows: StepRows, tokens: list[int]) -> None:
        """Each row's sampled token joins its request's output, and its count moves on."""
        self.num_output[rows.slots] += 1
        self.append_outputs(rows, tokens)

    def append_outputs(self, rows: StepRows, tokens: list[int]) -> None:
        """Each row's sampled token joins its request's output list (its count has moved on
        already: Sampler.launch)."""
        output_ids = self.output_ids
        for slot, token in zip(rows.slots.tolist(), tokens):
            output_ids[slot].append(token)

    def _grow(self) -> int:
        """A new slot at the end, doubling the arrays when they are full."""
        slot = len(self.params)
        if slot == self.capacity:
            self.capacity = max(16, 2 * self.capacity)
            for name in ("temperature", "top_k", "top_p", "min_p", "greedy", "seeded", "seed", "num_output",
                         "num_logprobs"):
                old = getattr(self, name)
                grown = np.zeros(self.capacity, old.dtype)
                grown[: len(old)] = old
                setattr(self, name, grown)
        self.params.append(None)
        self.output_ids.append([])
        return slot
