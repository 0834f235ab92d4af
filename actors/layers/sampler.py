"""Turns a step's logits into tokens: the logits processors (logits_processors.py: custom
per-request ones, penalties, logit bias, allowed token ids, min_tokens, bad words), then
temperature, top-k, top-p, min-p and a greedy or random choice, and the logprobs a
request asked for.

The sampler keeps the live requests' state between steps (sampling_batch.py): the model
runner adds a request when it joins and removes it when it leaves, so a step gathers
its rows' parameters by slot instead of rebuilding them. Every tensor is made on the
logits' device.

Random choice (random_sampling.py) looks one uniform number a row up in the row's
cumulative distribution. A seeded request draws its number from a generator (on the
logits' device) seeded by (seed, number of tokens generated so far): its samples depend
on nothing else in the batch, and survive preemption and recompute unchanged."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from actors.layers.custom_processors import CustomProcessors
from actors.layers.logits_processors import (AllowedTokens, BadWords, LogitBias, LogitsProcessor, MinTokens, Penalties,
                                            RequestProcessor)
from actors.layers.random_sampling import on_device, sample_random
from actors.layers.sampling_batch import SamplingBatch, StepRows
from messages.common import SamplingParams
from messages.scheduler import TokenLogprobs


def default_processors(eos_token_ids: list[int], allowed_custom: tuple[str, ...] = ()) -> list[RequestProcessor]:
    """The built-in processors in the order they apply: custom ones (callables of this
    process, or names of allowed_custom, the engine's --logits-processors) see the model's
    logits; the bans come last, so nothing lifts them."""
    return [CustomProcessors(allowed_custom), Penalties(), LogitBias(), AllowedTokens(), MinTokens(eos_token_ids),
            BadWords()]


@dataclass
class SampledStep:
    """A step's tokens, chosen on the device and not yet read back (Sampler.launch)."""

    rows: StepRows
    sampled: torch.Tensor  # [rows] int64 on the logits' device
    processors: list[LogitsProcessor]  # those that applied to the step's logits
    num_logprobs: np.ndarray  # [rows]: top logprobs asked for; -1: none
    host_tokens: torch.Tensor | None = None  # sampled, on the host (pinned; whole once event is done)
    # when a row asked for logprobs: per row [chosen, top...] values, and [rank, top ids...]
    host_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None
    event: torch.cuda.Event | None = None  # recorded after the copies to the host (CUDA)


class SamplingState(Protocol):
    """What the sampler reads of a request passed to __call__ (a one-step batch)."""

    params: SamplingParams
    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int


class Sampler:
    """Holds the live requests' sampling state (SamplingBatch, and the processors' own)
    between steps: the model runner adds a request when it joins and removes it when it
    leaves, and each step samples rows named by request key. Every tensor it makes is on
    the logits' device."""

    def __init__(self, eos_token_ids: tuple[int, ...], seed: int,
                 processors: list[LogitsProcessor] | None = None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self.batch = SamplingBatch()
        self.processors = default_processors(self.eos_token_ids) if processors is None else processors
        self._generators: dict[torch.device, torch.Generator] = {}  # for unseeded requests, per device

    def add_request(self, key: Hashable, params: SamplingParams, prompt_ids: list[int],
                    output_ids: Sequence[int] = ()) -> None:
        """A request joins (again, after preemption, with the output it had)."""
        self.remove_request(key)
        slot = self.batch.add(key, params, output_ids)
        live_output = self.batch.output_ids[slot]
        for processor in self.processors:
            processor.add_request(slot, params, prompt_ids, live_output)

    def extend_output(self, key: Hashable, tokens: list[int]) -> None:
        """Tokens a request emitted without sample() (verified drafts and the token after
        them): its output and count move on, as the processors and seeds read them."""
        slot = self.batch.slot_of[key]
        self.batch.output_ids[slot].extend(tokens)
        self.batch.num_output[slot] += len(tokens)

    def remove_request(self, key: Hashable) -> None:
        slot = self.batch.remove(key)
        if slot is not None:
            for processor in self.processors:
                processor.remove_request(slot)

    def __call__(self, logits: torch.Tensor,  # [num_requests, vocab] fp32
                 requests: list[SamplingState]) -> tuple[list[int], list[TokenLogprobs] | None]:
        """One step for requests the sampler may not hold: those it does not hold join
        for this step only."""
        joined = [r for r in requests if id(r) not in self.batch.slot_of]
        for r in joined:
            self.add_request(id(r), r.params, r.token_ids[: r.num_prompt_tokens], r.token_ids[r.num_prompt_tokens:])
        try:
            return self.sample(logits, [id(r) for r in requests])
        finally:
            for r in joined:
                self.remove_request(id(r))

    def sample(self, logits: torch.Tensor,  # [num_requests, vocab] fp32, a row per key
               keys: list[Hashable]) -> tuple[list[int], list[TokenLogprobs] | None]:
        """The next token of each request (appended to its output here), and its logprobs
        where the request asked for them."""
        return self.finish(self.launch(logits, keys))

    def launch(self, logits: torch.Tensor,  # [num_requests, vocab] fp32, a row per key
               keys: list[Hashable]) -> SampledStep:
        """Chooses each request's next token on the logits' device, without reading it back:
        the requests' counts move on now (seeds and min_tokens read them), their outputs when
        finish() reads the tokens. Processors that keep their state on the device hear of the
        tokens now, so a step launched before finish() sees them."""
        assert logits.shape[0] == len(keys), f"{logits.shape[0]} logits rows for {len(keys)} requests"
        rows = self.batch.rows(keys, logits.device)
        num_logprobs = self.batch.num_logprobs[rows.slots]
        # logprobs are reported from the model's own distribution, before any processing
        raw_logprobs = logits.log_softmax(-1) if bool((num_logprobs >= 0).any()) else None
        active = [p for p in self.processors if p.wants(rows)]
        if active:
            logits = logits.clone()
            for processor in active:
                processor.apply(logits, rows)
        greedy = self.batch.greedy[rows.slots]
        sampled = argmax_tokens(logits) if greedy.all() else self._sample_random(logits, rows, greedy)
        self.batch.num_output[rows.slots] += 1
        for processor in active:
            if not getattr(processor, "reads_output", False):
                processor.on_sampled(rows, sampled)
        step = SampledStep(rows, sampled, active, num_logprobs)
        # what finish() reads, computed and sent to the host now: a read-back at finish would
        # wait for every step launched since, not for this one alone
        step.host_tokens = _to_host(sampled)
        if raw_logprobs is not None:
            step.host_logprobs = tuple(_to_host(t) for t in _logprob_tensors(raw_logprobs, sampled, num_logprobs))
        if sampled.is_cuda:
            step.event = torch.cuda.Event()
            step.event.record()
        return step

    def finish(self, step: SampledStep) -> tuple[list[int], list[TokenLogprobs] | None]:
        """The launched step's tokens, read back (a wait for that step on a GPU) and appended
        to the outputs; the processors that read the outputs on the host hear of them now."""
        if step.event is not None:
            step.event.synchronize()
        tokens = step.host_tokens.tolist()
        self.batch.append_outputs(step.rows, tokens)
        for processor in step.processors:  # after the outputs have their new tokens
            if getattr(processor, "reads_output", False):
                processor.on_sampled(step.rows, step.sampled)
        if step.host_logprobs is None:
            return tokens, None
        values, ids = (t.tolist() for t in step.host_logprobs)
        logprobs = []
        for i, top in enumerate(step.num_logprobs.tolist()):
            top = min(max(top, 0), len(values[i]) - 1)
            logprobs.append(TokenLogprobs(token_ids=[tokens[i]] + ids[i][1: 1 + top],
                                          logprobs=values[i][: 1 + top], ranks=[ids[i][0]] + list(range(1, top + 1))))
        return tokens, logprobs

    def output_readers(self) -> list[LogitsProcessor]:
        """The processors that read a request's output on the host and hold a request now
        (none, on most steps: then no request's next step waits for its token)."""
        return [p for p in self.processors if getattr(p, "reads_output", False) and getattr(p, "count", 1)]

    def reads_output(self, key: Hashable, readers: list[LogitsProcessor] | None = None) -> bool:
        """Whether a processor (of readers, by default output_readers()) reads this request's
        output on the host: then its next step needs this step's token read back first."""
        slot = self.batch.slot_of.get(key)
        readers = self.output_readers() if readers is None else readers
        return slot is not None and any(p.concerns(slot) for p in readers)

    def _sample_random(self, logits: torch.Tensor, rows: StepRows, greedy: np.ndarray) -> torch.Tensor:
        device = logits.device
        random_rows = np.flatnonzero(~greedy)
        slots = rows.slots[random_rows]
        batch = self.batch
        # one uniform number a row; a seeded request's from its own (seed, position) stream
        uniforms = torch.rand(len(random_rows), generator=self._generator(device), dtype=torch.float64, device=device)
        seeded = np.flatnonzero(batch.seeded[slots])
        if seeded.size:
            draws = [torch.rand(1, generator=torch.Generator(device).manual_seed(position_seed(seed, position)),
                                dtype=torch.float64, device=device)
                     for seed, position in zip(batch.seed[slots[seeded]].tolist(),
                                               rows.num_output[random_rows[seeded]].tolist())]
            uniforms.index_copy_(0, on_device(seeded.tolist(), torch.long, device), torch.cat(draws))
        every_row = len(random_rows) == len(greedy)
        index = None if every_row else on_device(random_rows.tolist(), torch.long, device)
        chosen = sample_random(logits if every_row else logits.index_select(0, index),
                               batch.temperature[slots].tolist(), batch.top_k[slots].tolist(),
                               batch.top_p[slots].tolist(), batch.min_p[slots].tolist(), uniforms)
        if every_row:
            return chosen
        sampled = argmax_tokens(logits)
        sampled[index] = chosen
        return sampled

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:  # [num_requests, vocab] -> [num_requests] int64
    """The first index of each row's largest logit. On the CPU numpy's argmax, measured
    8x faster than torch's on [64, 49152] (0.5 ms against 4 to 8)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


def _logprob_tensors(logprobs: torch.Tensor,  # [rows, vocab]
                     sampled: torch.Tensor,  # [rows] int64
                     num_logprobs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, [the chosen token's logprob, the top k's] and [its rank, the top k's ids], k
    the most any row asked for (each row keeps its own share)."""
    top = min(max(int(num_logprobs.max()), 0), logprobs.shape[-1])
    chosen = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > chosen).sum(-1, keepdim=True) + 1
    if not top:
        return chosen, ranks
    top_values, top_ids = logprobs.topk(top, dim=-1)
    return torch.cat([chosen, top_values], 1), torch.cat([ranks, top_ids], 1)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host: queued (into pinned memory) for a CUDA tensor, the tensor itself otherwise."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def prompt_token_logprobs(logits: torch.Tensor,  # [num_positions, vocab] fp32
                          next_token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """Logprob of each prompt token given the ones before it (row i predicts token i)."""
    if not next_token_ids:
        return []
    tokens = on_device(next_token_ids, torch.long, logits.device)
    values, ids = (t.tolist() for t in _logprob_tensors(logits.log_softmax(-1), tokens, np.array([top])))
    return [TokenLogprobs(token_ids=[token] + row_ids[1:], logprobs=row_values,
                          ranks=[row_ids[0]] + list(range(1, len(row_ids))))
            for token, row_values, row_ids in zip(next_token_ids, values, ids)]


def position_seed(seed: int, step: int) -> int:
    """A generator seed per (request seed, output position); splitmix64's finalizer."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
