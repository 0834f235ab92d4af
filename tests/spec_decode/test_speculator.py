"""The worker's speculator without a model: the drafts it proposes and their caps, the
target distribution it verifies sampled requests against (the one the sampler draws
from), and verification: greedy exactly, sampled distributed as the target (chi-square)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from actors.config.speculative import SpeculativeConfig
from actors.worker.model_runner import CachedRequest
from actors.layers.random_sampling import filtered_probs, sample_random
from actors.spec_decode.speculator import Speculator
from messages.common import SamplingParams


def make_request(token_ids: list[int], num_prompt: int, params: SamplingParams, num_blocks: int = 8,
                 request_id: str = "r") -> CachedRequest:
    # a decode: every token but the last computed
    return CachedRequest(request_id, list(token_ids), num_prompt, params, list(range(num_blocks)),
                         len(token_ids) - 1)


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def test_ngram_drafts_follow_the_earlier_occurrence_and_stop_at_the_caps():
    speculator = Speculator(NGRAM, block_size=4, max_model_len=64)
    history = [5, 6, 7, 8, 9, 10, 5, 6, 7]  # "5 6 7" occurred before, followed by 8 9 10 5
    assert speculator.propose(make_request(history, 3, GREEDY), 1, 4) == [8, 9, 10, 5]
    assert speculator.propose(make_request(history, 3, GREEDY), 1, 2) == [8, 9]  # the plan's grant
    # max_tokens: 6 outputs, max_tokens 8: this step's token and one draft
    assert speculator.propose(make_request(history, 3, SamplingParams(temperature=0.0, max_tokens=8)), 1, 4) == [8]
    # the reserved slots: 3 blocks of 4 hold positions 0..11; the last token's is 8, then 3 drafts
    assert speculator.propose(make_request(history, 3, GREEDY, num_blocks=3), 1, 4) == [8, 9, 10]
    assert Speculator(NGRAM, block_size=4, max_model_len=11).propose(make_request(history, 3, GREEDY), 1, 4) == [8]
    # not a decode (a chunk of 2), sampling that reads the output, min_tokens not reached
    assert speculator.propose(make_request(history, 3, GREEDY), 2, 4) == []
    penalized = SamplingParams(temperature=0.0, max_tokens=100, presence_penalty=0.5)
    assert speculator.propose(make_request(history, 3, penalized), 1, 4) == []
    assert speculator.propose(make_request(history, 3, SamplingParams(min_tokens=7, max_tokens=100)), 1, 4) == []


def test_suffix_decoding_is_fed_as_tokens_come_and_keeps_a_finished_output():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    speculator = Speculator(config, block_size=4, max_model_len=64)
    first = make_request([1, 2, 3, 4, 5, 6, 7], 2, GREEDY, request_id="a")
    speculator.propose(first, 1, 4)
    speculator.remove_request("a", first.token_ids)  # its output 3..7 joins the global cache
    later = make_request([9, 3, 4, 5], 1, GREEDY, request_id="b")
    assert speculator.propose(later, 1, 4) == [6, 7]
    later.token_ids += [6]  # it moves on: the new token is fed before the next proposal
    later.num_computed_tokens += 1
    assert speculator.propose(later, 1, 4) == [7]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 12, 0.9, 0.05), (0.5, 0, 1.0, 0.2)])
def test_the_verified_distribution_is_the_one_the_sampler_draws_from(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    probs = filtered_probs(logits, [temperature], [top_k], [top_p], [min_p])[0]
    # the sampler's choice over a fine grid of uniforms: each token's share is its probability
    num = 100_000
    uniforms = (torch.arange(num, dtype=torch.float64) + 0.5) / num
    chosen = sample_random(logits.expand(num, -1), [temperature] * num, [top_k] * num, [top_p] * num,
                           [min_p] * num, uniforms)
    frequencies = torch.bincount(chosen, minlength=40).double() / num
    assert torch.allclose(frequencies, probs.double(), atol=2e-4)
    assert abs(float(probs.sum()) - 1) < 1e-5


def test_greedy_verification_accepts_while_the_argmax_agrees():
    # rows: the decode's position, then one per draft; argmax 3, 4, 9 (the draft said 5), 6
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 4, 9, 6]):
        logits[row, token] = 5.0
    requests = [make_request([1, 2], 1, GREEDY)]
    assert Speculator.verify(logits, requests, [[3, 4, 5]]) == [[3, 4, 9]]
    assert Speculator.verify(logits, requests, [[3, 4, 9]]) == [[3, 4, 9, 6]]  # all accepted, then the bonus
    assert Speculator.verify(logits[:2], requests, [[7]]) == [[3]]  # the first rejected: the target's token


def test_sampled_verification_emits_the_target_distribution():
    # vocab 6, one draft that the target likes little: the first token emitted must still
    # be distributed as p (accepted draft or residual sample), over many requests in a batch
    torch.manual_seed(1)
    target_logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    num_requests, draft = 20_000, 3
    logits = target_logits.repeat(2 * num_requests, 1)  # each request: its decode row, its draft's row
    params = SamplingParams(temperature=1.0, max_tokens=100)
    requests = [make_request([1, 2], 1, params, request_id=str(i)) for i in range(num_requests)]
    emitted = Speculator.verify(logits, requests, [[draft]] * num_requests)
    first = torch.tensor([tokens[0] for tokens in emitted])
    observed = torch.bincount(first, minlength=6).numpy()
    p = target_logits.double().softmax(-1)
    expected = (p / p.sum() * num_requests).numpy()
    assert chisquare(observed, expected).pvalue > 1e-3
    # accepted drafts come with the bonus token after them
    assert all(len(tokens) == 2 for tokens in emitted if tokens[0] == draft)


def test_a_seeded_sampled_request_verifies_the_same_way_twice():
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=100)
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    requests = [make_request([1, 2, 3], 1, params)]
    drafts = [[int(logits[0].argmax()), int(logits[1].argmax()), 0]]
    runs = []
    for global_seed in (3, 4):  # the global generator differs; the request's own does not
        torch.manual_seed(global_seed)
        runs.append(Speculator.verify(logits, requests, drafts))
    assert runs[0] == runs[1]
