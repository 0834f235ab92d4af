"""When to build the second plan in flight: just before the worker finishes the first.

With async scheduling the scheduler keeps two plans in flight so that the worker never
waits for one. Built at once, the second plan is fixed while the first still runs: a
request that arrives during a step waits for that step, then for the queued one, then
for its own. On a CPU a prefill-heavy step takes seconds, so the queued step alone added
seconds to time to first token. StepTimer predicts when the running step ends, from the
durations of earlier steps as a line in their token counts (least squares over recent
steps), and the scheduler builds the next plan only a lead time before that: a request
that arrived meanwhile joins it. Short steps (a GPU's, or small decode batches) are
within the lead, so their next plan is still built at once; a step that ends earlier
than predicted costs one round trip, as without overlap."""

from __future__ import annotations

from collections import deque

_MIN_LEAD = 0.02  # seconds: ZeroMQ hops, building and decoding a plan take a few ms
_LEAD_FRACTION = 0.15  # of the predicted step: the prediction's error margin
_HISTORY = 32  # steps the line is fitted to
_MIN_HISTORY = 4  # below this many measured steps, no waiting at all


class StepTimer:
    def __init__(self) -> None:
        self._history: deque[tuple[int, float]] = deque(maxlen=_HISTORY)  # (tokens, seconds)
        self._in_flight: deque[tuple[int, int, float]] = deque()  # (step id, tokens, sent at)
        self._last_finish = 0.0

    def sent(self, step_id: int, num_tokens: int, now: float) -> None:
        self._in_flight.append((step_id, num_tokens, now))

    def finished(self, step_id: int, now: float) -> None:
        """A result arrived: its step ran from when it was sent or the step before it ended."""
        while self._in_flight:
            sent_id, num_tokens, sent_at = self._in_flight.popleft()
            if sent_id == step_id:
                self._history.append((num_tokens, now - max(sent_at, self._last_finish)))
                break
        self._last_finish = now

    def predict(self, num_tokens: int) -> float | None:
        """Seconds a step of num_tokens is expected to take, or None before enough steps."""
        if len(self._history) < _MIN_HISTORY:
            return None
        n = len(self._history)
        mean_x = sum(x for x, _ in self._history) / n
        mean_y = sum(y for _, y in self._history) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._history)
        if var_x < 1e-9:  # every step the same size: the mean, scaled
            return mean_y * num_tokens / mean_x if mean_x else mean_y
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in self._history) / var_x)
        intercept = max(0.0, mean_y - slope * mean_x)
        return intercept + slope * num_tokens

    def dispatch_delay(self, now: float) -> float:
        """Seconds to wait before building the next plan while exactly one is in flight
        (0: build it now)."""
        if len(self._in_flight) != 1:
            return 0.0
        _, num_tokens, sent_at = self._in_flight[0]
        expected = self.predict(num_tokens)
        if expected is None:
            return 0.0
        started = max(sent_at, self._last_finish)
        lead = max(_MIN_LEAD, _LEAD_FRACTION * expected)
        return max(0.0, started + expected - lead - now)
