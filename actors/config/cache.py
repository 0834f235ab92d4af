"""The KV cache's configuration (CacheConfig), and parse_size, the byte sizes its flags take.
Torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as "512MiB", "2GiB", "1.5GB", "1048576"."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{name} must be bytes or a size like '512MiB', got {value!r}")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int = 2 * 2**30  # bytes for K and V of all layers (CPU sizing)
    num_kv_blocks: int | None = None  # overrides the size derived from kv_cache_memory
    enable_prefix_caching: bool = True
    # CUDA: size the cache from this share of the GPU's memory (a profiled step decides
    # what the weights and activations leave), instead of kv_cache_memory
    gpu_memory_utilization: float | None = None
    # the host KV tier (actors/scheduler/kv_tiers.py): bytes per rank, 0 for none; and
    # "swap", "recompute" or None (by cost) for a preempted request's KV
    host_kv_bytes: int = 0
    preemption_mode: str | None = None
    kv_offload_dir: str | None = None  # the disk tier below the host tier: a file per prefix block
    # a block table per group of layers, sliding groups freeing what their window no longer
    # sees (actors/config/kv_groups.py); resolved at build: off for models without windows
    # and for engines with a feature the groups do not support
    hybrid_kv_cache: bool = False
