"""Prompt lookup: which earlier occurrence is matched, how long an n-gram, how many drafts."""

import numpy as np
import pytest

from actors.config.speculative import parse_speculative_config
from actors.spec_decode.ngram import NgramProposer


def history(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_proposes_what_followed_the_earlier_occurrence():
    # the last 3 tokens (1 2 3) occurred at the start, followed by 4 5 6
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    assert proposer.propose_one(history(1, 2, 3, 4, 5, 6, 9, 1, 2, 3), k=3) == [4, 5, 6]


def test_latest_occurrence_wins():
    # "1 2" occurs twice before the end: followed by 7 first, by 8 later; the later one counts
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    assert proposer.propose_one(history(1, 2, 7, 0, 1, 2, 8, 0, 1, 2), k=2) == [8, 0]


def test_longest_match_beats_a_later_shorter_one():
    # the 3-gram "5 1 2" occurs early (then 7); only the 2-gram "1 2" occurs later (then 8)
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    tokens = history(5, 1, 2, 7, 0, 1, 2, 8, 0, 5, 1, 2)
    assert proposer.propose_one(tokens, k=1) == [7]
    # with n capped at 2 the later 2-gram wins
    assert NgramProposer(2, 2).propose_one(tokens, k=1) == [8]


def test_match_shorter_than_min_proposes_nothing():
    # only the last token (2) recurs; a 2-gram is required
    tokens = history(2, 9, 4, 2)
    assert NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4).propose_one(tokens, k=3) == []
    assert NgramProposer(prompt_lookup_min=1, prompt_lookup_max=4).propose_one(tokens, k=3) == [9, 4, 2]


def test_no_recurrence_and_short_histories_propose_nothing():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    assert proposer.propose_one(history(1, 2, 3, 4, 5), k=3) == []
    assert proposer.propose_one(history(7), k=3) == []
    assert proposer.propose_one(history(), k=3) == []


def test_drafts_stop_where_the_history_ends():
    # the match's continuation runs into the suffix itself and then the end: 2 drafts, not 5
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    assert proposer.propose_one(history(3, 1, 2, 1, 2), k=5) == [1, 2]
    assert proposer.propose_one(history(1, 2, 6, 1, 2), k=5) == [6, 1, 2]


def test_batched_propose_keeps_the_order_of_requests():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2)
    histories = [history(1, 2, 3, 1), history(4, 5, 6), history(7, 8, 7, 8)]
    assert proposer.propose(histories, k=2) == [[2, 3], [], [7, 8]]


def test_matches_a_brute_force_search_on_random_histories():
    # the oracle: for n from max down to min, the latest earlier occurrence of the last n tokens
    def brute_force(tokens: list[int], low: int, high: int, k: int) -> list[int]:
        for n in range(high, low - 1, -1):
            if n >= len(tokens):
                continue
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    rng = np.random.default_rng(0)
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40)))
        assert proposer.propose_one(tokens, k=3) == brute_force(tokens.tolist(), 2, 4, 3)


def test_bad_bounds_raise():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_min=3, prompt_lookup_max=2)


def test_built_from_a_parsed_config():
    proposer = NgramProposer.from_config(parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
    assert (proposer.prompt_lookup_min, proposer.prompt_lookup_max) == (2, 4)
