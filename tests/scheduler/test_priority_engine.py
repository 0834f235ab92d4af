"""--scheduling-policy priority through the engines: LLM (per-prompt priorities) and
AsyncClient over real actor processes. Output is the same as first-come-first-served
(greedy); only who waits changes. The default policy refuses a priority by name."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors import LLM, AsyncClient, InvalidRequestError, SamplingParams
from tests.models.test_llm_matches_hf import make_prompts

ENGINE_ARGS = dict(kv_cache_memory="64MiB", max_num_batched_tokens=256, seed=0)


def test_llm_priorities_change_nothing_in_greedy_output(tiny_llama_dir):
    prompts = [{"prompt_token_ids": ids} for ids in make_prompts(300, [5, 40, 12, 70, 9, 33], seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    fcfs = LLM(tiny_llama_dir, **ENGINE_ARGS, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    with pytest.raises(InvalidRequestError) as error:
        LLM(tiny_llama_dir, **ENGINE_ARGS).generate(prompts[:1], params, priority=[1], use_tqdm=False)
    assert error.value.param == "priority" and "--scheduling-policy priority" in str(error.value)
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, max_num_seqs=2, scheduling_policy="priority")
    by_priority = llm.generate(prompts, params, priority=[3, 0, 2, -1, 0, 1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_priority] == [o.outputs[0].token_ids for o in fcfs]
    assert llm.scheduler.num_preemptions == 0  # all queued at once: admission order alone did it


async def test_an_urgent_request_overtakes_a_saturated_engine_and_the_rest_still_finish(tiny_llama_dir):
    """max_num_seqs 2, four long low-priority requests running and waiting: an urgent one
    gets its first token at once (preempting one), where under FCFS it waits for two of them."""
    vocab = 300
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    short_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    low = make_prompts(vocab, [20, 21, 22, 23], seed=5)
    urgent = make_prompts(vocab, [10], seed=6)[0]

    async def first_token_seconds(policy: str) -> tuple[float, list[list[int]]]:
        async with asyncio.timeout(120):
            client = AsyncClient(tiny_llama_dir, **ENGINE_ARGS, max_num_seqs=2, scheduling_policy=policy)
            await client.start()
            try:
                async def run(ids, params, priority):
                    return [d async for d in client.generate({"prompt_token_ids": ids}, params, priority=priority)]

                background = [asyncio.ensure_future(run(ids, long_params, 5 if policy == "priority" else 0))
                              for ids in low]
                while (await client.get_stats())["num_running"] < 2:
                    await asyncio.sleep(0.01)
                start = time.monotonic()
                stream = client.generate({"prompt_token_ids": urgent}, short_params,
                                         priority=-1 if policy == "priority" else 0)
                first = None
                async for _ in stream:
                    first = first if first is not None else time.monotonic() - start
                outputs = await asyncio.gather(*background)
                return first, [[t for d in deltas for t in d.outputs[0].token_ids] for deltas in outputs]
            finally:
                await client.close()

    fcfs_seconds, fcfs_outputs = await first_token_seconds("fcfs")
    priority_seconds, priority_outputs = await first_token_seconds("priority")
    assert priority_outputs == fcfs_outputs and all(len(tokens) == 200 for tokens in priority_outputs)
    assert priority_seconds < fcfs_seconds / 4, (priority_seconds, fcfs_seconds)
