"""BlockPool: allocation, reference counts, prefix-cache lookup and LRU eviction."""

from __future__ import annotations

import pytest

from actors.scheduler.block_pool import BlockHash, BlockPool, NoFreeBlocksError, hash_block_tokens

BLOCK_SIZE = 4


def chain_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE) -> list[BlockHash]:
    """Prefix-cache keys of the full blocks of token_ids."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


def cache_table(pool: BlockPool, block_ids: list[int], token_ids: list[int]) -> None:
    """Registers the full blocks of a block table holding token_ids, as a finished prefill does."""
    for block_id, block_hash in zip(block_ids, chain_hashes(token_ids)):
        pool.cache_full_block(block_id, block_hash)


def test_allocate_hands_out_ids_in_order_and_free_returns_them():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    pool.free([0, 1, 2])
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    # Uncached blocks come back FIFO, released tail first: 3 (never used), then 2, 1, 0.
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(num_blocks=2, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    assert not pool.can_allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_invalid_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, block_size=4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(num_blocks=4, block_size=0, enable_prefix_caching=True)


def test_block_hash_depends_on_the_whole_prefix():
    same_block = [5, 6, 7, 8]
    assert hash_block_tokens(None, same_block) == hash_block_tokens(None, list(same_block))
    first_a, first_b = hash_block_tokens(None, [1, 2, 3, 4]), hash_block_tokens(None, [9, 2, 3, 4])
    assert hash_block_tokens(first_a, same_block) != hash_block_tokens(first_b, same_block)


def test_cached_prefix_is_found_and_capped_below_the_last_token():
    pool = BlockPool(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(100, 112))  # 3 full blocks
    block_ids = pool.allocate(3)
    cache_table(pool, block_ids, prompt)
    # Same 12 tokens: only 2 blocks may hit, so that one token is left to compute.
    assert pool.find_cached_prefix(chain_hashes(prompt), len(prompt)) == [0, 1]
    # 13 tokens sharing the 12: all 3 blocks hit.
    longer = prompt + [7]
    assert pool.find_cached_prefix(chain_hashes(longer), len(longer)) == [0, 1, 2]
    # Diverging in the second block: the hit stops at the first block.
    diverging = prompt[:4] + [0] + prompt[5:] + [7]
    assert pool.find_cached_prefix(chain_hashes(diverging), len(diverging)) == [0]
    assert pool.num_prefix_query_tokens == 0  # lookups count only once used
    pool.record_prefix_lookup(num_query_tokens=13, num_hit_tokens=12)
    assert pool.stats()["num_prefix_hit_tokens"] == 12
    assert pool.stats()["num_prefix_query_tokens"] == 13


def test_reuse_shares_blocks_and_counts_references():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(8))
    block_ids = pool.allocate(2)
    cache_table(pool, block_ids, prompt)
    pool.reuse([0, 1])
    assert [pool.ref_count(0), pool.ref_count(1)] == [2, 2]
    pool.free(block_ids)
    assert [pool.ref_count(0), pool.ref_count(1)] == [1, 1]
    assert pool.num_free_blocks == 2


def test_freed_cached_blocks_stay_findable_until_evicted():
    pool = BlockPool(num_blocks=3, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(8))
    cache_table(pool, pool.allocate(2), prompt)
    pool.free([0, 1])
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    query = prompt + [99]
    assert pool.find_cached_prefix(chain_hashes(query), len(query)) == [0, 1]
    # Reusing an evictable block takes it out of the free ones: with 2 reused,
    # only 1 new block can come on top.
    assert pool.can_allocate(1, reused_block_ids=[0, 1])
    assert not pool.can_allocate(2, reused_block_ids=[0, 1])
    pool.reuse([0, 1])
    assert pool.num_free_blocks == 1


def test_uncached_free_blocks_go_before_evicting_cached_ones():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache_table(pool, pool.allocate(2), list(range(8)))  # blocks 0, 1 cached
    pool.free([0, 1])
    assert pool.allocate(2) == [2, 3]  # the never-cached blocks first
    assert pool.num_cached_blocks == 2


def test_eviction_is_lru_and_a_table_is_evicted_tail_first():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first, second = pool.allocate(2), pool.allocate(2)  # [0, 1], [2, 3]
    cache_table(pool, first, list(range(0, 8)))
    cache_table(pool, second, list(range(50, 58)))
    pool.free(first)  # used longer ago
    pool.free(second)
    # LRU order: first's tail (1), first's head (0), then second's tail (3), head (2).
    assert pool.allocate(1) == [1]
    assert pool.allocate(1) == [0]
    assert pool.allocate(2) == [3, 2]
    assert pool.num_cached_blocks == 0
    assert all(pool.block_hash(b) is None for b in range(4))


def test_reused_block_becomes_most_recently_used():
    pool = BlockPool(num_blocks=2, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt_a, prompt_b = [1, 1, 1, 1], [2, 2, 2, 2]
    block_a, block_b = pool.allocate(1), pool.allocate(1)
    cache_table(pool, block_a, prompt_a)
    cache_table(pool, block_b, prompt_b)
    pool.free(block_a)
    pool.free(block_b)
    # Touch A again: B is now the least recently used and goes first.
    pool.reuse(pool.find_cached_prefix(chain_hashes(prompt_a + [0]), 5))
    pool.free(block_a)
    assert pool.allocate(1) == block_b
    query_b = prompt_b + [0]
    assert pool.find_cached_prefix(chain_hashes(query_b), 5) == []  # B's key left with it


def test_equal_block_already_cached_is_not_registered_twice():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(4))
    first, second = pool.allocate(1), pool.allocate(1)
    cache_table(pool, first, prompt)
    cache_table(pool, second, prompt)  # computed at the same time by another sequence
    assert pool.block_hash(first[0]) is not None and pool.block_hash(second[0]) is None
    pool.free(second)
    assert pool.num_cached_blocks == 1


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(9))
    cache_table(pool, pool.allocate(2), prompt)
    assert pool.num_cached_blocks == 0
    assert pool.find_cached_prefix(chain_hashes(prompt), len(prompt)) == []
    pool.record_prefix_lookup(9, 0)
    assert pool.stats()["num_prefix_query_tokens"] == 0


def test_reset_prefix_cache_forgets_free_cached_blocks_and_keeps_held_ones():
    pool = BlockPool(num_blocks=6, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    freed_tokens, held_tokens = list(range(8)), list(range(100, 108))
    freed, held = pool.allocate(2), pool.allocate(2)
    cache_table(pool, freed, freed_tokens)
    cache_table(pool, held, held_tokens)
    pool.free(freed)
    assert pool.reset_prefix_cache() == 2
    assert pool.find_cached_prefix(chain_hashes(freed_tokens), 9) == []
    assert pool.find_cached_prefix(chain_hashes(held_tokens), 9) == held
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert sorted(pool.allocate(4)) == [0, 1, 4, 5]  # the forgotten blocks are free, uncached
