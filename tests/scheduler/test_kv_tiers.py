"""The host KV tier (--swap-space / --kv-offload-size): swap preemption and prefix-cache
spill through real engines (LLM one step at a time, AsyncClient with two plans in flight),
greedy output against Hugging Face, the tiers' counters, and no leaked block in either pool."""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
import pytest

from actors import LLM, AsyncClient, SamplingParams
from actors.engine.args import EngineArgs
from actors.scheduler.kv_tiers import KVTiers
from actors.worker.disk_kv import MAGIC
from actors.models.loader import load_model_config
from messages.worker import StepPlan
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# a 16-token budget chunks the longer prompts; 40 blocks of 4 tokens cannot hold all eight
# requests at once, so the newest are preempted
TINY_POOL = dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=40)


def block_bytes(model_dir: str, block_size: int) -> int:
    """Bytes of one KV block of the model in float32 (keys and values of every layer)."""
    m = load_model_config(model_dir)
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * block_size * 4


def assert_pools_back_to_start(stats: dict) -> None:
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_total_host_blocks"]
    assert stats["num_swapped"] == 0


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    prompts = make_prompts(300, PROMPT_LENGTHS, seed=1)
    return prompts, hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)[0]


def test_swap_preemption_matches_hf_and_recompute(tiny_llama_dir, expected):
    prompts, hf_tokens = expected
    host = 64 * block_bytes(tiny_llama_dir, 4)
    outputs = {}
    for mode in ("swap", "recompute"):
        llm = LLM(tiny_llama_dir, **TINY_POOL, kv_offload_size=host, preemption_mode=mode)
        outputs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.scheduler.stats()
        assert stats["num_preemptions"] > 0
        if mode == "swap":
            assert stats["num_preemptions_swap"] == stats["num_preemptions"]
            assert stats["num_blocks_swapped_in"] > 0
        else:
            assert stats["num_preemptions_swap"] == 0
        assert_pools_back_to_start(stats)
    assert outputs["swap"] == hf_tokens
    assert outputs["recompute"] == hf_tokens


@pytest.mark.parametrize("engine_args, n", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}), 1),
    (dict(), 2),  # the two completions share the prompt's blocks
])
def test_swap_preemption_with_drafts_or_shared_prompts_matches_hf(tiny_llama_dir, expected, engine_args, n):
    prompts, hf_tokens = expected
    llm = LLM(tiny_llama_dir, **TINY_POOL, **engine_args, kv_offload_size=64 * block_bytes(tiny_llama_dir, 4),
              preemption_mode="swap")
    params = msgspec.structs.replace(GREEDY, n=n)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[tokens] * n for tokens in hf_tokens]
    stats = llm.scheduler.stats()
    assert stats["num_preemptions_swap"] > 0
    assert_pools_back_to_start(stats)


@pytest.mark.parametrize("async_scheduling, tensor_parallel_size", [(True, 1), (False, 1), (True, 2)])
async def test_swap_preemption_through_the_actors_matches_hf(tiny_llama_dir, expected, async_scheduling,
                                                             tensor_parallel_size):
    """Two plans in flight (async scheduling) or one; with two ranks, each copies its shard."""
    prompts, hf_tokens = expected
    async with asyncio.timeout(180):
        client = AsyncClient(tiny_llama_dir, **TINY_POOL, kv_offload_size=64 * block_bytes(tiny_llama_dir, 4),
                             preemption_mode="swap", async_scheduling=async_scheduling,
                             tensor_parallel_size=tensor_parallel_size)
        await client.start()
        try:
            async def run(ids):
                return [t async for d in client.generate({"prompt_token_ids": ids}, GREEDY)
                        for t in d.outputs[0].token_ids]

            outputs = await asyncio.gather(*(run(ids) for ids in prompts))
            stats = await client.get_stats()
        finally:
            await client.close()
    assert outputs == hf_tokens
    assert stats["num_preemptions_swap"] > 0 and stats["num_blocks_swapped_in"] > 0
    assert_pools_back_to_start(stats)


def test_a_full_host_tier_falls_back_to_recompute(tiny_llama_dir, expected):
    prompts, hf_tokens = expected
    # two host blocks: most preempted requests hold more, and are recomputed instead
    llm = LLM(tiny_llama_dir, **TINY_POOL, kv_offload_size=2 * block_bytes(tiny_llama_dir, 4),
              preemption_mode="swap")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == hf_tokens
    stats = llm.scheduler.stats()
    assert stats["num_total_host_blocks"] == 2
    assert stats["num_preemptions"] > stats["num_preemptions_swap"]
    assert_pools_back_to_start(stats)


def test_evicted_prefix_is_loaded_back_from_the_host_tier(tiny_llama_dir):
    """A 64-token prefix is pushed out of a 40-block device pool by other prompts; asked for
    again it comes from the host tier (counted as cached), with the same output."""
    prefix, *others = make_prompts(300, [64, 60, 60, 60], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    host = 64 * block_bytes(tiny_llama_dir, 4)
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=40, kv_offload_size=host)
    first = llm.generate([prefix], params, use_tqdm=False)[0]
    for ids in others:  # one at a time: each evicts the prefix's blocks some more
        llm.generate([ids], params, use_tqdm=False)
    assert llm.scheduler.stats()["num_spilled_blocks"] >= 15
    again = llm.generate([prefix], params, use_tqdm=False)[0]
    stats = llm.scheduler.stats()
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 60  # the 15 full blocks before the last token
    assert stats["num_external_prefix_hit_tokens"] == 60 and stats["num_blocks_swapped_in"] == 15
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_total_host_blocks"]  # cached ones are evictable


async def test_a_request_aborted_while_swapped_out_leaks_no_block(tiny_llama_dir):
    prompts = make_prompts(300, [30, 31, 32, 33, 34, 35], seed=9)
    long_params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with asyncio.timeout(180):
        client = AsyncClient(tiny_llama_dir, max_num_batched_tokens=64, block_size=4, num_kv_blocks=60,
                             kv_offload_size=200 * block_bytes(tiny_llama_dir, 4), preemption_mode="swap")
        await client.start()
        try:
            async def run(ids):
                async for _ in client.generate({"prompt_token_ids": ids}, long_params):
                    pass

            tasks = [asyncio.ensure_future(run(ids)) for ids in prompts]
            while (await client.get_stats())["num_swapped"] == 0:
                await asyncio.sleep(0.01)
            for task in tasks:  # cancelling a stream aborts its request
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            while (stats := await client.get_stats())["num_running"] + stats["num_waiting"]:
                await asyncio.sleep(0.01)
        finally:
            await client.close()
    assert stats["num_preemptions_swap"] > 0
    assert_pools_back_to_start(stats)


# ---- the disk tier ----

SHORT_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def disk_tier_args(model_dir: str, directory) -> dict:
    """A 40-block device pool, a 64-block host tier and the disk tier in directory."""
    return dict(block_size=4, num_kv_blocks=40, kv_offload_size=64 * block_bytes(model_dir, 4),
                kv_offload_dir=str(directory))

def test_a_restarted_engine_loads_the_prefix_from_the_disk_tier(tiny_llama_dir, tmp_path):
    """One token: the prompt's blocks are cached by the last result, and close() sends their saves."""
    prompt = make_prompts(300, [64], seed=11)[0]
    params, engine_args = SamplingParams(temperature=0.0, max_tokens=1), disk_tier_args(tiny_llama_dir, tmp_path)
    with LLM(tiny_llama_dir, **engine_args) as llm:
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        assert llm.scheduler.stats()["num_blocks_saved_to_disk"] == 16
    assert len(list(tmp_path.glob("*.kv"))) == 16
    with LLM(tiny_llama_dir, **engine_args) as llm:
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        stats = llm.scheduler.stats()
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 60 and stats["num_blocks_loaded_from_disk"] == 15
    assert stats["num_failed_disk_loads"] == 0 and stats["num_external_prefix_hit_tokens"] == 60
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_total_host_blocks"]


async def test_a_restarted_actor_engine_loads_the_prefix_from_the_disk_tier(tiny_llama_dir, tmp_path):
    """Through real processes: the last step's blocks are saved in a plan of their own, the
    worker's writes finish at shutdown, the new worker scans the files at start-up, and the
    scheduler waits for a plan that only loads (answered without tokens)."""
    prompt = make_prompts(300, [64], seed=13)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1)  # the prompt's blocks are cached by the last result
    engine_args = disk_tier_args(tiny_llama_dir, tmp_path)
    results = []
    async with asyncio.timeout(180):
        for _ in range(2):
            async with AsyncClient(tiny_llama_dir, **engine_args) as client:
                deltas = [d async for d in client.generate({"prompt_token_ids": prompt}, params)]
                # the saves leave in a plan after the last result: wait for it, so a slow shutdown on a
                # loaded machine (a process killed after its grace period) cannot drop them
                while (await client.get_stats()).get("num_disk_blocks", 0) < 16:
                    await asyncio.sleep(0.05)
                results.append(([t for d in deltas for t in d.outputs[0].token_ids], deltas[-1].num_cached_tokens,
                                await client.get_stats()))
    (first, _, _), (again, cached, stats) = results
    assert again == first and cached == 60
    assert stats["num_blocks_loaded_from_disk"] == 15 and stats["num_free_host_blocks"] == stats["num_total_host_blocks"]


def test_corrupt_short_and_stale_disk_files_are_never_used(tiny_llama_dir, tmp_path):
    """Block 5's payload is corrupted and block 9's file cut short: the first 5 blocks come
    from disk, the rest of the prompt is recomputed, and the output does not change; a file
    of another model is removed at start-up."""
    prompt = make_prompts(300, [64], seed=12)[0]
    params, engine_args = SHORT_GREEDY, disk_tier_args(tiny_llama_dir, tmp_path)
    with LLM(tiny_llama_dir, **engine_args) as llm:
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        hashes = llm.scheduler.kv_cache_manager._full_block_hashes(_sequence_of(prompt))
    corrupt, short = (tmp_path / (hashes[i].hex() + ".kv") for i in (5, 9))
    data = bytearray(corrupt.read_bytes())
    data[-7] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:-100])
    stale = tmp_path / ("ab" * 32 + ".kv")
    other_model = {"model": "/elsewhere", "dtype": "float32", "layers": 2, "kv_heads": 2, "head_dim": 8,
                   "block_size": 4}
    header = msgspec.msgpack.encode({"fingerprint": other_model, "length": 0, "sha256": hashlib.sha256().hexdigest()})
    stale.write_bytes(MAGIC + len(header).to_bytes(4, "little") + header)
    with LLM(tiny_llama_dir, **engine_args) as llm:
        assert not stale.exists()
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        stats = llm.scheduler.stats()
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 5 * 4
    assert stats["num_failed_disk_loads"] == 2
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_total_host_blocks"]


def _sequence_of(prompt: list[int]):
    """A scheduler Sequence of the prompt alone, for its block hashes."""
    from actors.scheduler.request import Sequence

    return Sequence("probe", "probe", 0, prompt, SamplingParams(max_tokens=1), 1000)


# ---- the host pool's bookkeeping, and the flags ----

def test_host_blocks_read_by_a_plan_are_not_reused_before_it_goes():
    """A spill in the same plan as a host hit must not take the hit's block: the plan's
    swap-outs run before its swap-ins and would overwrite it."""
    tiers = KVTiers(num_host_blocks=2, block_size=4, preemption_mode=None, swap_is_cheaper=True)
    tiers.spill(device_block_id=7, block_hash=b"a")
    tiers.spill(device_block_id=8, block_hash=b"b")
    assert tiers.host.find(b"a") is not None and tiers.host.num_free_blocks == 2
    tiers.host.mark_read([tiers.host.find(b"a")])
    tiers.spill(device_block_id=9, block_hash=b"c")  # evicts b, the only block not being read
    assert tiers.host.find(b"a") is not None and tiers.host.find(b"b") is None
    tiers.spill(device_block_id=10, block_hash=b"d")  # a is read and c is not: c goes
    assert tiers.host.find(b"a") is not None and tiers.host.find(b"c") is None
    plan = tiers.with_orders(StepPlan(0, [], [], {}, []))
    assert [device for device, _ in plan.blocks_to_swap_out] == [7, 8, 9, 10]
    assert tiers.host.num_free_blocks == 2 and tiers.stats()["num_spills_dropped"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(swap_space=1, kv_offload_size="1GiB"), "give one of them"),
    (dict(preemption_mode="swap"), "needs a host KV tier"),
    (dict(swap_space=-1), "swap_space"),
    (dict(kv_offload_size="lots"), "kv_offload_size"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(kv_offload_dir="/tmp/kv"), "needs a host KV tier"),
    (dict(kv_offload_dir="/tmp/kv", swap_space=1, enable_prefix_caching=False), "enable_prefix_caching"),
])
def test_bad_tier_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).check()
