"""tune_few_rows: the C++ linear keeps the row counts where it is timed faster than
F.linear, always one and two rows, never more than the limit."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from actors.worker.cpu_tuning import tune_few_rows


def layers(count: int = 2) -> list:
    def weight(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features)

    return [SimpleNamespace(qkv_proj=weight(96, 32), o_proj=weight(32, 32), gate_up_proj=weight(128, 32),
                            down_proj=weight(32, 64)) for _ in range(count)]


class Linear:
    """A stand-in timed against F.linear: no work at all up to `fast_up_to` rows, a
    2 ms delay a call past them."""

    def __init__(self, fast_up_to: int) -> None:
        self.fast_up_to = fast_up_to

    def linear_few_rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.fast_up_to:
            time.sleep(0.002)
        return torch.empty(x.shape[0], weight.shape[0])


def test_rows_are_kept_up_to_the_first_count_where_sgemm_wins():
    assert tune_few_rows(Linear(fast_up_to=16), layers(), limit=16) == 16
    assert tune_few_rows(Linear(fast_up_to=16), layers(), limit=8) == 8
    assert tune_few_rows(Linear(fast_up_to=0), layers(), limit=16) == 2  # one and two rows: untimed
    assert tune_few_rows(Linear(fast_up_to=0), layers(), limit=1) == 1
    assert tune_few_rows(Linear(fast_up_to=6), layers(), limit=16) == 6
