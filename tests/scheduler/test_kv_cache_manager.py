"""KVCacheManager: block tables grown and freed, lookahead slots, prefix-cache hits,
caching of full blocks only, extra hash keys, and a short pool that changes nothing."""

from __future__ import annotations

import dataclasses

import pytest

from actors.scheduler.block_pool import hash_block_tokens
from actors.scheduler.kv_cache_manager import KVCacheManager, block_extra_keys
from actors.scheduler.request import ExtraHashKeys, Sequence
from messages.common import SamplingParams

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 8, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)


def make_seq(prompt: list[int], seq_id: str = "r", max_tokens: int = 16,
             keys: ExtraHashKeys | None = None, prompt_logprobs: int | None = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Sequence(seq_id, seq_id, 0, prompt, params, max_seq_len=256, extra_hash_keys=keys)


def admit(manager: KVCacheManager, seq: Sequence) -> list[int]:
    """What the scheduler does for a waiting sequence: cached prefix first, then the rest
    of its tokens in one chunk, computed and offered to the cache as a step's result."""
    hit_block_ids, num_hit_tokens = manager.get_computed_blocks(seq)
    new_block_ids = manager.allocate_slots(seq, seq.num_tokens - num_hit_tokens, computed_block_ids=hit_block_ids)
    assert new_block_ids is not None
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_blocks(seq, seq.num_computed_tokens)
    return hit_block_ids


# ---- allocate, grow, free ----

def test_block_table_grows_only_when_a_block_fills_and_free_returns_it():
    manager = make_manager()
    seq = make_seq(list(range(10)))
    assert manager.allocate_slots(seq, 10) == [0, 1, 2]  # 10 tokens: 2 full blocks and 2 slots
    seq.num_computed_tokens = 10
    assert manager.allocate_slots(seq, 2) == []  # tokens 10 and 11 fit in block 2
    seq.num_computed_tokens = 12
    assert manager.allocate_slots(seq, 1) == [3]  # token 12 opens a fourth block
    assert seq.block_ids == [0, 1, 2, 3] and manager.block_pool.num_free_blocks == 4
    manager.free(seq)
    assert seq.block_ids == [] and seq.num_cached_blocks == 0
    assert manager.block_pool.num_free_blocks == 8


def test_lookahead_slots_are_reserved_past_the_new_tokens_and_released_by_free():
    manager = make_manager()
    seq = make_seq(list(range(5)))
    # 5 prompt tokens + 4 lookahead slots: 9 slots, 3 blocks (2 without lookahead)
    assert manager.allocate_slots(seq, 5, num_lookahead_tokens=4) == [0, 1, 2]
    seq.num_computed_tokens = 5
    # a decode with 4 draft tokens needs 10 slots: the reserved third block holds them
    assert manager.allocate_slots(seq, 1, num_lookahead_tokens=4) == []
    seq.num_computed_tokens = 8
    assert manager.allocate_slots(seq, 1, num_lookahead_tokens=4) == [3]  # 13 slots
    assert manager.block_pool.num_free_blocks == 4
    manager.free(seq)
    assert manager.block_pool.num_free_blocks == 8
    assert [manager.block_pool.ref_count(b) for b in range(8)] == [0] * 8


def test_lookahead_stops_at_the_tokens_the_sequence_may_reach():
    manager = make_manager()
    seq = make_seq(list(range(4)), max_tokens=1)  # at most 5 tokens
    assert manager.allocate_slots(seq, 4, num_lookahead_tokens=8) == [0, 1]  # 5 slots, not 12


# ---- prefix cache ----

def test_get_computed_blocks_finds_the_cached_prefix_without_taking_it():
    manager = make_manager()
    pool = manager.block_pool
    admit(manager, make_seq(list(range(100, 112)), "a"))  # three full blocks, cached
    reader = make_seq(list(range(100, 112)) + [7, 8], "b")
    hit_block_ids, num_hit_tokens = manager.get_computed_blocks(reader)
    assert (hit_block_ids, num_hit_tokens) == ([0, 1, 2], 12)
    assert [pool.ref_count(b) for b in range(3)] == [1, 1, 1]  # looking takes nothing
    # the hit blocks start its table, one new block holds its last 2 tokens
    assert manager.allocate_slots(reader, 2, computed_block_ids=hit_block_ids) == [3]
    assert reader.block_ids == [0, 1, 2, 3] and reader.num_cached_blocks == 3
    assert [pool.ref_count(b) for b in range(4)] == [2, 2, 2, 1]
    stats = manager.stats()
    assert (stats["num_prefix_query_tokens"], stats["num_prefix_hit_tokens"]) == (12 + 14, 12)


def test_a_hit_leaves_the_last_token_to_compute():
    manager = make_manager()
    admit(manager, make_seq(list(range(100, 112)), "a"))
    # the same 12 tokens: the last full block is left out, its logits must be computed
    assert manager.get_computed_blocks(make_seq(list(range(100, 112)), "b")) == ([0, 1], 8)


def test_a_sequence_owing_prompt_logprobs_does_not_read_the_cache():
    manager = make_manager()
    admit(manager, make_seq(list(range(100, 112)), "a"))
    before = manager.stats()
    seq = make_seq(list(range(100, 112)), "b", prompt_logprobs=1)
    assert manager.get_computed_blocks(seq) == ([], 0)
    assert manager.allocate_slots(seq, 12) == [3, 4, 5]
    assert manager.stats()["num_prefix_query_tokens"] == before["num_prefix_query_tokens"]


def test_cache_blocks_registers_only_full_computed_blocks():
    manager = make_manager()
    pool = manager.block_pool
    seq = make_seq(list(range(10)))
    assert manager.allocate_slots(seq, 10) == [0, 1, 2]
    manager.cache_blocks(seq, 6)  # one block full so far
    assert [pool.block_hash(b) is not None for b in range(3)] == [True, False, False]
    manager.cache_blocks(seq, 10)
    assert [pool.block_hash(b) is not None for b in range(3)] == [True, True, False]
    assert seq.num_cached_blocks == 2
    for token_id in (50, 51):  # two sampled tokens fill block 2
        seq.append_token(token_id)
    manager.cache_blocks(seq, 11)
    assert pool.block_hash(2) is None  # its last slot is not computed yet
    manager.cache_blocks(seq, 12)
    assert pool.block_hash(2) == seq.block_hashes[2] and pool.num_cached_blocks == 3


def test_nothing_is_cached_when_prefix_caching_is_off():
    manager = make_manager(enable_prefix_caching=False)
    admit(manager, make_seq(list(range(100, 112)), "a"))
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_seq(list(range(100, 112)), "b")) == ([], 0)


# ---- extra keys ----

@pytest.mark.parametrize("writer_keys, reader_keys", [
    (ExtraHashKeys(adapter_id="sql"), ExtraHashKeys(adapter_id="chat")),
    (None, ExtraHashKeys(adapter_id="sql")),
    (ExtraHashKeys(cache_salt="alice"), ExtraHashKeys(cache_salt="bob")),
    (ExtraHashKeys(cache_salt="alice"), None),
    (ExtraHashKeys(adapter_id="sql"), ExtraHashKeys(cache_salt="sql")),
])
def test_same_tokens_under_different_extra_keys_share_no_block(writer_keys, reader_keys):
    manager = make_manager()
    prompt = list(range(100, 112))
    admit(manager, make_seq(prompt, "a", keys=writer_keys))
    reader = make_seq(prompt + [7], "b", keys=reader_keys)
    assert manager.get_computed_blocks(reader) == ([], 0)
    assert admit(manager, reader) == [] and reader.block_ids == [3, 4, 5, 6]


@pytest.mark.parametrize("keys", [None, ExtraHashKeys(adapter_id="sql", cache_salt="alice"),
                                  ExtraHashKeys(mm_inputs=(("img-1", 2, 4),))])
def test_same_tokens_under_equal_extra_keys_share_the_blocks(keys):
    manager = make_manager()
    prompt = list(range(100, 112))
    admit(manager, make_seq(prompt, "a", keys=keys))
    reader = make_seq(prompt + [7], "b", keys=dataclasses.replace(keys) if keys is not None else None)
    assert admit(manager, reader) == [0, 1, 2]


def test_a_different_image_splits_the_prefix_at_the_first_block_it_overlaps():
    manager = make_manager()
    prompt = [5] * 16  # equal placeholder tokens; the image fills positions 8-11 (block 2)
    admit(manager, make_seq(prompt, "a", keys=ExtraHashKeys(mm_inputs=(("img-1", 8, 4),))))
    reader = make_seq(prompt + [7], "b", keys=ExtraHashKeys(mm_inputs=(("img-2", 8, 4),)))
    assert manager.get_computed_blocks(reader) == ([0, 1], 8)


def test_block_extra_keys_carry_request_keys_in_the_first_block_and_images_where_they_lie():
    keys = ExtraHashKeys(adapter_id="sql", cache_salt="alice", mm_inputs=(("img-1", 3, 5),))  # positions 3-7
    assert block_extra_keys(keys, 0, BLOCK_SIZE) == (("sql", "alice"), ("img-1",))
    assert block_extra_keys(keys, 1, BLOCK_SIZE) == (None, ("img-1",))  # positions 4-7
    assert block_extra_keys(keys, 2, BLOCK_SIZE) is None  # positions 8-11: the image ends before
    assert block_extra_keys(None, 0, BLOCK_SIZE) is None
    tokens = [1, 2, 3, 4]
    assert hash_block_tokens(None, tokens, None) == hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tokens, ((None, "x"), ())) != hash_block_tokens(None, tokens, (("x", None), ()))


# ---- a short pool ----

def test_admission_the_pool_cannot_hold_returns_none_and_changes_nothing():
    manager = make_manager(num_blocks=4)
    pool = manager.block_pool
    cached = make_seq(list(range(100, 109)), "a")  # 9 tokens: 2 full blocks cached, 3 held
    admit(manager, cached)
    manager.free(cached)  # blocks 0 and 1 stay cached (evictable), block 2 goes back uncached
    holder = make_seq([1, 2, 3, 4, 5], "c")
    assert manager.allocate_slots(holder, 5) == [3, 2]  # the uncached ones go first
    # b hits blocks 0-1 but needs 2 more for its other 8 tokens: 4 blocks, only 2 free
    reader = make_seq(list(range(100, 108)) + list(range(8)), "b")
    hit_block_ids, _ = manager.get_computed_blocks(reader)
    assert hit_block_ids == [0, 1]
    before = (pool.stats(), [pool.ref_count(b) for b in range(4)], [pool.block_hash(b) for b in range(4)])
    assert manager.allocate_slots(reader, 8, computed_block_ids=hit_block_ids) is None
    assert reader.block_ids == [] and reader.num_cached_blocks == 0
    assert (pool.stats(), [pool.ref_count(b) for b in range(4)], [pool.block_hash(b) for b in range(4)]) == before


def test_a_running_sequence_the_pool_cannot_grow_keeps_its_table():
    manager = make_manager(num_blocks=2)
    seq = make_seq(list(range(8)))
    assert manager.allocate_slots(seq, 8) == [0, 1]
    seq.num_computed_tokens = 8
    assert manager.allocate_slots(seq, 1) is None
    assert manager.allocate_slots(seq, 0, num_lookahead_tokens=2) is None  # lookahead needs a block too
    assert seq.block_ids == [0, 1] and manager.block_pool.num_free_blocks == 0
