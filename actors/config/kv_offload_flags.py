"""The KV tiers' engine arguments (--swap-space, --kv-offload-size, --preemption-mode,
--kv-offload-dir) checked, and the host tier's size in bytes. Torch-free: the launcher checks them."""

from __future__ import annotations

from actors.config.cache import parse_size


def host_kv_bytes(swap_space: float, kv_offload_size: int | str | None, preemption_mode: str | None) -> int:
    """Bytes of the host KV tier per rank (0: none): kv_offload_size, or swap_space GiB
    (vLLM's flag). ValueError naming the field for a bad value, both sizes at once, or
    preemption_mode 'swap' without a tier."""
    if isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or swap_space < 0:
        raise ValueError(f"swap_space must be a non-negative number of GiB, got {swap_space!r}")
    if kv_offload_size is not None and swap_space:
        raise ValueError("swap_space and kv_offload_size both size the host KV tier: give one of them")
    size = parse_size(kv_offload_size, "kv_offload_size") if kv_offload_size is not None \
        else int(swap_space * 2**30)
    if preemption_mode == "swap" and not size:
        raise ValueError("preemption_mode 'swap' needs a host KV tier: set swap_space or kv_offload_size")
    return size


def check_kv_offload_dir(directory: str | None, host_bytes: int, enable_prefix_caching: bool,
                         tensor_parallel_size: int) -> None:
    """ValueError naming kv_offload_dir when the disk tier cannot work with the other arguments."""
    if directory is None:
        return
    if not directory:
        raise ValueError("kv_offload_dir must be a directory path, got ''")
    if not host_bytes:
        raise ValueError("kv_offload_dir needs a host KV tier (blocks come back through it): set swap_space or "
                         "kv_offload_size")
    if not enable_prefix_caching:
        raise ValueError("kv_offload_dir keeps prefix-cache blocks: it needs enable_prefix_caching")
    if tensor_parallel_size != 1:
        raise ValueError("kv_offload_dir: the disk tier runs with tensor_parallel_size 1 only")
