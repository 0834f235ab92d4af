"""Turns a step's logits into tokens: penalties, logit bias, allowed token ids, bad
words, min_tokens, temperature, top-k, top-p, min-p, greedy or random choice, and the
logprobs a request asked for.

Random choice (random_sampling.py) looks one uniform number a row up in the row's
cumulative distribution. A seeded request draws its number from a generator seeded by
(seed, number of tokens generated so far): its samples depend on nothing else in the
batch, and survive preemption and recompute unchanged."""

from __future__ import annotations

from typing import Protocol

import torch

from actors.worker.random_sampling import sample_random
from messages.common import SamplingParams
from messages.scheduler import TokenLogprobs


class SamplingState(Protocol):
    """What the sampler reads of a request (the model runner's per-request state)."""

    params: SamplingParams
    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests

    def __call__(self, logits: torch.Tensor,  # [num_requests, vocab] fp32
                 requests: list[SamplingState]) -> tuple[list[int], list[TokenLogprobs] | None]:
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        # logprobs are reported from the model's own distribution, before any processing
        raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
        logits = self._process_logits(logits, requests)
        greedy = [r.params.is_greedy for r in requests]
        if all(greedy):
            sampled = _argmax(logits)
        else:
            sampled = self._sample_random(logits, requests, greedy)
        tokens = sampled.tolist()
        if raw_logprobs is None:
            return tokens, None
        return tokens, [_token_logprobs(raw_logprobs[i], tokens[i], r.params.logprobs or 0)
                        for i, r in enumerate(requests)]

    def _process_logits(self, logits: torch.Tensor,
                                        requests: list[SamplingState]) -> torch.Tensor:
        copied = False
        for row, request in enumerate(requests):
            params = request.params
            num_output = len(request.token_ids) - request.num_prompt_tokens
            blocked = _blocked_until_min_tokens(params, num_output, self.eos_token_ids)
            penalized = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                         or params.frequency_penalty != 0.0)
            if not (blocked or penalized or params.logit_bias or params.allowed_token_ids
                    or params.bad_words_token_ids):
                continue
            if not copied:
                logits, copied = logits.clone(), True
            if penalized:
                _apply_penalties(logits[row], request)
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[row, ids] += bias
            if params.allowed_token_ids:
                allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=logits.device)
                kept = logits[row, allowed]
                logits[row] = float("-inf")
                logits[row, allowed] = kept
            if params.bad_words_token_ids:
                blocked = blocked + _bad_word_endings(params.bad_words_token_ids,
                                                      request.token_ids[request.num_prompt_tokens:])
            if blocked:
                logits[row, blocked] = float("-inf")
        return logits

    def _sample_random(self, logits: torch.Tensor, requests: list[SamplingState],
                       greedy: list[bool]) -> torch.Tensor:
        rows = [i for i, g in enumerate(greedy) if not g]
        params = [requests[i].params for i in rows]
        # one uniform number a row; a seeded request's from its own (seed, position) stream
        uniforms = torch.rand(len(rows), generator=self.generator, dtype=torch.float64)
        for position, row in enumerate(rows):
            request = requests[row]
            if request.params.seed is not None:
                generator = torch.Generator().manual_seed(
                    _mix(request.params.seed, len(request.token_ids) - request.num_prompt_tokens))
                uniforms[position] = torch.rand(1, generator=generator, dtype=torch.float64)
        every_row = len(rows) == len(requests)
        index = None if every_row else torch.tensor(rows, device=logits.device)
        chosen = sample_random(logits if every_row else logits.index_select(0, index),
                               [p.temperature for p in params], [p.top_k for p in params],
                               [p.top_p for p in params], [p.min_p for p in params], uniforms)
        if every_row:
            return chosen
        sampled = _argmax(logits)
        sampled[index] = chosen
        return sampled


def _argmax(logits: torch.Tensor) -> torch.Tensor:  # [num_requests, vocab] -> [num_requests] int64
    """The first index of each row's largest logit. On the CPU numpy's argmax, measured
    8x faster than torch's on [64, 49152] (0.5 ms against 4 to 8)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


def _blocked_until_min_tokens(params: SamplingParams, num_output: int,
                              eos_token_ids: list[int]) -> list[int]:
    if num_output >= params.min_tokens:
        return []
    blocked = list(params.stop_token_ids or [])
    if not params.ignore_eos:
        blocked += eos_token_ids
    return blocked


def _bad_word_endings(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: its last token, when the output
    ends with the rest of it (a one-token word is always banned). As vLLM, only the
    output counts, not the prompt."""
    endings = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            endings.append(word[-1])
    return endings


def _apply_penalties(logits: torch.Tensor, request: SamplingState) -> None:
    """In place on one row. Repetition penalty looks at prompt and output (as in vLLM and
    Hugging Face); presence and frequency penalties at the output only (as in OpenAI)."""
    params = request.params
    vocab = logits.shape[0]
    output = torch.tensor(request.token_ids[request.num_prompt_tokens:], dtype=torch.long,
                          device=logits.device)
    output = output[output < vocab]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if output.numel() and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def _token_logprobs(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The chosen token's logprob and rank, then the top `top` tokens."""
    chosen = logprobs[token]
    rank = int((logprobs > chosen).sum()) + 1
    ids, values, ranks = [token], [float(chosen)], [rank]
    top = min(top, logprobs.shape[-1])  # max_logprobs may exceed a small vocabulary
    if top:
        top_values, top_ids = logprobs.topk(top)
        ids += top_ids.tolist()
        values += top_values.tolist()
        ranks += list(range(1, top + 1))
    return TokenLogprobs(token_ids=ids, logprobs=values, ranks=ranks)


def prompt_token_logprobs(logits: torch.Tensor,  # [num_positions, vocab] fp32
                          next_token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """Logprob of each prompt token given the ones before it (row i predicts token i)."""
    logprobs = logits.log_softmax(-1)
    return [_token_logprobs(logprobs[i], token, top) for i, token in enumerate(next_token_ids)]


def _mix(seed: int, step: int) -> int:
    """A generator seed per (request seed, output position); splitmix64's finalizer."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
