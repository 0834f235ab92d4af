"""Workers as Ray actors (distributed_executor_backend='ray') on a local Ray cluster the
engine starts: two pipeline stages give one worker process's greedy tokens, and a Ray
worker actor killed with SIGKILL fails every pending request within 5 s. Skipped without
the ray package (the troupe[ray] extra)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from actors import LLM, AsyncClient, SamplingParams
from actors.errors import EngineDeadError
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, make_prompts
from tests.engine.test_supervision import consume, pid_exists

pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


async def test_two_stages_as_ray_actors_match_one_process_and_a_killed_actor_fails_requests(make_tiny_model):
    from actors.engine.ray_executor import RayWorkerProcess

    model_dir = make_tiny_model("llama", max_position_embeddings=8192)
    one = LLM(model_dir, kv_cache_memory="32MiB")
    prompts = make_prompts(one.config.model.vocab_size, PROMPT_LENGTHS, seed=5)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]

    client = AsyncClient(model_dir, kv_cache_memory="32MiB", pipeline_parallel_size=2,
                         distributed_executor_backend="ray", max_num_batched_tokens=32)
    async with asyncio.timeout(180):
        await client.start()
    workers = {name: process for name, process in client.processes.processes.items() if name.startswith("worker")}
    pids = list(client.actor_pids().values())
    try:
        assert len(workers) == 2 and all(isinstance(w, RayWorkerProcess) for w in workers.values())
        outputs = await asyncio.wait_for(client.generate_batch(prompts, GREEDY, use_tqdm=False), 60)
        assert [o.outputs[0].token_ids for o in outputs] == expected

        await kill_fails_requests(client, prompts[:4], workers["worker1"].pid)
    finally:
        async with asyncio.timeout(60):
            await client.close()
    assert not [pid for pid in pids if pid_exists(pid)]


async def kill_fails_requests(client: AsyncClient, prompts: list, pid: int) -> None:
    """SIGKILL of pid while prompts generate: each fails with EngineDeadError within 5 s."""
    long = SamplingParams(temperature=0.0, max_tokens=8000, ignore_eos=True)
    tasks = [asyncio.create_task(consume(client.generate(p, long))) for p in prompts]
    await asyncio.sleep(0.5)
    assert not any(task.done() for task in tasks)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
    assert time.monotonic() - killed_at < 5.0
    assert all(isinstance(result, EngineDeadError) for result in results), results
