"""The host KV tier under the scheduler soak: random arrivals, aborts, prefix sharing and a
device pool too small for the load, with one or two plans in flight. The fake worker runs
each plan's copy orders between its device slots and host slots before the step, and checks
that every slot a step attends to holds its sequence's token: a swap or spill that brought
back the wrong block, or read one after it was reused, fails there."""

from __future__ import annotations

import random
import zlib

import pytest

from actors.scheduler.kv_tiers import KVTiers
from messages.scheduler import StepResult
from messages.worker import StepPlan
from tests.scheduler.scheduler_harness import FakeWorker, make_params, make_scheduler, soak


class TieredFakeWorker(FakeWorker):
    """FakeWorker with host block slots: swap-outs, then swap-ins, then the step."""

    def __init__(self, block_size: int, num_blocks: int, num_host_blocks: int, token_fn) -> None:
        super().__init__(block_size, num_blocks, token_fn)
        self.host_slots: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.num_copies = 0

    def step(self, plan: StepPlan) -> StepResult:
        for device_block, host_block in plan.blocks_to_swap_out:
            self.host_slots[host_block] = list(self.kv_slots[device_block])
        for host_block, device_block in plan.blocks_to_swap_in:
            self.kv_slots[device_block] = list(self.host_slots[host_block])
        self.num_copies += len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        return super().step(plan)


@pytest.mark.parametrize("plans_in_flight", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_soak_with_a_host_tier_keeps_every_token_and_leaks_no_block(seed, plans_in_flight):
    rng = random.Random(100 + seed)
    block_size, num_blocks = rng.choice([2, 4]), rng.randint(8, 16)
    num_host_blocks = rng.choice([2, num_blocks, 4 * num_blocks])  # full often, or roomy
    capacity = block_size * num_blocks
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                               max_num_batched_tokens=rng.randint(4, 24), max_num_seqs=rng.randint(2, 6),
                               enable_prefix_caching=seed % 3 != 2)
    tiers = KVTiers(num_host_blocks, block_size, preemption_mode=rng.choice([None, "swap"]), swap_is_cheaper=True)
    scheduler.kv_tiers = tiers
    tiers.attach(scheduler.block_pool)
    worker = TieredFakeWorker(block_size, num_blocks, num_host_blocks,
                              lambda seq_id, position: 10 + zlib.crc32(f"{seq_id}:{position}".encode()) % 50)
    outcome = soak(scheduler, worker, rng, plans_in_flight, num_requests=40, max_prompt_len=capacity // 2,
                   make_request_params=lambda rng: make_params(max_tokens=rng.randint(1, capacity // 2),
                                                               n=rng.choice([1, 1, 2])))
    for (request_id, index), (params, prompt) in outcome.expected.items():
        if request_id in outcome.aborted:
            continue
        seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
        positions = range(len(prompt), len(prompt) + params.max_tokens)
        assert outcome.completions[(request_id, index)].token_ids == [worker.token_fn(seq_id, p) for p in positions]
    stats = tiers.stats()
    assert stats["num_preemptions_swap"] > 0 and worker.num_copies > 0
    assert stats["num_swapped"] == 0 and stats["num_free_host_blocks"] == num_host_blocks


def test_a_prefix_cache_reset_recomputes_swapped_requests():
    """After a reset (a trainer updated the weights) nothing computed before may come back:
    neither spilled prefixes nor a swapped request's KV."""
    from actors.scheduler.control import reset_prefix_cache
    from tests.scheduler.scheduler_harness import run_step, run_to_end

    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    tiers = KVTiers(16, 4, preemption_mode="swap", swap_is_cheaper=True)
    scheduler.kv_tiers = tiers
    tiers.attach(scheduler.block_pool)
    worker = TieredFakeWorker(4, 8, 16, lambda seq_id, position: 10 + position % 7)
    scheduler.add_request("a", list(range(20, 30)), make_params(max_tokens=12))
    scheduler.add_request("b", list(range(40, 50)), make_params(max_tokens=12))
    completions: dict = {}
    while not tiers.num_swapped:
        run_step(scheduler, worker, completions)
    for seq in list(scheduler.running):
        scheduler.abort_request(seq.request_id)
    assert reset_prefix_cache(scheduler)  # no block held: the swapped request waits
    assert tiers.num_swapped == 0 and tiers.host.num_free_blocks == 16 and tiers.host.num_cached_blocks == 0
    swapped_in_before = tiers.num_blocks_swapped_in
    run_to_end(scheduler, worker, completions)
    finished = [c for c in completions.values() if c.finish_reason == "length"]
    assert [c.token_ids for c in finished] == [[10 + p % 7 for p in range(10, 22)]]  # recomputed, unchanged
    assert tiers.num_blocks_swapped_in == swapped_in_before
