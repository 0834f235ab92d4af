"""The KV-cache manager: a sequence's blocks, between the scheduler and the block pool.

The scheduler decides how many tokens of which sequence a step computes; this decides
which blocks hold them (as vLLM V1's KVCacheManager). Per step and sequence:

  - get_computed_blocks(seq): a waiting sequence's longest cached prefix (no side effect);
  - allocate_slots(seq, num_new_tokens, num_lookahead_tokens, computed_block_ids): grows
    its block table to hold its computed tokens, the step's new ones and lookahead slots
    (the draft tokens speculative decoding will verify); None, and no change, when the
    pool is short;
  - cache_blocks(seq, num_computed_tokens): after a step's result, offers the blocks it
    filled to the prefix cache;
  - free(seq): on finish, abort or preemption, returns its blocks.

The block table lives on the Sequence (seq.block_ids: block i holds tokens
[i * block_size, (i + 1) * block_size)), with the keys of its full blocks
(seq.block_hashes) and how many of them were offered to the cache (seq.num_cached_blocks);
only this object writes them.

A full block's key chains its parent's key, its tokens and extra keys taken from the
request (ExtraHashKeys): the adapter and cache salt go into the first block's key, which
every later key chains through, and a multimodal input's hash into the key of each block
its placeholder tokens overlap.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as SequenceOf

from actors.scheduler.block_pool import BlockHash, BlockPool, hash_block_tokens
from actors.scheduler.request import ExtraHashKeys, Sequence


def block_extra_keys(keys: ExtraHashKeys | None, block_index: int, block_size: int) -> tuple[Hashable, ...] | None:
    """The extra keys of one block's hash: (adapter id, cache salt) in the first block,
    then the hashes of the multimodal inputs overlapping the block; None when there are
    none, so a plain request's blocks are keyed by their tokens alone."""
    if keys is None:
        return None
    request_keys = None
    if block_index == 0 and (keys.adapter_id is not None or keys.cache_salt is not None):
        request_keys = (keys.adapter_id, keys.cache_salt)
    start, end = block_index * block_size, (block_index + 1) * block_size
    mm_hashes = tuple(mm_hash for mm_hash, offset, length in keys.mm_inputs
                      if offset < end and offset + length > start)
    if request_keys is None and not mm_hashes:
        return None
    return (request_keys, mm_hashes)


class KVCacheManager:
    """Block tables of live sequences over one BlockPool, with prefix caching."""

    frees_windows = False  # a sliding group frees blocks as its sequences advance (hybrid_kv_cache.py)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def max_num_tokens(self) -> int:
        """Tokens the whole pool holds: no sequence can grow past it."""
        return self.block_pool.num_blocks * self.block_size

    def stats(self) -> dict[str, float | int]:
        return self.block_pool.stats()

    def block_table(self, seq: Sequence) -> list[int]:
        """seq's block table as the worker gets it (a new request's)."""
        return list(seq.block_ids)

    def held_blocks(self, seq: Sequence) -> list[int]:
        """Blocks seq holds, per group of layers (one group here)."""
        return [len(seq.block_ids)]

    def free_out_of_window(self, seq: Sequence) -> None:
        """Nothing: every layer sees every token (hybrid_kv_cache.py frees what windows left)."""

    def can_fit(self, seq: Sequence, num_tokens: int, computed_block_ids: SequenceOf[int]) -> bool:
        """Whether a waiting sequence with the cached prefix computed_block_ids (from
        get_computed_blocks) would get blocks for num_tokens tokens now."""
        num_new_blocks = -(-num_tokens // self.block_size) - len(computed_block_ids)
        return self.block_pool.can_allocate(num_new_blocks, computed_block_ids)

    # ---- prefix cache ----

    def reads_prefix_cache(self, seq: Sequence) -> bool:
        """Whether seq may start from cached blocks (Sequence.reads_prefix_cache says when not)."""
        return self.enable_prefix_caching and seq.reads_prefix_cache

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """(block ids, token count) of the longest cached prefix of a waiting sequence's
        tokens; ([], 0) when it may not read the cache. No side effect: pass the ids to
        allocate_slots to take them. A resumed sequence looks up prompt + output, as its
        own freed blocks may survive."""
        if not self.reads_prefix_cache(seq):
            return [], 0
        hit_block_ids = self.block_pool.find_cached_prefix(self._full_block_hashes(seq), seq.num_tokens)
        return hit_block_ids, len(hit_block_ids) * self.block_size

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Offers the blocks that num_computed_tokens computed tokens fill to the prefix
        cache, once a step's result says they are computed (later steps in flight may have
        filled more: they are offered with theirs)."""
        if not self.enable_prefix_caching:
            return
        num_full_blocks = num_computed_tokens // self.block_size
        if num_full_blocks <= seq.num_cached_blocks:
            return
        self._cache_full_blocks(seq, self._full_block_hashes(seq), num_full_blocks)
        seq.num_cached_blocks = num_full_blocks

    def _cache_full_blocks(self, seq: Sequence, block_hashes: list[BlockHash], num_full_blocks: int) -> None:
        """Caches seq's blocks num_cached_blocks ... num_full_blocks - 1 under their keys."""
        for block_index in range(seq.num_cached_blocks, num_full_blocks):
            self.block_pool.cache_full_block(seq.block_ids[block_index], block_hashes[block_index])

    def _full_block_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Keys of every full block of seq's known tokens (computed or not), grown from
        those computed before: each block is hashed once in a sequence's life."""
        block_hashes, block_size = seq.block_hashes, self.block_size
        for block_index in range(len(block_hashes), seq.num_tokens // block_size):
            parent_hash = block_hashes[-1] if block_hashes else None
            start = block_index * block_size
            block_hashes.append(hash_block_tokens(parent_hash, seq.token_ids[start:start + block_size],
                                                  block_extra_keys(seq.extra_hash_keys, block_index, block_size)))
        return block_hashes

    # ---- allocation ----

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       computed_block_ids: SequenceOf[int] = ()) -> list[int] | None:
        """Grows seq's block table to hold its computed tokens, num_new_tokens more and
        num_lookahead_tokens slots past them (capped at the tokens seq may reach); the new
        block ids (not the computed ones), or None, and no change, when the pool is short.

        computed_block_ids, from get_computed_blocks, start a waiting sequence's table:
        they count as computed (the caller advances seq.num_computed_tokens by them) and
        are taken from the cache here. Lookahead blocks stay in the table until free()."""
        if seq.block_ids:  # a running sequence: the per-step path, kept short
            assert not computed_block_ids, f"cached blocks for running {seq}"
            num_tokens = seq.num_computed_tokens + num_new_tokens
            if num_lookahead_tokens:
                num_tokens = self._with_lookahead(seq, num_tokens, num_lookahead_tokens)
            num_new_blocks = -(-num_tokens // self.block_size) - len(seq.block_ids)
            if num_new_blocks <= 0:
                return []
            if not self.block_pool.can_allocate(num_new_blocks):
                return None
            new_block_ids = self.block_pool.allocate(num_new_blocks)
            seq.block_ids.extend(new_block_ids)
            return new_block_ids
        # admission: the cached blocks start the table, fresh ones follow
        pool = self.block_pool
        num_hit_tokens = len(computed_block_ids) * self.block_size
        num_tokens = seq.num_computed_tokens + num_hit_tokens + num_new_tokens
        if num_lookahead_tokens:
            num_tokens = self._with_lookahead(seq, num_tokens, num_lookahead_tokens)
        num_new_blocks = -(-num_tokens // self.block_size) - len(computed_block_ids)
        if not pool.can_allocate(num_new_blocks, computed_block_ids):
            return None
        pool.reuse(computed_block_ids)
        new_block_ids = pool.allocate(num_new_blocks)
        seq.block_ids = [*computed_block_ids, *new_block_ids]
        seq.num_cached_blocks = len(computed_block_ids)
        if self.reads_prefix_cache(seq):
            pool.record_prefix_lookup(seq.num_tokens, num_hit_tokens)
        return new_block_ids

    @staticmethod
    def _with_lookahead(seq: Sequence, num_tokens: int, num_lookahead_tokens: int) -> int:
        """Slots for num_tokens tokens and the lookahead past them, up to the tokens seq
        may reach: draft tokens past its end would be discarded anyway."""
        return max(num_tokens, min(num_tokens + num_lookahead_tokens, seq.max_num_tokens))

    def free(self, seq: Sequence) -> None:
        """Returns seq's blocks to the pool (cached ones stay findable until evicted). Its
        block hashes are kept: they depend on its tokens only, and a preempted sequence
        looks them up again when it resumes."""
        self.block_pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
