"""The KV cache's layer groups (issue 39; vLLM's hybrid KV-cache manager): which layers share
a block table, and which KV tensor each layer's blocks live in. Torch-free: the scheduler
(its block tables) and the workers (their tensors) derive the same layout from the config.

Layers are grouped by their attention kind, a sliding window or full attention. A group has
one block table per sequence; a sliding group's table drops the blocks its window no longer
sees (actors/scheduler/kv_cache_manager.py), so its KV stays bounded at any context.

Every group has the same number of layers, G, and the cache is G tensors of one shared
pool of blocks: a block id held by group g names, in tensor j, the KV of group g's j-th
layer. So a block costs G layers of KV whichever group holds it, and the pool serves the
groups in whatever proportion the running sequences need (no split fixed at start-up). G
is the greatest common divisor of the kinds' layer counts (Gemma 3's 5 sliding : 1 full
layers: G = 1, six groups); where that would make more than MAX_GROUPS groups, G is the
smallest count and the last group of a kind is padded (slots of its tensors unused).

One group of every layer, full attention (G = the layer count), is the layout of a model
without windows, and of a hybrid one whose engine runs a feature the groups do not support
(hybrid_kv_cache says which)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.config.model import ModelConfig

logger = logging.getLogger(__name__)

MAX_GROUPS = 8  # past this many block tables a step, G grows and slots are padded instead


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing a block table: their window (None: full attention) and indices."""

    sliding_window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    layers_per_group: int  # G: KV tensors in the cache, each with every block of the pool

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        """More than one block table a sequence, or a window freeing blocks."""
        return len(self.groups) > 1 or self.groups[0].sliding_window is not None

    def layer_groups(self, num_layers: int) -> list[int]:
        """Each layer's group."""
        groups = [0] * num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                groups[layer] = index
        return groups

    def layer_slots(self, num_layers: int) -> list[int]:
        """Each layer's KV tensor: its position in its group."""
        slots = [0] * num_layers
        for group in self.groups:
            for position, layer in enumerate(group.layers):
                slots[layer] = position
        return slots


def unified_layout(num_layers: int) -> KVCacheLayout:
    """One full-attention group of every layer: a block holds all layers' KV."""
    return KVCacheLayout((KVCacheGroup(None, tuple(range(num_layers))),), max(num_layers, 1))


def kv_cache_layout(sliding_windows: tuple[int, ...], num_layers: int, hybrid: bool = True) -> KVCacheLayout:
    """The groups of a model whose layer i has window sliding_windows[i] (0: full; empty: all
    full). hybrid False: the unified layout whatever the windows (the kernels still apply
    each layer's window; only the freeing of out-of-window blocks is lost)."""
    windows = [window or None for window in sliding_windows] or [None] * num_layers
    if not hybrid or all(window is None for window in windows):
        return unified_layout(num_layers)
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in kinds.values()]
    size = math.gcd(*counts)
    if sum(-(-count // size) for count in counts) > MAX_GROUPS:
        size = min(counts)
    # full attention first: group 0 is then the one whose table holds every block (scheduler)
    order = sorted(kinds, key=lambda window: (window is not None, window or 0))
    groups = tuple(KVCacheGroup(window, tuple(kinds[window][start:start + size]))
                   for window in order for start in range(0, len(kinds[window]), size))
    return KVCacheLayout(groups, size)


def hybrid_kv_cache(model: ModelConfig, *, disabled: bool, pipeline_parallel: bool, kv_tiers: bool,
                    speculative: bool) -> bool:
    """Whether an engine keeps a block table per group of layers: for a model with sliding
    window layers, unless a feature that does not know the groups yet is on, which is logged
    by name (the windows still apply in attention; only the freeing of their blocks is lost)."""
    if not any(model.sliding_windows):
        return False
    reason = ("--disable-hybrid-kv-cache-manager" if disabled
              else "pipeline parallelism (--pipeline-parallel-size)" if pipeline_parallel
              else "the host and disk KV tiers (--swap-space, --kv-offload-size)" if kv_tiers
              else "speculative decoding (--speculative-config)" if speculative
              else "the Transformers fallback (--model-impl transformers)" if model.model_impl == "transformers"
              else None)
    if reason is not None:
        logger.info("hybrid KV cache off (%s): every layer keeps the KV of every token", reason)
    return reason is None


def engine_kv_layout(engine) -> KVCacheLayout:
    """The layout of an EngineConfig's model, as its cache config resolved it (the scheduler's
    block tables and the workers' tensors both come from this)."""
    model = engine.model
    return kv_cache_layout(model.sliding_windows, model.num_hidden_layers, engine.cache.hybrid_kv_cache)
