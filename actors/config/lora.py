"""Multi-LoRA serving's configuration (LoRAConfig). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (enable_lora): how many adapters a step may mix and how large."""

    max_loras: int = 1  # adapters resident in a worker's slots at once, so distinct adapters in a step
    max_lora_rank: int = 16  # the largest rank an adapter may have (slots are this wide)
    max_cpu_loras: int = 1  # adapters kept loaded in host memory (least recently used evicted), >= max_loras
