"""Prefix-aware routing over data-parallel replicas (routing_logic='prefixaware'): the
router's choice on its own, then two real replicas: prompts sharing a long prefix land on
the replica that served it and find it in its prefix cache, different prefixes still
spread, and a dead replica is skipped."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from actors import AsyncClient, SamplingParams
from actors.frontend.prefix_routing import TEXT_CHUNK_CHARS, PrefixRouter, prefix_keys
from messages.input_processor import AddRequest
from tests.models.test_llm_matches_hf import make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _request(prompt, salt=None) -> AddRequest:
    return AddRequest(request_id="r", prompt=prompt, params=GREEDY, cache_salt=salt)


def test_keys_are_block_aligned_chained_prefixes():
    tokens = list(range(40))
    keys = prefix_keys(_request(tokens), block_size=16)
    assert len(keys) == 2  # the last 8 tokens are no whole block
    assert prefix_keys(_request(tokens[:32] + [99] * 16), 16)[:2] == keys
    assert prefix_keys(_request([7] + tokens[1:]), 16)[1] != keys[1]  # a chain: block 2 depends on block 1
    assert prefix_keys(_request(tokens, salt="other"), 16)[0] != keys[0]
    text = "x" * (2 * TEXT_CHUNK_CHARS + 5)
    assert len(prefix_keys(_request(text), 16)) == 2
    assert prefix_keys(_request("short"), 16) == []


def test_choice_prefers_the_longest_prefix_unless_much_busier():
    router = PrefixRouter(3, capacity=4, balance_abs=4, balance_rel=1.5)
    keys = [1, 2, 3]
    assert router.choose(keys, {0: 2, 1: 0, 2: 1}) == 1  # nobody has it: the least loaded
    router.record(2, keys[:2])
    router.record(0, keys[:1])
    assert router.choose(keys, {0: 0, 1: 0, 2: 3}) == 2  # the longest prefix, somewhat busier
    assert router.choose(keys, {0: 0, 1: 0, 2: 9}) == 0  # much busier: the least loaded instead
    assert router.choose(keys, {0: 0, 1: 0}) == 0  # replica 2 dead: the next longest prefix
    router.record(2, [10, 11, 12])  # past capacity: the oldest prefixes are forgotten
    assert router.matched(2, keys) == 0 and router.matched(2, [10, 11, 12]) == 3


def test_prefixaware_needs_replicas():
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        AsyncClient("unused", routing_logic="prefixaware").engine_args.check()


async def test_shared_prefixes_go_to_the_replica_that_cached_them(make_tiny_model):
    client = AsyncClient(make_tiny_model("llama"), kv_cache_memory="32MiB", data_parallel_size=2,
                         routing_logic="prefixaware", block_size=16)
    async with asyncio.timeout(120):
        await client.start()
    try:
        first, second = make_prompts(client.config.model.vocab_size, [64, 64], seed=11)

        def follow_up(prefix: list[int], tail: int) -> list[int]:
            return prefix + [(tail + i) % client.config.model.vocab_size for i in range(5)]

        # sent together: two different prefixes spread over the two replicas
        outputs = await asyncio.wait_for(client.generate_batch([first, second], GREEDY, use_tqdm=False), 60)
        assert all(output.num_cached_tokens == 0 for output in outputs)
        routed = [client.engine.prefix_router.matched(i, prefix_keys(_request(first), 16)) for i in range(2)]
        assert sorted(routed) == [0, 4]
        # one at a time, each after its prefix: least-loaded would send both to replica 0
        for prompt, tail in ((first, 3), (second, 5)):
            output = await asyncio.wait_for(client.generate(follow_up(prompt, tail), GREEDY), 30)
            assert output.num_cached_tokens == 64, output.num_cached_tokens

        # the replica holding `first` dies: the prompt goes to the other one and is served
        holder = routed.index(4)
        os.kill(client.engine.replicas[holder].actor_pids()["worker0"], signal.SIGKILL)
        async with asyncio.timeout(10):
            while client.engine.replicas[holder].is_running:
                await asyncio.sleep(0.05)
        output = await asyncio.wait_for(client.generate(follow_up(first, 7), GREEDY), 30)
        assert output.num_cached_tokens == 0 and len(output.outputs[0].token_ids) == 4
    finally:
        async with asyncio.timeout(60):
            await client.close()
