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
_FEW_ROW_COUNTS = (3, 4, 6, 8, 12, 16)
_TUNING_LAYERS = 8  # layers whose weights are timed: more than the caches hold, as in a step


def tune_few_rows(native, layers: list, limit: int = 16) -> int:
    """The largest row count (up to limit) at which the C++ linear (linear_few_rows) still
    beats F.linear on these decoder layers' weights, timed here (at least 2, see below).

    The kernel keeps a tile of rows x weight rows in vector registers: on AVX-512 (32
    registers) it read the weights once for up to 16 rows and beat MKL up to 16; on a
    2-core AVX2 EPYC (16 registers) the tile spills, and 4 rows took 109 ms against
    sgemm's 89, 16 rows 335 against 115 (benchmarks/cpu_linear.py). Medians of three
    passes over several layers' weights, so that they stream from memory as in a step."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    weights = [w for layer in layers[:_TUNING_LAYERS]
               for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]

    def seconds(linear, inputs: list) -> float:
        start = time.perf_counter()
        for x, weight in zip(inputs, weights):
            linear(x, weight)
        return time.perf_counter() - start

    best = min(limit, _ALWAYS_FEW_ROWS)
    with torch.inference_mode():
        for rows in _FEW_ROW_COUNTS:
            if rows > limit:
                break
            inputs = [torch.randn(rows, weight.shape[1]) for weight in weights]
            times = [(seconds(native.linear_few_rows, inputs), seconds(F.linear, inputs)) for _ in range(3)]
            if statistics.median(cpp for cpp, _ in times) > statistics.median(sgemm for _, sgemm in times):
                break
            best = rows
    logger.info("the C++ linear takes decode batches of up to %d rows", best)
    return best
