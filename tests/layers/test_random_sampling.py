"""Random sampling draws each token with the probability temperature, top-k, top-p and
min-p give it: the empirical frequencies of many draws against a reference computed
independently (a plain sort of the whole distribution), including rows whose nucleus
reaches past the top-p candidates (the whole-row sort fallback) and mixed batches."""

from __future__ import annotations

import pytest
import torch

from actors.layers.random_sampling import sample_random
from actors.layers.sampler import Sampler
from messages.common import SamplingParams

DRAWS = 40_000


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    vocab = logits.shape[-1]
    scaled = logits.double() / temperature
    ordered, order = scaled.sort(descending=True)
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep[top_k:] = False
    probs = torch.where(keep, ordered, torch.tensor(float("-inf"), dtype=torch.float64)).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    keep &= mass_before < top_p
    probs = torch.where(keep, probs, torch.zeros((), dtype=torch.float64))
    probs = probs / probs.sum()
    probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros((), dtype=torch.float64))
    result = torch.zeros(vocab, dtype=torch.float64)
    result[order] = probs / probs.sum()
    return result


def assert_frequencies_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
    freq = counts / tokens.numel()
    tolerance = 5 * (expected * (1 - expected) / tokens.numel()).sqrt() + 2e-3
    worst = ((freq - expected).abs() - tolerance).max()
    assert worst <= 0, f"frequencies off by {worst:.4f} beyond the tolerance"


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
         seed: int = 0) -> torch.Tensor:
    rows = logits.expand(DRAWS, -1).contiguous()
    uniforms = torch.rand(DRAWS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return sample_random(rows, [temperature] * DRAWS, [top_k] * DRAWS, [top_p] * DRAWS, [min_p] * DRAWS, uniforms)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0.0), (0.6, -1, 1.0, 0.0), (1.5, 5, 1.0, 0.0), (1.0, -1, 0.8, 0.0),
    (0.8, 12, 0.7, 0.0), (1.0, -1, 1.0, 0.2), (1.3, 20, 0.95, 0.05)])
def test_draws_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(1)) * 2
    tokens = draw(logits, temperature, top_k, top_p, min_p)
    assert_frequencies_match(tokens, reference_probs(logits, temperature, top_k, top_p, min_p))


def test_a_nucleus_wider_than_the_candidates_sorts_the_whole_row():
    # 3000 nearly equal tokens: top-p 0.9 keeps ~2700 of them, past the 1024 candidates
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(2)) * 0.05
    logits[:3] += 6.0  # and a few likely ones, which the candidates alone would overweight
    tokens = draw(logits, 1.0, -1, 0.9, 0.0)
    expected = reference_probs(logits, 1.0, -1, 0.9, 0.0)
    assert (expected > 0).sum() > 1024
    assert_frequencies_match(tokens, expected)


def test_rows_with_different_settings_in_one_batch():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2000, generator=generator) * 3
    settings = [(1.0, -1, 1.0, 0.0), (0.7, 8, 1.0, 0.0), (1.0, -1, 0.6, 0.0), (1.2, -1, 1.0, 0.1)]
    rows = logits.repeat(DRAWS // 4, 1)
    per_row = settings * (DRAWS // 4)
    uniforms = torch.rand(rows.shape[0], generator=generator, dtype=torch.float64)
    tokens = sample_random(rows, *[[s[i] for s in per_row] for i in range(4)], uniforms)
    for i, setting in enumerate(settings):
        assert_frequencies_match(tokens[i::4], reference_probs(logits[i], *setting))


def test_the_sampler_keeps_greedy_rows_and_seeded_rows_reproducible():
    class Request:
        def __init__(self, params: SamplingParams) -> None:
            self.params, self.token_ids, self.num_prompt_tokens = params, [5, 6, 7], 2

    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    requests = [Request(SamplingParams(temperature=0.0)), Request(SamplingParams(temperature=1.0, seed=11)),
                Request(SamplingParams(temperature=1.0, top_p=0.5))]
    first, _ = Sampler((0,), seed=0)(logits, requests)
    again, _ = Sampler((0,), seed=99)(logits, requests)  # another engine seed: the seeded row stays
    assert first[0] == again[0] == int(logits[0].argmax())
    assert first[1] == again[1]
    nucleus = reference_probs(logits[2], 1.0, -1, 0.5, 0.0)
    assert nucleus[first[2]] > 0 and nucleus[again[2]] > 0
