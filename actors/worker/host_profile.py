"""Where a worker's host time goes while the engine serves: a benchmark's view, off unless
TROUPE_WORKER_PROFILE names a text file (benchmarks/gpu_serve.py sets it).

Rank 0's worker skips the first SKIP steps that compute tokens, then for the next STEPS
records each step's kind (a CUDA graph's replay or an eager forward, and whether it held a
prefill), its wall time in execute() and the time it waited for its plan, under cProfile;
it then writes the per-kind counts and medians and the profile's top functions."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict

from actors.config.env import WORKER_PROFILE_VARIABLE, worker_profile_path

ENV = WORKER_PROFILE_VARIABLE
SKIP, STEPS = 450, 300


class HostProfile:
    def __init__(self, path: str, skip: int = SKIP, steps: int = STEPS) -> None:
        self.path, self.skip, self.steps = path, skip, steps
        self.count = 0
        self.profiler: cProfile.Profile | None = None
        self.kinds: dict[str, list[float]] = defaultdict(list)
        self.waits: list[float] = []
        self._last_end: float | None = None

    @staticmethod
    def from_env(rank: int) -> HostProfile | None:
        path = worker_profile_path()
        return HostProfile(path) if path and rank == 0 else None

    def active(self) -> bool:
        return self.profiler is not None

    def begin(self) -> float:
        now = time.perf_counter()
        if self.profiler is not None and self._last_end is not None:
            self.waits.append(now - self._last_end)
        return now

    def end(self, started: float, kind: str) -> None:
        """After each step that computed tokens; kind names what ran."""
        now = time.perf_counter()
        self.count += 1
        if self.profiler is not None:
            self.kinds[kind].append(now - started)
        self._last_end = now
        if self.count == self.skip:
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        elif self.count == self.skip + self.steps and self.profiler is not None:
            self.profiler.disable()
            self._write()
            self.profiler = None

    def _write(self) -> None:
        lines = [f"{self.steps} steps profiled (cProfile on: times are inflated, proportions hold)"]
        for kind, times in sorted(self.kinds.items()):
            lines.append(f"{kind}: {len(times)} steps, execute median {1e3 * statistics.median(times):.2f} ms, "
                         f"mean {1e3 * statistics.mean(times):.2f} ms")
        if self.waits:
            lines.append(f"waiting for the next plan: median {1e3 * statistics.median(self.waits):.3f} ms, "
                         f"mean {1e3 * statistics.mean(self.waits):.3f} ms")
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(self.profiler, stream=text).sort_stats(order).print_stats(45)
            lines.append(text.getvalue())
        with open(self.path, "w") as f:
            f.write("\n".join(lines))
