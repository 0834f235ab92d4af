"""The KV block pool: fixed-size blocks with reference counts and a prefix cache.

A block holds the KV of `block_size` consecutive tokens of one sequence. A sequence's
block table lists its blocks in token order. Blocks are shared between sequences only
through the prefix cache, and only when full: a full block is keyed by the hash of
(its parent block's hash, its token ids, its extra keys), so equal keys mean equal whole
prefixes computed under equal conditions (see kv_cache_manager for the extra keys).

A block is in exactly one of three states:
  - held: ref_count > 0 (it may also be cached, then other sequences may share it);
  - free and uncached: allocated first, in FIFO order;
  - free and cached (ref_count == 0 but still in the hash map): reusable by a prefix
    hit until evicted; evicted least-recently-used, and only when no uncached free
    block is left.

Plain object, no torch: the workers hold the KV tensors, this only hands out ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence

import msgspec

# sha256 digest of (parent digest, token ids, extra keys): collisions are not a practical
# concern, unlike Python's 64-bit hash(), and the value is stable across processes.
BlockHash = bytes

_ROOT_HASH = b""  # the parent of a sequence's first block
_EXTRA_KEYS_TAG = b"\0extra_keys\0"  # after the fixed-width token bytes: no key looks like tokens


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Hashable, ...] | None = None) -> BlockHash:
    """The prefix-cache key of a full block: it depends on every token before it through
    parent_hash (None for a sequence's first block), and on extra_keys, what besides the
    tokens decides the block's KV (adapter, cache salt, multimodal inputs; None when
    nothing does). extra_keys hold str, bytes, int, None and tuples of them."""
    hasher = hashlib.sha256(parent_hash or _ROOT_HASH)
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        hasher.update(_EXTRA_KEYS_TAG)
        hasher.update(msgspec.msgpack.encode(extra_keys))
    return hasher.digest()


class NoFreeBlocksError(RuntimeError):
    """allocate() was asked for more blocks than are free; callers check first."""


class BlockPool:
    """Hands out KV block ids 0..num_blocks-1 with reference counts and prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self._ref_counts = [0] * num_blocks  # block_id -> number of block tables holding it
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks  # block_id -> cache key
        self._hash_to_block_id: dict[BlockHash, int] = {}
        self._free_uncached_ids: deque[int] = deque(range(num_blocks))
        # Free but cached blocks, least recently used first (values unused).
        self._evictable_ids: OrderedDict[int, None] = OrderedDict()

        # called with (block id, hash) before a cached block is evicted for reuse: the host
        # tier spills it (actors/scheduler/kv_tiers.py); None: evicted blocks are lost
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        self.on_cache: Callable[[int, BlockHash], None] | None = None  # a block newly cached (the disk tier)
        self.num_prefix_query_tokens = 0  # tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of those, tokens served from the cache

    # ---- inspection ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out now: uncached free ones plus evictable ones."""
        return len(self._free_uncached_ids) + len(self._evictable_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or evictable."""
        return len(self._hash_to_block_id)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The block's prefix-cache key, or None when it is not cached."""
        return self._block_hashes[block_id]

    def stats(self) -> dict[str, float | int]:
        """Blocks in all, free, held and cached, the share held, and the prefix cache's
        token counts."""
        return {
            "num_total_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_held_blocks": self.num_blocks - self.num_free_blocks,
            "num_cached_blocks": self.num_cached_blocks,
            "usage": self.usage,
            "kv_cache_usage": self.usage,  # the scheduler's (and /metrics') name
            "num_prefix_query_tokens": self.num_prefix_query_tokens,
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
        }

    # ---- prefix cache ----

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of a sequence of num_tokens tokens whose
        full blocks hash to block_hashes. No side effect: reuse() takes the blocks.

        The hit stops short of the last token: the model must compute at least one token
        to produce the logits the next token is sampled from."""
        if not self.enable_prefix_caching:
            return []
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hit_block_ids: list[int] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block_id = self._hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        """The block cached under block_hash, or None. No side effect."""
        return self._hash_to_block_id.get(block_hash)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts one lookup whose result was used (a sequence admitted)."""
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += num_query_tokens
            self.num_prefix_hit_tokens += num_hit_tokens

    def cache_full_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Registers a held block whose tokens are all computed under its key. When an
        equal block is already cached (two sequences computed the same prefix at once),
        this one stays uncached and is simply freed later."""
        assert self._ref_counts[block_id] > 0, f"caching unheld block {block_id}"
        if not self.enable_prefix_caching:
            return
        current_hash = self._block_hashes[block_id]
        if current_hash is not None:
            assert current_hash == block_hash, f"block {block_id} cached under another key"
            return
        if block_hash in self._hash_to_block_id:
            return
        self._block_hashes[block_id] = block_hash
        self._hash_to_block_id[block_hash] = block_id
        if self.on_cache is not None:
            self.on_cache(block_id, block_hash)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no sequence holds (held ones stay cached until freed),
        so the next requests compute their prompts afresh, as benchmarks repeating a
        workload need. Returns the number of blocks forgotten."""
        forgotten = list(self._evictable_ids)
        self._evictable_ids.clear()
        for block_id in forgotten:
            self._evict(block_id)
            self._free_uncached_ids.append(block_id)
        return len(forgotten)

    # ---- allocation ----

    def can_allocate(self, num_new_blocks: int, reused_block_ids: Sequence[int] = ()) -> bool:
        """Whether reuse(reused_block_ids) then allocate(num_new_blocks) would succeed:
        reusing an evictable block takes it out of the free blocks."""
        num_evictable_reused = sum(1 for block_id in reused_block_ids if self._ref_counts[block_id] == 0)
        return num_new_blocks + num_evictable_reused <= self.num_free_blocks

    def reuse(self, block_ids: Sequence[int]) -> None:
        """Takes one more reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                assert self._block_hashes[block_id] is not None, f"reusing uncached free block {block_id}"
                del self._evictable_ids[block_id]
            self._ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """num_blocks fresh blocks, each with ref_count 1. Uncached free blocks go first;
        then cached ones are evicted, least recently used first."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free_uncached_ids:
                block_id = self._free_uncached_ids.popleft()
            else:
                block_id, _ = self._evictable_ids.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(block_id, self._block_hashes[block_id])
                self._evict(block_id)
            assert self._ref_counts[block_id] == 0
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one reference on each block of a block table. The table is released
        tail first, so among its cached blocks the tail is evicted before the head: a
        later request sharing the prefix more likely needs the head."""
        for block_id in reversed(block_ids):
            assert self._ref_counts[block_id] > 0, f"freeing free block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._block_hashes[block_id] is None:
                    self._free_uncached_ids.append(block_id)
                else:
                    self._evictable_ids[block_id] = None

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        assert block_hash is not None
        del self._hash_to_block_id[block_hash]
        self._block_hashes[block_id] = None
