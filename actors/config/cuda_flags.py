"""The engine flags that only mean something on CUDA: the decode batch sizes captured as
CUDA graphs (--cuda-graph-sizes, --enforce-eager) and the KV cache sized from the GPU's
memory (--gpu-memory-utilization, the default there). Light to import, like engine_args:
no torch (the driver is asked through cli_flags.cuda_device_count)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from actors.config.cli_flags import cuda_device_count
from actors.config.json_flags import parse_json_object

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


# vLLM's compilation config keys troupe takes, and the cudagraph modes: FULL (and vLLM's
# default FULL_AND_PIECEWISE, whose mixed steps troupe captures whole) replays mixed steps
# of prefill chunks and decodes from graphs too; FULL_DECODE_ONLY only decode steps; NONE none
COMPILATION_KEYS = ("cudagraph_mode", "max_cudagraph_capture_size", "cudagraph_capture_sizes")
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY", "NONE")
MIXED_SIZE_STEP = 32  # mixed steps' graphs: every multiple of this many tokens up to the largest


def cuda_graph_sizes(args) -> dict[str, tuple[int, ...]]:
    """EngineConfig's graph sizes from the engine arguments (cuda_graph_sizes, enforce_eager,
    compilation_config, max_num_seqs, max_num_batched_tokens): the decode batch sizes, and
    the token counts of the mixed steps' graphs. ValueError names a bad field."""
    config = parse_json_object(args.compilation_config or {}, "compilation_config")
    unknown = sorted(set(config) - set(COMPILATION_KEYS))
    if unknown:
        raise ValueError(f"compilation_config: {', '.join(unknown)} not supported (supported: "
                         f"{', '.join(COMPILATION_KEYS)})")
    mode = config.get("cudagraph_mode", "FULL_AND_PIECEWISE")
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"compilation_config.cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                         f"got {mode!r}")
    largest = config.get("max_cudagraph_capture_size", MAX_DEFAULT_CAPTURE_SIZE)
    if isinstance(largest, bool) or not isinstance(largest, int) or largest < 1:
        raise ValueError(f"compilation_config.max_cudagraph_capture_size must be a positive integer, got {largest!r}")
    sizes = args.cuda_graph_sizes if "cudagraph_capture_sizes" not in config else config["cudagraph_capture_sizes"]
    eager = args.enforce_eager or mode == "NONE"
    decode = capture_sizes(sizes, eager, min(args.max_num_seqs, largest) if sizes is None else args.max_num_seqs)
    budget = args.max_num_batched_tokens or MAX_DEFAULT_CAPTURE_SIZE
    mixed = () if eager or mode == "FULL_DECODE_ONLY" else tuple(
        range(MIXED_SIZE_STEP, min(largest, budget) + 1, MIXED_SIZE_STEP))
    return {"cuda_graph_sizes": decode, "cuda_graph_mixed_sizes": mixed}


def check_gpu_memory_utilization(device: str, fraction: float | None) -> None:
    if fraction is not None and not on_cuda(device):
        raise ValueError("gpu_memory_utilization sizes the KV cache from GPU memory, and the engine runs on "
                         "the CPU: size it with kv_cache_memory (--kv-cache-memory) instead")
