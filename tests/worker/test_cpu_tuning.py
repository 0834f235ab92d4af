"""tune_few_rows: the C++ linear keeps the row counts where it is timed faster than
F.linear, always one and two rows, never more than the limit. The search runs on a clock
of the test's own (stand-ins advance it by what they would cost), so it is decided by the
search's logic alone: on a loaded machine the real clock timed microseconds of stand-ins
and could stop the search early by chance."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from actors.worker.cpu_tuning import tune_few_rows


def layers(count: int = 2) -> list:
    def weight(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features)

    return [SimpleNamespace(qkv_proj=weight(96, 32), o_proj=weight(32, 32), gate_up_proj=weight(128, 32),
                            down_proj=weight(32, 64)) for _ in range(count)]


class Clock:
    """Seconds that pass only when a stand-in says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Linear:
    """The C++ linear's stand-in: free up to `fast_up_to` rows, 2 ms a call past them; and
    F.linear's, 1 ms a call whatever the rows."""

    def __init__(self, fast_up_to: int, clock: Clock) -> None:
        self.fast_up_to = fast_up_to
        self.clock = clock

    def linear_few_rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.fast_up_to:
            self.clock.now += 0.002
        return torch.empty(x.shape[0], weight.shape[0])

    def f_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.001
        return torch.empty(x.shape[0], weight.shape[0])


def tuned(fast_up_to: int, limit: int) -> int:
    clock = Clock()
    stand_in = Linear(fast_up_to, clock)
    return tune_few_rows(stand_in, layers(), limit=limit, baseline=stand_in.f_linear, clock=clock)


def test_rows_are_kept_up_to_the_first_count_where_sgemm_wins():
    assert tuned(fast_up_to=16, limit=16) == 16
    assert tuned(fast_up_to=16, limit=8) == 8
    assert tuned(fast_up_to=0, limit=16) == 2  # one and two rows: untimed
    assert tuned(fast_up_to=0, limit=1) == 1
    assert tuned(fast_up_to=6, limit=16) == 6
