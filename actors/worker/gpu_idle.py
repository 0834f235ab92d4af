"""How much of the time the GPU sits idle while the engine serves: what the actor design
exists to hide (the CPU's share of a step: scheduling, input preparation, sampling's
read-back, the messages between actors).

Off unless TROUPE_GPU_IDLE_PROFILE names a JSON file (benchmarks/gpu_check.sh's serve
stage sets it). Then rank 0's worker skips the first SKIP steps that compute tokens
(start-up, the first prefills), profiles the next STEPS with torch.profiler recording CUDA
activity only (no CPU-side hooks, so the steps run as they would), and writes the window's
wall span, the union of its kernels' intervals and 1 - busy/span: the idle share."""

from __future__ import annotations

import json

import torch

from actors.config.env import GPU_IDLE_PROFILE_VARIABLE, gpu_idle_profile_path

ENV = GPU_IDLE_PROFILE_VARIABLE
SKIP, STEPS = 100, 300


class GpuIdleProfile:
    def __init__(self, path: str, skip: int = SKIP, steps: int = STEPS) -> None:
        self.path, self.skip, self.steps = path, skip, steps
        self.count = 0
        self.profiler: torch.profiler.profile | None = None

    @staticmethod
    def from_env(device: str, rank: int) -> GpuIdleProfile | None:
        path = gpu_idle_profile_path()
        return GpuIdleProfile(path) if path and rank == 0 and device.startswith("cuda") else None

    def step(self) -> None:
        """After each step that computed tokens."""
        self.count += 1
        if self.count == self.skip:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
        elif self.count == self.skip + self.steps and self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            self._write()
            self.profiler = None

    def _write(self) -> None:
        intervals = sorted((event.time_range.start, event.time_range.end) for event in self.profiler.events()
                           if event.device_type == torch.autograd.DeviceType.CUDA)
        busy, end_of_busy = 0.0, None
        for start, end in intervals:  # the union of the kernels' intervals
            if end_of_busy is None or start > end_of_busy:
                busy += end - start
                end_of_busy = end
            elif end > end_of_busy:
                busy += end - end_of_busy
                end_of_busy = end
        span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
        with open(self.path, "w") as f:
            json.dump({"steps": self.steps, "kernels": len(intervals), "span_ms": span / 1e3, "busy_ms": busy / 1e3,
                       "idle_share": 1 - busy / span if span else None,
                       "ms_per_step": span / 1e3 / self.steps}, f)
