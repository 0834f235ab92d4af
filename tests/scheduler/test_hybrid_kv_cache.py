"""Issue 39's KV-cache manager per layer group, through the block pool's own counters: a
sliding group's blocks stay within its window as a sequence grows to 4,096 tokens; a
Gemma-3-like model (5 sliding : 1 full layers) admits over 3x the concurrent 4k-token
sequences of the same KV bytes with every layer full; prefix hits are taken only where every
group has what the next query sees. A fake worker keeps each group's table from the plans'
diffs and checks, before every step, that every slot a query's window reads holds its token."""

from __future__ import annotations

import math

import pytest

from actors.config import CacheConfig, SchedulerConfig
from actors.config.kv_groups import KVCacheLayout, kv_cache_layout
from actors.scheduler.hybrid_kv_cache import HybridKVCacheManager
from actors.scheduler.priority import make_scheduler
from messages.common import SamplingParams
from messages.scheduler import StepResult
from messages.worker import StepPlan

SAMPLED = 7


class GroupedFakeWorker:
    """The worker's side of the plans with a table per group: the concatenated ids split
    evenly; each computed token written to its slot in every group; each query's window (or
    every key, for a full group) checked to hold the sequence's tokens."""

    def __init__(self, layout: KVCacheLayout, block_size: int, num_blocks: int) -> None:
        self.windows = [group.sliding_window for group in layout.groups]
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token
        self.states: dict[str, tuple[list[int], list[list[int]], list[int]]] = {}  # tokens, tables, [computed]

    def _split(self, block_ids: list[int]) -> list[list[int]]:
        size = len(block_ids) // len(self.windows)
        assert size * len(self.windows) == len(block_ids), "the groups' blocks come in equal shares"
        return [block_ids[g * size:(g + 1) * size] for g in range(len(self.windows))]

    def step(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_request_ids:
            del self.states[seq_id]
        for new in plan.new_requests:
            self.states[new.request_id] = (list(new.token_ids), self._split(list(new.block_ids)),
                                           [new.num_computed_tokens])
        for cont in plan.continuing_requests:
            _, tables, computed = self.states[cont.request_id]
            assert computed[0] == cont.num_computed_tokens
            for table, new_ids in zip(tables, self._split(list(cont.new_block_ids))):
                table += new_ids
        sampled_ids, sampled = [], []
        bs = self.block_size
        for seq_id, num_new in plan.num_scheduled_tokens.items():
            tokens, tables, computed = self.states[seq_id]
            start, end = computed[0], computed[0] + num_new
            for table, window in zip(tables, self.windows):
                assert len(table) * bs >= end, "block table too short"
                first_read = max(start - window + 1, 0) if window else 0
                for position in range(first_read, end):
                    slot = (table[position // bs], position % bs)
                    if position < start:
                        assert self.slots.get(slot) == tokens[position], "stale KV in a window"
                    else:
                        self.slots[slot] = tokens[position]
            computed[0] = end
            if end == len(tokens):
                tokens.append(SAMPLED)
                sampled_ids.append(seq_id)
                sampled.append(SAMPLED)
        return StepResult(plan.step_id, sampled_ids, sampled)


def build(windows: tuple[int, ...], num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 256,
          max_num_seqs: int = 64, max_model_len: int = 8192, hybrid: bool = True, scheduling_policy: str = "fcfs"):
    layout = kv_cache_layout(windows, len(windows), hybrid)
    scheduler = make_scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                               max_model_len=max_model_len, scheduling_policy=scheduling_policy),
                               CacheConfig(block_size=block_size), num_blocks=num_blocks, eos_token_ids=(2,),
                               kv_layout=layout)
    return scheduler, GroupedFakeWorker(layout, block_size, num_blocks), layout


def run(scheduler, worker, on_step=None, max_steps: int = 20000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        plan = scheduler.schedule()
        if on_step is not None:
            on_step(scheduler)
        scheduler.update(plan, worker.step(plan))
    raise AssertionError("requests did not finish")


def test_layers_group_by_window_in_equal_sizes():
    gemma3 = kv_cache_layout((256,) * 5 + (0,) + (256,) * 5 + (0,), 12)
    assert gemma3.layers_per_group == 2 and gemma3.num_groups == 6
    assert gemma3.groups[0].sliding_window is None and gemma3.groups[0].layers == (5, 11)
    assert sorted(layer for group in gemma3.groups for layer in group.layers) == list(range(12))
    alternating = kv_cache_layout((128, 0) * 12, 24)  # GPT-OSS's pattern
    assert alternating.layers_per_group == 12 and alternating.num_groups == 2
    assert not kv_cache_layout((0, 0, 0), 3).hybrid and kv_cache_layout((), 3).layers_per_group == 3
    assert not kv_cache_layout((64, 0), 2, hybrid=False).hybrid
    many = kv_cache_layout((64,) * 20 + (0,) * 3, 23)  # gcd 1 would make 23 groups: padded groups of 3
    assert many.layers_per_group == 3 and many.num_groups == 8


@pytest.mark.parametrize("prompt_len,max_num_batched_tokens", [(64, 256), (4000, 16)])
def test_a_4096_token_sequence_holds_a_window_of_blocks_per_sliding_group(prompt_len, max_num_batched_tokens):
    window, block_size = 256, 16
    scheduler, worker, _ = build((window, 0, window, 0), num_blocks=1024, block_size=block_size,
                                 max_num_batched_tokens=max_num_batched_tokens)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    scheduler.add_request("r", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=4096 - prompt_len,
                                                                               ignore_eos=True))
    peaks = [0, 0]

    def check(scheduler) -> None:
        seq = scheduler.sequences.get("r-0") or next(iter(scheduler.sequences.values()))
        full, sliding = manager.held_blocks(seq)  # groups: the full one first, then the sliding one
        assert full == math.ceil(seq.num_computed_tokens / block_size)
        peaks[0], peaks[1] = max(peaks[0], sliding), max(peaks[1], seq.num_computed_tokens)
        assert sliding <= math.ceil(window / block_size) + 1
        stats = manager.stats()
        assert stats["num_held_blocks"] == full + sliding  # the pool's own count agrees

    run(scheduler, worker, check)
    assert peaks == [math.ceil(window / block_size) + 1, 4095]  # (the 4,096th token is sampled, not computed)
    assert manager.block_pool.num_free_blocks == 1024


def peak_decoding(windows: tuple[int, ...], num_blocks: int, hybrid: bool, requests: int = 40) -> int:
    """The most sequences decoding at once past 4,000-token prompts."""
    scheduler, worker, _ = build(windows, num_blocks=num_blocks, max_num_batched_tokens=2048, max_num_seqs=requests,
                                 hybrid=hybrid)
    for index in range(requests):
        scheduler.add_request(f"r{index}", [3 + index] + list(range(4, 4003)), SamplingParams(max_tokens=96,
                                                                                                ignore_eos=True))
    peak = [0]

    def count(scheduler) -> None:
        decoding = sum(seq.num_computed_tokens >= 4000 for seq in scheduler.running)
        peak[0] = max(peak[0], decoding)

    run(scheduler, worker, count)
    return peak[0]


def test_a_gemma3_like_model_admits_3x_the_concurrent_4k_sequences_of_the_same_kv_bytes():
    windows = (512,) * 5 + (0,)  # five sliding layers to each full one
    # the same bytes: a unified block holds 6 layers, a hybrid one 1 (kv_groups: G = 1)
    unified_blocks = 256 * 6  # six 4k sequences, every layer full
    assert kv_cache_layout(windows, 6).layers_per_group == 1
    unified = peak_decoding(windows, unified_blocks, hybrid=False)
    hybrid = peak_decoding(windows, unified_blocks * 6, hybrid=True)
    assert unified == 6
    assert hybrid >= 3 * unified


def test_prefix_hits_need_every_group_to_hold_what_the_next_query_sees():
    window, block_size = 32, 8
    scheduler, worker, _ = build((window, 0), num_blocks=256, block_size=block_size, max_num_batched_tokens=64)
    prompt = list(range(3, 203))  # 200 tokens: 25 blocks
    scheduler.add_request("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    run(scheduler, worker)
    scheduler.add_request("b", prompt + [9, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    seq = next(iter(scheduler.sequences.values()))
    hit, num_hit_tokens = scheduler.kv_cache_manager.get_computed_blocks(seq)
    # the full group has all 25 blocks; the sliding one its last blocks, which the 64-token
    # chunks left cached: the hit ends where the sliding group still has the window before it
    assert 0 < num_hit_tokens <= 200 and num_hit_tokens % block_size == 0
    num_hit = num_hit_tokens // block_size
    full, sliding = hit[:num_hit], hit[num_hit:]
    assert -1 not in full
    needed = max(num_hit_tokens - window + 1, 0) // block_size
    assert sliding[:needed] == [-1] * needed and -1 not in sliding[needed:]
    run(scheduler, worker)  # the worker's window checks pass from the hit on
    assert scheduler.stats()["num_prefix_hit_tokens"] >= num_hit_tokens


def test_an_urgent_request_preempts_for_blocks_of_every_group():
    """The priority policy's admission check counts every group's blocks: an urgent request
    that does not fit preempts the least urgent, and everything finishes with each window's
    slots intact."""
    scheduler, worker, _ = build((16, 0), num_blocks=40, block_size=4, max_num_batched_tokens=32,
                                 scheduling_policy="priority")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    scheduler.add_request("low-a", list(range(3, 43)), params, priority=5)
    scheduler.add_request("low-b", list(range(50, 90)), params, priority=5)
    for _ in range(4):
        scheduler.update(plan := scheduler.schedule(), worker.step(plan))
    scheduler.add_request("urgent", list(range(100, 140)), SamplingParams(max_tokens=4, ignore_eos=True), priority=0)
    run(scheduler, worker)
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 40
