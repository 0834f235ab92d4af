"""Speculative decoding in the actor engine (AsyncClient over real processes), with async
scheduling on (two plans in flight: the worker runs ahead of the scheduler by the drafts
it accepted) and off: greedy output equals the offline engine's without speculation,
stop strings end it, n = 2, and the acceptance counters reach the stats."""

from __future__ import annotations

import asyncio

import pytest

from actors import LLM, AsyncClient, SamplingParams
from tests.spec_decode.test_speculative_llm import ENGINE_ARGS, GREEDY, loop_prompts, spec_config


async def completions(client: AsyncClient, prompt: list[int], params: SamplingParams,
                      timeout: float = 60.0) -> list[tuple[list[int], str, str | None]]:
    """(token ids, text, finish reason) of each completion of one request, bounded in time."""
    token_ids: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    async with asyncio.timeout(timeout):
        async for delta in client.generate(prompt, params):
            for output in delta.outputs:
                token_ids.setdefault(output.index, []).extend(output.token_ids)
                text[output.index] = text.get(output.index, "") + output.text
                finish[output.index] = output.finish_reason
    return [(token_ids[i], text[i], finish[i]) for i in sorted(token_ids)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """The offline engine's outputs without speculation: greedy, n=2 and a stop string."""
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS)
    prompts = loop_prompts(llm.config.model.vocab_size)
    greedy = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
              for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    stop = greedy[1][1][len(greedy[1][1]) // 2:][:2]
    stopped = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop])
    with_stop = llm.generate([prompts[1]], stopped, use_tqdm=False)[0].outputs[0]
    return prompts, greedy, stopped, (list(with_stop.token_ids), with_stop.text, with_stop.finish_reason)


@pytest.mark.parametrize("method, async_scheduling", [("ngram", True), ("suffix", True), ("ngram", False)])
async def test_actor_engine_output_matches_decoding_without_speculation(tiny_llama_dir, expected, method,
                                                                        async_scheduling):
    prompts, greedy, stopped, with_stop = expected
    client = AsyncClient(tiny_llama_dir, **ENGINE_ARGS, async_scheduling=async_scheduling,
                         speculative_config=spec_config(method, 3))
    async with asyncio.timeout(120):
        await client.start()
    try:
        results = await asyncio.gather(*[completions(client, p, GREEDY) for p in prompts],
                                       completions(client, prompts[1], stopped),
                                       completions(client, prompts[0], SamplingParams(
                                           n=2, temperature=0.0, max_tokens=48, ignore_eos=True)))
        assert [r[0] for r in results[:3]] == greedy
        assert results[3] == [with_stop] and with_stop[2] == "stop"
        assert results[4] == [greedy[0], greedy[0]]
        async with asyncio.timeout(10):
            stats = await client.get_stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0
        assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    finally:
        async with asyncio.timeout(30):
            await client.close()


async def test_tensor_parallel_ranks_propose_alike_and_rank_0_broadcasts_what_was_emitted(tiny_llama_dir, expected):
    prompts, greedy, _, _ = expected
    client = AsyncClient(tiny_llama_dir, **ENGINE_ARGS, tensor_parallel_size=2,
                         speculative_config=spec_config("suffix", 3))
    async with asyncio.timeout(180):
        await client.start()
    try:
        results = await asyncio.gather(*[completions(client, p, GREEDY) for p in prompts])
        assert [r[0] for r in results] == greedy
        async with asyncio.timeout(10):
            assert (await client.get_stats())["spec_decode_num_accepted_tokens"] > 0
    finally:
        async with asyncio.timeout(30):
            await client.close()
