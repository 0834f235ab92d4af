"""The engine flags that only mean something on CUDA: the decode batch sizes captured as
CUDA graphs (--cuda-graph-sizes, --enforce-eager) and the KV cache sized from the GPU's
memory (--gpu-memory-utilization, the default there). Light to import, like engine_args:
no torch (the driver is asked through cli_flags.cuda_device_count)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from actors.cli_flags import cuda_device_count

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8, up to max_num_seqs and
# at most this many sequences (a larger decode batch runs eagerly, where a launch's cost
# is a small share of the step)
MAX_DEFAULT_CAPTURE_SIZE = 512
# what --gpu-memory-utilization is on CUDA when neither it nor a KV-cache size is given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def on_cuda(device: str) -> bool:
    """Whether a device flag ("auto", "cpu", "cuda", "cuda:N") puts the engine on a GPU."""
    return device.startswith("cuda") or (device == "auto" and cuda_device_count() > 0)


def parse_capture_sizes_flag(text: str) -> list[int]:
    """--cuda-graph-sizes: comma- or space-separated batch sizes."""
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,4,8, got {text!r}") from None


def capture_sizes(sizes: Sequence[int] | str | None, enforce_eager: bool, max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending; () when graphs are off. Sizes above
    max_num_seqs are dropped (no step has that many sequences); a step's batch is padded up
    to the next captured size, and one larger than the largest runs eagerly."""
    if isinstance(sizes, str):
        sizes = parse_capture_sizes_flag(sizes)
    if sizes is not None:
        if isinstance(sizes, (bool, int)) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                     for s in sizes):
            raise ValueError(f"cuda_graph_sizes must be a list of positive integers, got {sizes!r}")
    if enforce_eager:
        return ()
    if sizes is None:
        limit = min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
        sizes = [size for size in (1, 2, 4) if size <= limit] + list(range(8, limit + 1, 8))
        if limit not in sizes:
            sizes.append(limit)
    return tuple(sorted({size for size in sizes if size <= max_num_seqs}))


def check_gpu_memory_utilization(device: str, fraction: float | None) -> None:
    if fraction is not None and not on_cuda(device):
        raise ValueError("gpu_memory_utilization sizes the KV cache from GPU memory, and the engine runs on "
                         "the CPU: size it with kv_cache_memory (--kv-cache-memory) instead")
