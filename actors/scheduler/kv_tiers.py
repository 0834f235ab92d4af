"""The host KV tier's bookkeeping: a second block pool in host memory beside the device's,
for swapped-out requests and spilled prefix-cache blocks (--swap-space / --kv-offload-size).

The scheduler owns both tiers' block ids; the worker only copies (actors/worker/host_kv.py).
Each plan carries copy orders, (device block, host block) pairs: blocks_to_swap_out
(device -> host) and blocks_to_swap_in (host -> device), which the worker runs at the start
of the step, swap-outs first, then swap-ins, then the forward.

Two uses:
  - swap preemption: a preempted request's blocks (full and partial) are copied out, it
    waits with its host blocks (Sequence.swapped), and on admission gets fresh device
    blocks with swap-in orders and continues without recomputing them;
  - prefix spill: a cached device block evicted for reuse is first copied out, keyed by
    the same hash; a later prompt whose hash chain misses on the device and goes on in the
    host tier gets device blocks with swap-in orders, and those tokens count as cached.

Why the orders are safe (the worker runs plans in order, each plan's copies before its
forward):
  - a device block freed while building plan N+1 (preempted, or evicted for reuse) has had
    every write of the plans before N+1 when N+1's swap-out reads it, and N+1's forward
    writes into it (reused) only after that swap-out;
  - a device block that a swap-in fills in plan N+1 is read by N+1's forward, after it;
  - a host block that plan N+1 swaps in is not handed out again (spill, swap-out) before
    N+1 is built: the swap-outs of N+1 run before its swap-ins, so reusing it in the same
    plan would overwrite it first (HostBlockPool.end_of_plan releases them).

A preempted request keeps the KV of its known tokens except the last, which it computes
again: the tokens that plans in flight were sampling are discarded with them (its
generation is bumped, as for recompute), and its next step needs one computed token for
the logits to sample from; so no pending sampled token is carried over a swap.

Default preemption mode (preemption_mode None): swap when the copies cost less than
recomputing (swap_is_cheaper(), decided once by the worker from the model's size and its
device) and the host tier has room; else recompute. Requests that owe prompt logprobs or
pool their prompt are always recomputed (the logprobs of the positions in flight are lost
with the plans' results).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from actors.scheduler.block_pool import BlockHash

if TYPE_CHECKING:
    from actors.scheduler.block_pool import BlockPool
    from actors.scheduler.kv_cache_manager import KVCacheManager
    from actors.scheduler.request import Sequence
    from messages.worker import StepPlan


@dataclass
class SwappedKV:
    """A swapped-out sequence's KV in the host tier: block i holds its tokens
    [i * block_size, (i + 1) * block_size), the first num_tokens of them valid."""

    host_block_ids: list[int]
    num_tokens: int


class HostBlockPool:
    """Host block ids 0..num_blocks-1: free, held by a swapped sequence, or cached under a
    prefix hash (least recently used evicted first)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._hash_of: dict[int, BlockHash] = {}
        self._read_this_plan: set[int] = set()  # cached blocks this plan swaps in: not reused before it goes
        self._freed_this_plan: list[int] = []  # swapped blocks this plan swaps in: free once it goes

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out now: free ones plus cached ones not being read."""
        num_cached_read = sum(1 for block_id in self._read_this_plan if block_id in self._hash_of)
        return len(self._free) + len(self._cached) - num_cached_read

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """num_blocks blocks (free first, then the oldest cached ones), or None and no change."""
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        while len(block_ids) < num_blocks and self._free:
            block_ids.append(self._free.popleft())
        evicted = []  # the oldest first; the scan stops as soon as there are enough
        for block_hash, block_id in self._cached.items():
            if len(block_ids) + len(evicted) == num_blocks:
                break
            if block_id not in self._read_this_plan:
                evicted.append(block_hash)
        for block_hash in evicted:
            block_ids.append(self._cached.pop(block_hash))
            del self._hash_of[block_ids[-1]]
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def free_after_plan(self, block_ids: list[int]) -> None:
        """Frees blocks this plan swaps in, once the plan is built."""
        self._freed_this_plan.extend(block_ids)

    def find(self, block_hash: BlockHash) -> int | None:
        """The cached block of this hash (now the most recently used), or None."""
        block_id = self._cached.get(block_hash)
        if block_id is not None:
            self._cached.move_to_end(block_hash)
        return block_id

    def cache(self, block_hash: BlockHash, block_id: int) -> None:
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash

    def mark_read(self, block_ids: list[int]) -> None:
        self._read_this_plan.update(block_ids)

    def end_of_plan(self) -> None:
        self._read_this_plan.clear()
        self._free.extend(self._freed_this_plan)
        self._freed_this_plan.clear()

    def reset_cache(self) -> int:
        """Forgets every cached block (the device's prefix cache is being reset)."""
        forgotten = [block_id for block_id in self._cached.values() if block_id not in self._read_this_plan]
        for block_id in forgotten:
            del self._cached[self._hash_of.pop(block_id)]
        self._free.extend(forgotten)
        return len(forgotten)


class KVTiers:
    """The host tier beside a scheduler's device pool: copy orders for the next plan, swap
    preemption, prefix spill, and their counters."""

    def __init__(self, num_host_blocks: int, block_size: int, preemption_mode: str | None,
                 swap_is_cheaper: bool, disk_block_hashes: list[BlockHash] | None = None) -> None:
        self.host = HostBlockPool(num_host_blocks)
        self.block_size = block_size
        self.preemption_mode = preemption_mode
        self.swap_is_cheaper = swap_is_cheaper
        self._swap_out_orders: list[tuple[int, int]] = []  # (device block, host block)
        self._swap_in_orders: list[tuple[int, int]] = []  # (host block, device block)
        self.num_swapped = 0  # sequences whose KV waits in the host tier
        self.num_swap_preemptions = 0
        self.num_blocks_swapped_out = 0  # by preemption and spill
        self.num_blocks_swapped_in = 0
        self.num_spilled_blocks = 0  # prefix blocks copied out on eviction
        self.num_spills_dropped = 0  # evicted prefix blocks lost: the host tier was full
        self.num_external_query_tokens = 0  # tokens looked up in the host tier after a device miss
        self.num_external_hit_tokens = 0  # of those, tokens loaded from it
        # the disk tier: hashes with a file (or one being written), None without the tier
        self.disk_hashes: set[BlockHash] | None = set(disk_block_hashes) if disk_block_hashes is not None else None
        self._save_orders: list[tuple[int, BlockHash]] = []  # (device block, hash)
        self._load_orders: list[tuple[BlockHash, int]] = []  # (hash, host block)
        self._loading: dict[BlockHash, int] = {}  # hash -> host block, loads whose result has not come
        self.num_blocks_saved = 0
        self.num_blocks_loaded = 0  # from disk into the host tier
        self.num_failed_loads = 0  # files found missing, short, corrupt or stale at load time

    def attach(self, block_pool: BlockPool) -> None:
        """Spills the pool's evicted prefix blocks here."""
        block_pool.on_evict = self.spill
        if self.disk_hashes is not None:
            block_pool.on_cache = self.save

    # ---- swap preemption ----

    def swap_out(self, seq: Sequence) -> bool:
        """Before a running sequence's blocks are freed: orders its KV copied to the host
        tier and marks it swapped, or returns False (recompute it) by the mode's rule."""
        if self.preemption_mode == "recompute" or (self.preemption_mode is None and not self.swap_is_cheaper):
            return False
        if seq.pooling_params is not None or seq.owes_prompt_logprobs:
            return False
        num_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks == 0:
            return False
        host_block_ids = self.host.allocate(num_blocks)
        if host_block_ids is None:
            return False  # the host tier is full: recompute
        self._swap_out_orders.extend(zip(seq.block_ids[:num_blocks], host_block_ids))
        self.num_blocks_swapped_out += num_blocks
        seq.swapped = SwappedKV(host_block_ids, num_tokens)
        self.num_swapped += 1
        self.num_swap_preemptions += 1
        return True

    def drop_swapped(self, seq: Sequence) -> None:
        """A swapped sequence finished or was aborted: its host blocks are free (no plan
        being built reads them: its swap-out order went with an earlier plan)."""
        if seq.swapped is not None:
            self.host.free(seq.swapped.host_block_ids)
            seq.swapped = None
            self.num_swapped -= 1

    # ---- host hits ----

    def host_hits(self, seq: Sequence, num_device_hit_blocks: int,
                  kv_cache_manager: KVCacheManager) -> tuple[list[int], int]:
        """(host block ids, tokens they hold) that continue a waiting sequence's device
        hits: its own swapped blocks, or spilled prefix blocks whose hashes chain on (kept
        from reuse until the plan goes); admitted() takes them."""
        if seq.swapped is not None:
            swapped = seq.swapped
            start = num_device_hit_blocks * self.block_size
            if start >= swapped.num_tokens:
                return [], 0
            return swapped.host_block_ids[num_device_hit_blocks:], swapped.num_tokens - start
        if not (self.host.num_cached_blocks or self.disk_hashes) or not kv_cache_manager.reads_prefix_cache(seq):
            return [], 0
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        host_block_ids = []
        for block_hash in seq.block_hashes[num_device_hit_blocks:max_hit_blocks]:
            block_id = self.host.find(block_hash)
            if block_id is None:
                break
            host_block_ids.append(block_id)
        if self.disk_hashes and self._load_from_disk(seq.block_hashes[num_device_hit_blocks + len(host_block_ids):
                                                                      max_hit_blocks], len(host_block_ids)):
            return [], -1  # wait: more of its prefix comes from disk into the host tier first
        # from now until the plan goes, a spill must not overwrite them (the plan's
        # swap-outs run before its swap-ins)
        self.host.mark_read(host_block_ids)
        return host_block_ids, len(host_block_ids) * self.block_size

    def admitted(self, seq: Sequence, host_block_ids: list[int], new_block_ids: list[int],
                 num_device_hit_tokens: int) -> None:
        """A sequence got its device blocks: its host hits (from host_hits()) go to the
        first of its new ones; a swapped sequence's host blocks are free after this plan."""
        self._swap_in_orders.extend(zip(host_block_ids, new_block_ids))
        self.num_blocks_swapped_in += len(host_block_ids)
        if seq.swapped is not None:
            self.host.free_after_plan(seq.swapped.host_block_ids)
            seq.swapped = None
            self.num_swapped -= 1
        elif host_block_ids or self.host.num_cached_blocks:
            self.num_external_query_tokens += seq.num_tokens - num_device_hit_tokens
            self.num_external_hit_tokens += len(host_block_ids) * self.block_size

    # ---- prefix spill ----

    def spill(self, device_block_id: int, block_hash: BlockHash) -> None:
        """A cached device block is evicted for reuse: copies it to the host tier under its
        hash (evicting the host's oldest), unless it is there already or no block is free."""
        if self.host.find(block_hash) is not None:
            return
        host_block_ids = self.host.allocate(1)
        if host_block_ids is None:
            self.num_spills_dropped += 1
            return
        self.host.cache(block_hash, host_block_ids[0])
        self._swap_out_orders.append((device_block_id, host_block_ids[0]))
        self.num_spilled_blocks += 1
        self.num_blocks_swapped_out += 1

    # ---- the disk tier ----

    def save(self, device_block_id: int, block_hash: BlockHash) -> None:
        """A block newly cached on the device: written to disk unless a file has it."""
        if block_hash not in self.disk_hashes:
            self.disk_hashes.add(block_hash)
            self._save_orders.append((device_block_id, block_hash))
            self.num_blocks_saved += 1

    def _load_from_disk(self, block_hashes: list[BlockHash], num_host_hits: int) -> bool:
        """Orders the leading hashes with a file loaded into host blocks; whether any of
        them is (or was already) on its way. Only as many as the host tier holds beside the
        num_host_hits blocks of the prefix found there (the newest: allocate() evicts older
        ones first), so a load never evicts another block of the same prefix; the rest of a
        prefix larger than the host tier is recomputed (all or nothing, a restarted server
        loaded none of a 2,000-token prefix through a 64 MiB host tier)."""
        to_load, loading = [], False
        for block_hash in block_hashes:
            if block_hash in self._loading:
                loading = True
            elif block_hash in self.disk_hashes:
                to_load.append(block_hash)
            else:
                break
        to_load = to_load[:max(0, self.host.num_free_blocks - num_host_hits)]
        host_block_ids = self.host.allocate(len(to_load)) if to_load else None
        if host_block_ids is None:
            return loading
        for block_hash, host_block_id in zip(to_load, host_block_ids):
            self._loading[block_hash] = host_block_id
            self._load_orders.append((block_hash, host_block_id))
        return True

    def loaded(self, plan: StepPlan, failed_loads: list[int]) -> None:
        """A plan's disk loads are done: the good blocks join the host cache; a failed one's
        file is forgotten (the worker removed it) and its tokens are recomputed."""
        failed = set(failed_loads)
        for block_hash, host_block_id in plan.blocks_to_load:
            del self._loading[block_hash]
            if host_block_id in failed:
                self.host.free([host_block_id])
                self.disk_hashes.discard(block_hash)
                self.num_failed_loads += 1
            else:
                self.host.cache(block_hash, host_block_id)
                self.num_blocks_loaded += 1

    # ---- plans ----

    def has_orders(self) -> bool:
        """Whether copies wait for the next plan (disk saves may come when nothing else does)."""
        return bool(self._swap_out_orders or self._swap_in_orders or self._save_orders or self._load_orders)

    def with_orders(self, plan: StepPlan) -> StepPlan:
        """The plan with this step's copy orders; the host blocks it reads are reusable after."""
        if self._swap_out_orders or self._swap_in_orders or self._save_orders or self._load_orders:
            plan = msgspec.structs.replace(plan, blocks_to_swap_out=self._swap_out_orders,
                                           blocks_to_swap_in=self._swap_in_orders, blocks_to_save=self._save_orders,
                                           blocks_to_load=self._load_orders)
            self._swap_out_orders, self._swap_in_orders, self._save_orders, self._load_orders = [], [], [], []
        self.host.end_of_plan()
        return plan

    def reset_cache(self) -> None:
        """Forgets the spilled blocks and the disk tier's files (they are written again)."""
        self.host.reset_cache()
        self.drop_saves()
        if self.disk_hashes is not None:
            self.disk_hashes.clear()

    def drop_saves(self) -> None:
        """Forgets the disk saves not sent yet: the device cache they read is about to go."""
        for _, block_hash in self._save_orders:
            self.disk_hashes.discard(block_hash)
        self._save_orders = []

    def stats(self) -> dict[str, int]:
        return {
            "num_swapped": self.num_swapped,
            "num_total_host_blocks": self.host.num_blocks,
            "num_free_host_blocks": self.host.num_free_blocks,
            "num_cached_host_blocks": self.host.num_cached_blocks,
            "num_preemptions_swap": self.num_swap_preemptions,
            "num_blocks_swapped_out": self.num_blocks_swapped_out,
            "num_blocks_swapped_in": self.num_blocks_swapped_in,
            "num_spilled_blocks": self.num_spilled_blocks,
            "num_spills_dropped": self.num_spills_dropped,
            "num_external_prefix_query_tokens": self.num_external_query_tokens,
            "num_external_prefix_hit_tokens": self.num_external_hit_tokens,
            **({"num_disk_blocks": len(self.disk_hashes), "num_blocks_saved_to_disk": self.num_blocks_saved,
                "num_blocks_loaded_from_disk": self.num_blocks_loaded, "num_failed_disk_loads": self.num_failed_loads}
               if self.disk_hashes is not None else {}),
        }


def make_kv_tiers(cache_config, num_host_kv_blocks: int, swap_is_cheaper: bool,
                  disk_block_hashes: list[BlockHash] | None = None) -> KVTiers | None:
    """The tiers of an engine whose workers made num_host_kv_blocks host blocks (None: no
    host tier) and found disk_block_hashes in the disk tier (None: no disk tier)."""
    if num_host_kv_blocks < 1:
        return None
    return KVTiers(num_host_kv_blocks, cache_config.block_size, cache_config.preemption_mode, swap_is_cheaper,
                   disk_block_hashes)
