"""The KV-cache manager of a model with sliding-window layers (issue 39; vLLM's hybrid
KV-cache manager): a block table per group of layers (actors/config/kv_groups.py), all
over one BlockPool, where a sliding group gives back the blocks its window has left.

A sequence's tables all have one entry per logical block (block i: tokens [i * bs, (i + 1)
* bs)), so they grow together: seq.block_ids is group 0's table (the scheduler's fast path
reads its length), seq.group_block_ids the others'. A sliding group's leading entries,
once its window has passed them, are NULL_BLOCK: freed, never read (the attention kernels
start a windowed query at its window's first block) and never freed again;
seq.num_skipped_blocks counts them per group.

The worker gets the groups' tables concatenated: a new request's whole tables, a running
one's new blocks, every group growing by the same count (the worker splits them evenly).

Prefix caching stays exact: a block is cached under its group's key (its token hash, with
the group's index past group 0), and a hit of k blocks is taken only where every full group
has blocks 0..k-1 cached and every sliding group the blocks its window needs to go on from
token k * bs."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from actors.config.kv_groups import KVCacheLayout
from actors.scheduler.block_pool import BlockHash
from actors.scheduler.kv_cache_manager import KVCacheManager
from actors.scheduler.request import Sequence

NULL_BLOCK = 0  # a freed sliding-window entry: a valid id the kernels never read
_NOT_HIT = -1  # in get_computed_blocks' tables: an entry the hit does not need


class HybridKVCacheManager(KVCacheManager):
    """Block tables per layer group over one BlockPool, with prefix caching."""

    frees_windows = True

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, layout: KVCacheLayout,
                 max_num_batched_tokens: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.windows = [group.sliding_window for group in layout.groups]
        self.num_groups = len(self.windows)
        self.max_num_batched_tokens = max_num_batched_tokens

    @property
    def max_num_tokens(self) -> int:
        """The longest sequence the pool holds alone: its full groups take a block per
        block_size tokens, its sliding groups at most a window and a prefill chunk's."""
        num_full = self.windows.count(None)
        sliding_need = sum(-(-(window + self.max_num_batched_tokens) // self.block_size) + 1
                           for window in self.windows if window is not None)
        if num_full == 0:
            return 2**62 if sliding_need <= self.num_blocks else 0
        return max(self.num_blocks - sliding_need, 0) // num_full * self.block_size

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table in each group."""
        return [seq.block_ids, *seq.group_block_ids]

    def block_table(self, seq: Sequence) -> list[int]:
        return [block_id for table in self.tables(seq) for block_id in table]

    def held_blocks(self, seq: Sequence) -> list[int]:
        return [len(table) - skipped for table, skipped in zip(self.tables(seq), seq.num_skipped_blocks)] \
            if seq.block_ids else [0] * self.num_groups

    def _first_needed_block(self, window: int, num_computed_tokens: int) -> int:
        """A sliding group's first block the queries from num_computed_tokens on still see."""
        return max(num_computed_tokens - window + 1, 0) // self.block_size

    def _key(self, block_hash: BlockHash, group: int) -> BlockHash:
        return block_hash if group == 0 else block_hash + bytes((group,))

    # ---- prefix cache ----

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest prefix every group has cached what it needs of: the groups' hit
        tables concatenated (k entries each; _NOT_HIT where a window does not need one),
        and k * block_size tokens."""
        if not self.reads_prefix_cache(seq):
            return [], 0
        block_hashes = self._full_block_hashes(seq)
        cached_block_id = self.block_pool.cached_block_id
        max_hit = (seq.num_tokens - 1) // self.block_size
        found: list[list[int | None]] = []
        for group, window in enumerate(self.windows):  # full groups first (kv_groups orders them so)
            ids = []
            for block_hash in block_hashes[:max_hit]:
                block_id = cached_block_id(self._key(block_hash, group))
                if block_id is None and window is None:
                    break  # a full group needs every block before the hit's end
                ids.append(block_id)
            if window is None:
                max_hit = len(ids)
            found.append(ids)
        num_hit = self._longest_hit(found, max_hit)
        if num_hit == 0:
            return [], 0
        hit = []
        for ids, window in zip(found, self.windows):
            first = 0 if window is None else self._first_needed_block(window, num_hit * self.block_size)
            hit += [_NOT_HIT] * first + ids[first:num_hit]
        return hit, num_hit * self.block_size

    def _longest_hit(self, found: list[list[int | None]], max_hit: int) -> int:
        """The most blocks k <= max_hit with every sliding group's window before token
        k * block_size cached."""
        last_missing = []  # per sliding group: for each i, the last uncached block <= i (-1: none)
        for ids, window in zip(found, self.windows):
            if window is not None:
                missing, last = [], -1
                for index, block_id in enumerate(ids[:max_hit]):
                    if block_id is None:
                        last = index
                    missing.append(last)
                last_missing.append((window, missing))
        for num_hit in range(max_hit, 0, -1):
            if all(missing[num_hit - 1] < self._first_needed_block(window, num_hit * self.block_size)
                   for window, missing in last_missing):
                return num_hit
        return 0

    def _cache_full_blocks(self, seq: Sequence, block_hashes: list[BlockHash], num_full_blocks: int) -> None:
        for group, (table, skipped) in enumerate(zip(self.tables(seq), seq.num_skipped_blocks)):
            # (a block a window left before its step's result came was freed uncached)
            for block_index in range(max(seq.num_cached_blocks, skipped), num_full_blocks):
                self.block_pool.cache_full_block(table[block_index], self._key(block_hashes[block_index], group))

    # ---- allocation ----

    def free_out_of_window(self, seq: Sequence) -> None:
        """Returns the blocks seq's sliding groups no longer see to the pool: the queries of
        its next step start at seq.num_computed_tokens."""
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            first = self._first_needed_block(window, seq.num_computed_tokens)
            skipped = seq.num_skipped_blocks[group]
            if first > skipped:
                table = seq.block_ids if group == 0 else seq.group_block_ids[group - 1]
                self.block_pool.free(table[skipped:first])
                table[skipped:first] = [NULL_BLOCK] * (first - skipped)
                seq.num_skipped_blocks[group] = first

    def can_fit(self, seq: Sequence, num_tokens: int, computed_block_ids: SequenceOf[int]) -> bool:
        num_hit = len(computed_block_ids) // self.num_groups
        num_new_blocks = (-(-num_tokens // self.block_size) - num_hit) * self.num_groups
        return self.block_pool.can_allocate(num_new_blocks, [b for b in computed_block_ids if b != _NOT_HIT])

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       computed_block_ids: SequenceOf[int] = ()) -> list[int] | None:
        """KVCacheManager.allocate_slots over every group; the new blocks of all groups,
        concatenated (as many per group), or None and no change when the pool is short."""
        pool, block_size, num_groups = self.block_pool, self.block_size, self.num_groups
        if seq.block_ids:  # running: the out-of-window blocks go back first
            assert not computed_block_ids, f"cached blocks for running {seq}"
            self.free_out_of_window(seq)
            num_tokens = seq.num_computed_tokens + num_new_tokens
            if num_lookahead_tokens:
                num_tokens = self._with_lookahead(seq, num_tokens, num_lookahead_tokens)
            num_new = -(-num_tokens // block_size) - len(seq.block_ids)
            if num_new <= 0:
                return []
            if not pool.can_allocate(num_new * num_groups):
                return None
            new_block_ids = pool.allocate(num_new * num_groups)
            for group, table in enumerate(self.tables(seq)):
                table.extend(new_block_ids[group * num_new:(group + 1) * num_new])
            return new_block_ids
        num_hit = len(computed_block_ids) // num_groups
        num_tokens = seq.num_computed_tokens + num_hit * block_size + num_new_tokens
        if num_lookahead_tokens:
            num_tokens = self._with_lookahead(seq, num_tokens, num_lookahead_tokens)
        num_new = -(-num_tokens // block_size) - num_hit
        reused = [block_id for block_id in computed_block_ids if block_id != _NOT_HIT]
        if not pool.can_allocate(num_new * num_groups, reused):
            return None
        pool.reuse(reused)
        new_block_ids = pool.allocate(num_new * num_groups)
        tables, skipped = [], []
        for group in range(num_groups):
            hit = computed_block_ids[group * num_hit:(group + 1) * num_hit]
            num_skipped = sum(1 for block_id in hit if block_id == _NOT_HIT)
            tables.append([NULL_BLOCK] * num_skipped + list(hit[num_skipped:])
                          + new_block_ids[group * num_new:(group + 1) * num_new])
            skipped.append(num_skipped)
        seq.block_ids, seq.group_block_ids, seq.num_skipped_blocks = tables[0], tables[1:], skipped
        seq.num_cached_blocks = num_hit
        if self.reads_prefix_cache(seq):
            pool.record_prefix_lookup(seq.num_tokens, num_hit * block_size)
        return new_block_ids

    def free(self, seq: Sequence) -> None:
        if seq.block_ids:
            for table, skipped in zip(self.tables(seq), seq.num_skipped_blocks):
                self.block_pool.free(table[skipped:])
        seq.block_ids, seq.group_block_ids, seq.num_skipped_blocks = [], [], []
        seq.num_cached_blocks = 0
