"""Process-wide settings that make the CPU path fast.

glibc hands allocations above its mmap threshold (32 MiB at most) straight to mmap and
back to the kernel on free, so every step's large activations pay fresh page faults:
measured here, a 64-sequence decode attention ran 3-4x slower for it. Raising the mmap
and trim thresholds keeps freed memory in the heap for the next step."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30

logger = logging.getLogger(__name__)


def tune_allocator() -> None:
    """Idempotent; a no-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt; allocator left as is")
        return
    mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)
    mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)


# Up to this many rows the C++ linear is taken untimed: one or two rows read the weights
# once and won everywhere measured (1.1x-1.8x); a timing at start-up, beside the other
# actors starting, could say otherwise by chance.
_ALWAYS_FEW_ROWS = 2
# Row counts timed above that, smallest first (the first loss ends the search).
_FEW_ROW_COUNTS = (3, 4, 6, 8, 16, 32, 64)
# The most rows the start-up timing tries: past 64 sgemm won everywhere measured.
MAX_FEW_ROWS = 64
_TUNING_LAYERS = 4  # layers whose weights are timed (56 MB for SmolLM2): more than the caches hold, as in a step


def tune_few_rows(native, layers: list, limit: int = 16, baseline=None, clock=None) -> int:
    """The largest row count (up to limit) at which the C++ linear (linear_few_rows) still
    beats F.linear on these decoder layers' weights, timed here (at least 2, see below).

    The kernel reads each weight row once for all rows of x, with a register tile sized for
    the machine's vectors (kernels/cpu_kernels.cpp): where it wins depends on the CPU. On an
    AVX-512 Xeon it beat MKL up to 16 rows; on a 2-core AVX2 EPYC, after its tile was
    made to fit AVX2's 16 registers, up to 64 (171 ms against sgemm's 189 for SmolLM2's
    linears; 31 against 100 at 4 rows: benchmarks/cpu_linear.py). Medians of three passes
    over several layers' weights, so that they stream from memory as in a step; the
    search stops at the first row count where sgemm wins. baseline (F.linear) and clock
    (time.perf_counter) are what is timed against and with: a test's search runs on a
    clock of its own, which no other load on the machine moves."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    baseline = baseline or F.linear
    clock = clock or time.perf_counter

    weights = [w for layer in layers[:_TUNING_LAYERS]
               for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
               if w is not None]  # (an MoE model's sparse layers have no dense MLP)

    def seconds(linear, inputs: list) -> float:
        start = clock()
        for x, weight in zip(inputs, weights):
            linear(x, weight)
        return clock() - start

    best = min(limit, _ALWAYS_FEW_ROWS)
    with torch.inference_mode():
        for rows in _FEW_ROW_COUNTS:
            if rows > limit:
                break
            inputs = [torch.randn(rows, weight.shape[1]) for weight in weights]
            times = [(seconds(native.linear_few_rows, inputs), seconds(baseline, inputs)) for _ in range(3)]
            if statistics.median(cpp for cpp, _ in times) > statistics.median(sgemm for _, sgemm in times):
                break
            best = rows
    logger.info("the C++ linear takes decode batches of up to %d rows", best)
    return best
