"""Sleep mode and prefix-cache reset (vLLM's operations): the offline LLM and the actor
engine (AsyncClient) sleep at level 1 and 2, free memory, wake up whole or one part at a
time, and generate exactly what they did before; sleeping under load loses no request."""

from __future__ import annotations

import asyncio
import os

import pytest

from actors import LLM, AsyncClient, SamplingParams
from tests.models.test_llm_matches_hf import make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_llm_sleeps_wakes_and_generates_the_same(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB")
    prompts = [{"prompt_token_ids": ids} for ids in make_prompts(300, [9, 30], seed=1)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    for level in (1, 2):
        llm.sleep(level=level)
        assert llm.is_sleeping()
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.wake_up(["weights"])  # as a trainer does: the weights first, then the cache
        assert llm.is_sleeping()
        llm.wake_up(["kv_cache"])
        assert not llm.is_sleeping()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before
    with pytest.raises(ValueError, match="wake_up tags"):
        llm.wake_up(["everything"])


def test_reset_prefix_cache_makes_the_next_identical_prompt_recompute(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB")
    prompt = {"prompt_token_ids": make_prompts(300, [64], seed=2)[0]}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_level_2_frees_at_least_the_weights(tmp_path):
    """The embedded SmolLM2 (538 MB of fp32 weights): the process shrinks by that much asleep."""
    llm = LLM(kv_cache_memory="32MiB", quantization="none")
    weight_bytes = llm.engine.runner.model.num_weight_bytes()
    text = llm.generate("Name three colours.", GREEDY, use_tqdm=False)[0].outputs[0].text
    awake = rss_bytes()
    llm.sleep(level=2)
    asleep = rss_bytes()
    llm.wake_up()
    assert awake - asleep >= weight_bytes, (awake, asleep, weight_bytes)
    assert llm.generate("Name three colours.", GREEDY, use_tqdm=False)[0].outputs[0].text == text


async def test_the_actor_engine_sleeps_under_load_and_loses_no_request(tiny_llama_dir):
    prompts = make_prompts(300, [7, 40, 13, 25, 60, 3], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, kv_cache_memory="64MiB").generate(
        [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)]
    async with asyncio.timeout(120):
        async with AsyncClient(tiny_llama_dir, kv_cache_memory="64MiB", max_num_seqs=4) as client:
            async def run(ids):
                return [t async for d in client.generate({"prompt_token_ids": ids}, params)
                        for t in d.outputs[0].token_ids]

            tasks = [asyncio.ensure_future(run(ids)) for ids in prompts]
            while (await client.get_stats())["num_running"] == 0:
                await asyncio.sleep(0.005)
            for level in (1, 2):
                await client.sleep(level)
                assert await client.is_sleeping()
                stats = await client.get_stats()
                assert stats["num_running"] == 0 and stats["num_held_blocks"] == 0
                await asyncio.sleep(0.05)
                assert not any(task.done() for task in tasks)  # waiting, not failed
                await client.wake_up()
                assert not await client.is_sleeping()
            assert await asyncio.gather(*tasks) == expected
            assert await client.reset_prefix_cache()
