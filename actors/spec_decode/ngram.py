"""Prompt-lookup (n-gram) proposer, as vLLM's `NgramProposer`: the drafts for a request are
the tokens that followed the latest earlier occurrence of its last n tokens, for the
longest n in [prompt_lookup_min, prompt_lookup_max] that occurs. Receives each request's
token history (prompt + output so far); sends nothing; owns no per-request state."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from actors.config.speculative import SpeculativeConfig


def _longest_latest_match(history: np.ndarray, max_n: int) -> tuple[int, int]:
    """(n, end): the longest n <= max_n such that history[end-n+1 : end+1] equals the last
    n tokens for some end < len-1, and the latest such end; (0, -1) when nothing matches.

    One vectorised pass per suffix offset t instead of one search per n: `run[end]` stays
    True while history[end-t] == history[-1-t] for every offset so far, so after the loop
    `match_len[end]` is the length of the common suffix ending at `end` (capped at max_n)."""
    history_len = len(history)
    ends = np.arange(history_len - 1)  # the last position is the suffix itself, not an earlier occurrence
    run = np.ones(history_len - 1, dtype=bool)
    match_len = np.zeros(history_len - 1, dtype=np.int64)
    for offset in range(max_n):
        starts = ends - offset
        in_range = starts >= 0
        run &= in_range & (history[np.maximum(starts, 0)] == history[history_len - 1 - offset])
        if not run.any():
            break
        match_len += run
    longest = int(match_len.max(initial=0))
    if longest == 0:
        return 0, -1
    # the latest end among those with the longest match: later text predicts better
    end = int(np.flatnonzero(match_len == longest)[-1])
    return longest, end


class NgramProposer:
    """Batched prompt lookup; the bounds are `SpeculativeConfig.prompt_lookup_min/max`."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) must be in [1, prompt_lookup_max "
                             f"({prompt_lookup_max})]")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        if config.prompt_lookup_min is None or config.prompt_lookup_max is None:
            raise ValueError(f"speculative_config: method {config.method} has no prompt_lookup bounds")
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose_one(self, history: np.ndarray, k: int) -> list[int]:
        """Up to k drafts for one request's tokens (a 1-D int array); [] when no n-gram of
        at least prompt_lookup_min tokens recurs. Fewer than k when the history ends first."""
        if k < 1 or len(history) <= self.prompt_lookup_min:
            return []
        n, end = _longest_latest_match(np.asarray(history), self.prompt_lookup_max)
        if n < self.prompt_lookup_min:
            return []
        # the continuation may run into the suffix itself (a repeating pattern), as in vLLM
        return [int(token) for token in history[end + 1:end + 1 + k]]

    def propose(self, histories: Sequence[np.ndarray], k: int) -> list[list[int]]:
        """Drafts per request, in the order of `histories`."""
        return [self.propose_one(history, k) for history in histories]
