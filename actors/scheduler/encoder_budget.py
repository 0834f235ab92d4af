"""The encoder budget (vLLM's max_num_encoder_input_tokens): how many image tokens' vision
encoding one step may start. The worker encodes an image whole in the first step whose
tokens reach its placeholders (actors/models/vision_runner.py), so a step that starts many
images runs many vision towers on top of its decoder tokens; with a budget, a prefill chunk
stops just before the first image that would exceed what is left of the step's budget, and
that image starts in a later step.

An image larger than the whole budget runs alone: the first image a step starts always
fits, so nothing waits forever (refusing it at input instead would refuse images that run
fine, only slower, and the budget is a bound on one step's latency, not on what a request
may carry). The cuts need chunked prefill, which a vision model always has (only encoder
models run whole prompts).

Charges are made when a chunk's size is decided, before its blocks are allocated: a chunk
that then does not run leaves the step with less budget, never more. Off (None) by
default: the scheduler then does no per-step work for it."""

from __future__ import annotations

from collections import deque

from actors.scheduler.request import Sequence

_HISTORY_STEPS = 1024  # steps whose encoder tokens stay inspectable (tests, stats)


class EncoderBudget:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._step_id = -1
        self.started = 0  # image tokens whose encoding the current step starts
        self.num_chunks_cut = 0  # prefill chunks cut short (or held back) by the budget
        self.recent_steps: deque[tuple[int, int]] = deque(maxlen=_HISTORY_STEPS)  # (step id, tokens started)

    def fit(self, seq: Sequence, start: int, num_new_tokens: int, step_id: int, admitting: bool = False) -> int:
        """The tokens of seq's chunk [start, start + num_new_tokens) that the step may
        compute: cut before the first image whose encoding would exceed the step's budget
        (0: the chunk waits). admitting: seq arrives at the worker this step (new,
        resumed), which then encodes an image whose span the chunk starts inside, too."""
        if step_id != self._step_id:
            self._step_id, self.started = step_id, 0
            self.recent_steps.append((step_id, 0))
        end = start + num_new_tokens
        cost = 0
        for mm in seq.mm_inputs:  # in prompt order
            if mm.offset >= end:
                break
            if mm.offset + mm.length <= start or (mm.offset < start and not admitting):
                continue  # done, or its features are already in the worker's encoder cache
            first_of_step = self.started == 0 and cost == 0
            if self.started + cost + mm.length > self.max_tokens and not first_of_step:
                end = max(start, mm.offset)
                self.num_chunks_cut += 1
                break
            cost += mm.length
        if cost:
            self.started += cost
            self.recent_steps[-1] = (step_id, self.started)
        return end - start
