"""Data parallelism: two engine replicas behind one AsyncClient, requests balanced between
them; one replica's death fails only its own requests while the other keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from actors import AsyncClient, SamplingParams
from actors.frontend.data_parallel import DataParallelClient
from actors.errors import EngineDeadError
from tests.models.test_llm_matches_hf import make_prompts
from tests.engine.test_supervision import consume, pid_exists

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def test_kill_9_of_one_replica_fails_only_its_requests(make_tiny_model):
    client = AsyncClient(make_tiny_model("llama", max_position_embeddings=8192), kv_cache_memory="32MiB",
                         data_parallel_size=2)
    assert isinstance(client.engine, DataParallelClient)
    async with asyncio.timeout(120):
        await client.start()
    pids = list(client.actor_pids().values())
    try:
        prompts = make_prompts(client.config.model.vocab_size, [20] * 6, seed=3)
        # the same greedy output from either replica
        outputs = await asyncio.wait_for(client.generate_batch(prompts[:4] * 2, GREEDY, use_tqdm=False), 60)
        assert [o.outputs[0].token_ids for o in outputs[:4]] == [o.outputs[0].token_ids for o in outputs[4:]]

        long = SamplingParams(temperature=0.0, max_tokens=8000, ignore_eos=True)
        tasks = [asyncio.create_task(consume(client.generate(p, long, request_id=f"r{i}")))
                 for i, p in enumerate(prompts)]
        await asyncio.sleep(0.5)
        owners = {request_id: client.engine.replicas.index(replica) for request_id, replica in client.engine._owners.items()}
        assert sorted(owners.values()) == [0, 0, 0, 1, 1, 1]  # the fewest unfinished requests first

        os.kill(client.engine.replicas[0].actor_pids()["worker0"], signal.SIGKILL)
        killed_at = time.monotonic()
        victims = [task for i, task in enumerate(tasks) if owners[f"r{i}"] == 0]
        results = await asyncio.wait_for(asyncio.gather(*victims, return_exceptions=True), 5.0)
        assert time.monotonic() - killed_at < 5.0
        assert all(isinstance(result, EngineDeadError) for result in results), results

        survivors = [task for i, task in enumerate(tasks) if owners[f"r{i}"] == 1]
        assert not any(task.done() for task in survivors)
        client.check_health()  # one replica still serves
        assert client.engine.replica_states()[0].startswith("dead") and client.engine.replica_states()[1] == "ok"
        again = await asyncio.wait_for(client.generate(prompts[0], GREEDY), 30)
        assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids
        for task in survivors:
            task.cancel()
        await asyncio.gather(*survivors, return_exceptions=True)

        os.kill(client.engine.replicas[1].actor_pids()["worker0"], signal.SIGKILL)
        await asyncio.wait_for(client.wait_until_dead(), 5.0)
        with pytest.raises(EngineDeadError):
            client.check_health()
    finally:
        async with asyncio.timeout(30):
            await client.close()
    assert not [pid for pid in pids if pid_exists(pid)]


@pytest.mark.parametrize("options, named", [
    ({"enable_lora": True}, "data_parallel_size > 1 does not support enable_lora"),
    ({"nnodes": 2, "tensor_parallel_size": 2}, "data_parallel_size > 1 with nnodes"),
    ({"distributed_executor_backend": "ray"}, "data_parallel_size > 1 with distributed_executor_backend"),
])
def test_data_parallel_refuses_what_it_does_not_support_by_name(tiny_llama_dir, options, named):
    with pytest.raises(ValueError, match=named):
        AsyncClient(tiny_llama_dir, data_parallel_size=2, **options).engine_args.check()


def test_llm_with_two_replicas_gives_one_engines_output(tiny_llama_dir):
    from actors import LLM

    one = LLM(tiny_llama_dir, kv_cache_memory="32MiB")
    prompts = make_prompts(one.config.model.vocab_size, [5, 17, 33, 9], seed=4)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(tiny_llama_dir, kv_cache_memory="32MiB", data_parallel_size=2) as replicated:
        assert replicated.engine is None  # the replicas run behind an AsyncClient
        assert [o.outputs[0].token_ids for o in replicated.generate(prompts, GREEDY, use_tqdm=False)] == expected
