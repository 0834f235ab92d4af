"""The sampler on a batch of 256 mixed requests (greedy, temperature, top-k/p, min-p,
penalties, logit bias, allowed tokens, bad words, seeds, min_tokens) against a plain
per-request reference: each greedy row's choice, each random row's support, and the
frequencies of many draws; seeded requests give the same tokens whatever the batch,
across preemption; requests join and leave between steps (slots are reused)."""

from __future__ import annotations

import random

import pytest
import torch

from actors.layers.logits_processors import repetition_penalty
from actors.layers.sampler import Sampler
from messages.common import SamplingParams
from tests.layers.test_random_sampling import assert_frequencies_match, reference_probs

VOCAB = 300
EOS = (0, 1)
COPIES = 16  # of each kind: 16 kinds x 16 = 256 rows

KINDS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(temperature=0.8, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(logit_bias={3: 5.0, 10: -100.0, 50: 2.5}),
    SamplingParams(seed=7, top_p=0.95),
    SamplingParams(min_tokens=40, max_tokens=50, stop_token_ids=[4]),
    SamplingParams(allowed_token_ids=[1, 2, 3, 5, 8, 13, 21, 34]),
    SamplingParams(bad_words_token_ids=[[7], [8, 9], [30, 31, 32]]),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={12: 3.0}, min_tokens=40, max_tokens=50),
    SamplingParams(top_k=1, seed=3, frequency_penalty=-1.0, allowed_token_ids=[9, 8, 7, 0]),
]


class Request:
    def __init__(self, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        self.params, self.token_ids, self.num_prompt_tokens = params, prompt + output, len(prompt)

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def reference_logits(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """One request's processed logits, token by token in float64."""
    p, prompt, output = request.params, request.token_ids[: request.num_prompt_tokens], request.output
    x = logits.double().clone()
    for token in set(prompt + output):
        if p.repetition_penalty != 1.0:
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if p.allowed_token_ids:
        allowed = torch.zeros(VOCAB, dtype=torch.bool)
        allowed[p.allowed_token_ids] = True
        x[~allowed] = float("-inf")
    if len(output) < p.min_tokens:
        for token in (p.stop_token_ids or []) + ([] if p.ignore_eos else list(EOS)):
            x[token] = float("-inf")
    for word in p.bad_words_token_ids or []:
        if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1]:
            x[word[-1]] = float("-inf")
    return x


def reference_distribution(logits: torch.Tensor, request: Request) -> torch.Tensor:
    p = request.params
    x = reference_logits(logits, request)
    if p.is_greedy:
        return torch.nn.functional.one_hot(x.argmax(), VOCAB).double()
    return reference_probs(x, p.temperature, p.top_k, p.top_p, p.min_p)


def make_batch(rng: random.Random, shared: bool = False) -> list[Request]:
    """COPIES of each kind, shuffled; outputs that end in a bad word's prefix, repeat
    tokens (penalties), and are shorter than min_tokens. shared: the copies of a kind
    share their prompt and output (then they share their distribution)."""
    requests = []
    for kind in range(len(KINDS)):
        for copy in range(COPIES):
            if copy == 0 or not shared:
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
                output = [rng.choice([3, 5, 8, 12, 30, 31, rng.randrange(VOCAB)]) for _ in range(rng.randrange(0, 9))]
                output += rng.choice([[], [8], [30, 31]])
            requests.append(Request(KINDS[kind], prompt, output))
    rng.shuffle(requests)
    return requests


def step_logits(generator: torch.Generator, rows: int) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=generator) * 2.5
    logits[:, [0, 1, 4, 7, 9, 12]] += 3.0  # EOS, stop and banned tokens are likely: blocking must show
    return logits


def test_a_mixed_batch_of_256_follows_the_reference_step_after_step():
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    requests = make_batch(rng)
    assert len(requests) == 256
    sampler = Sampler(EOS, seed=1)
    keys = list(range(len(requests)))
    for key, r in zip(keys, requests):
        sampler.add_request(key, r.params, r.token_ids[: r.num_prompt_tokens], r.output)
    for step in range(6):
        if step == 3:  # some leave (their slots are reused), some join, and the order changes
            for key in keys[:40]:
                sampler.remove_request(key)
            new = make_batch(rng)[:40]
            new_keys = list(range(1000 + 40 * step, 1040 + 40 * step))
            for key, r in zip(new_keys, new):
                sampler.add_request(key, r.params, r.token_ids[: r.num_prompt_tokens], r.output)
            keys, requests = keys[40:] + new_keys, requests[40:] + new
            order = list(range(len(keys)))
            rng.shuffle(order)
            keys, requests = [keys[i] for i in order], [requests[i] for i in order]
        logits = step_logits(generator, len(requests))
        tokens, _ = sampler.sample(logits, keys)
        for row, (token, request) in enumerate(zip(tokens, requests)):
            expected = reference_distribution(logits[row], request)
            assert expected[token] > 0, f"step {step} row {row} {request.params}: token {token} is not allowed"
            if request.params.is_greedy:
                assert token == int(expected.argmax())
            request.token_ids.append(token)


def test_draws_of_a_mixed_batch_follow_each_request_s_distribution():
    rng, generator = random.Random(1), torch.Generator().manual_seed(1)
    requests = make_batch(rng, shared=True)
    kind_of = [next(k for k, params in enumerate(KINDS) if r.params is params) for r in requests]
    kind_logits = step_logits(generator, len(KINDS))
    logits = kind_logits[kind_of]
    sampler = Sampler(EOS, seed=2)
    draws = torch.stack([torch.tensor(sampler(logits, requests)[0]) for _ in range(160)])  # [160, 256]
    for kind, params in enumerate(KINDS):
        rows = [row for row, k in enumerate(kind_of) if k == kind]
        expected = reference_distribution(kind_logits[kind], requests[rows[0]])
        kind_draws = draws[:, rows].flatten()
        if params.seed is not None or params.is_greedy:  # the same state draws the same token
            assert expected[kind_draws].min() > 0 and kind_draws.unique().numel() == 1
        else:
            assert_frequencies_match(kind_draws, expected)


def test_seeded_requests_draw_the_same_tokens_alone_in_another_batch_and_across_preemption():
    rng, generator = random.Random(2), torch.Generator().manual_seed(2)
    requests = make_batch(rng)
    seeded = [i for i, r in enumerate(requests) if r.params.seed is not None and not r.params.is_greedy]
    together, alone = Sampler(EOS, seed=3), Sampler(EOS, seed=4)
    for key, r in enumerate(requests):
        together.add_request(key, r.params, r.token_ids[: r.num_prompt_tokens], r.output)
    for key in seeded:
        r = requests[key]
        alone.add_request(key, r.params, r.token_ids[: r.num_prompt_tokens], r.output)
    for step in range(5):
        logits = step_logits(generator, len(requests))
        tokens, _ = together.sample(logits, list(range(len(requests))))
        if step == 2:  # preempted and resumed: it joins again with its output so far
            for key in seeded:
                alone.remove_request(key)
                r = requests[key]
                alone.add_request(key, r.params, r.token_ids[: r.num_prompt_tokens], r.output)
        reversed_rows = seeded[::-1]
        solo, _ = alone.sample(logits[reversed_rows], reversed_rows)
        assert solo[::-1] == [tokens[i] for i in seeded]
        for row, request in enumerate(requests):
            request.token_ids.append(tokens[row])
    assert len({tuple(requests[i].output[-5:]) for i in seeded}) > 1, "the seeded rows all drew the same"


def test_a_processor_no_request_needs_neither_copies_nor_touches_the_logits():
    sampler = Sampler(EOS, seed=0)
    sampler.add_request("a", SamplingParams(temperature=0.0), [5, 6], [])
    sampler.add_request("b", SamplingParams(temperature=0.0, logit_bias={7: 50.0}), [5, 6], [])
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    called = []
    for processor in sampler.processors:
        apply = processor.apply
        processor.apply = lambda logits, rows, apply=apply, name=type(processor).__name__: (called.append(name),
                                                                                              apply(logits, rows))
    tokens, _ = sampler.sample(logits[:1], ["a"])
    assert called == [] and tokens == [int(logits[0].argmax())]
    tokens, _ = sampler.sample(logits.flip(0), ["b", "a"])
    assert called == ["LogitBias"] and tokens[0] == 7


@pytest.mark.parametrize("logprobs", [None, 3])
def test_logprobs_come_from_the_model_s_distribution(logprobs):
    sampler = Sampler(EOS, seed=0)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6))
    sampler.add_request("a", SamplingParams(temperature=0.0, logit_bias={11: 100.0}, logprobs=logprobs), [2], [])
    tokens, result = sampler.sample(logits, ["a"])
    assert tokens == [11]
    if logprobs is None:
        assert result is None
    else:
        assert result[0].token_ids[0] == 11
        assert result[0].logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[11]))
        assert len(result[0].token_ids) == 1 + logprobs


def test_the_sparse_and_the_dense_repetition_penalty_agree():
    generator = torch.Generator().manual_seed(7)
    values = torch.randn(8, VOCAB, generator=generator) * 3
    seen = torch.rand(8, VOCAB, generator=generator) < 0.1
    penalty = torch.linspace(0.5, 2.0, 8)
    sparse, dense = values.clone(), values.clone()
    repetition_penalty(sparse, seen, penalty, sparse=True)
    repetition_penalty(dense, seen, penalty, sparse=False)
    assert torch.equal(sparse, dense) and torch.equal(sparse[~seen], values[~seen])
    assert not torch.equal(sparse[seen], values[seen])
