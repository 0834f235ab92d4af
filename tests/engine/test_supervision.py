"""Supervision: a dead actor process fails every pending call fast, new calls fail at once,
and closing a client leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from actors import AsyncClient, EngineDeadError, EngineStartupError, SamplingParams
from tests.models.test_llm_matches_hf import make_prompts


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def consume(stream) -> None:
    async for _ in stream:
        pass


@pytest.fixture(scope="module")
def long_context_model_dir(make_tiny_model) -> str:
    """Room for thousands of decode steps, so requests are surely still running when killed."""
    return make_tiny_model("llama", max_position_embeddings=8192)


async def kill_during_generation(model_dir: str, victim: str, **engine_args) -> None:
    """Starts an engine, kills one actor with SIGKILL while requests run, and checks that
    every pending call fails within 5 s, new calls fail at once, and no process is left."""
    client = AsyncClient(model_dir, kv_cache_memory="64MiB", **engine_args)
    async with asyncio.timeout(120):
        await client.start()
    pids = [process.pid for process in client.processes.processes.values()]
    try:
        prompts = make_prompts(client.config.model.vocab_size, [20] * 8, seed=30)
        params = SamplingParams(temperature=0.0, max_tokens=8000, ignore_eos=True)
        tasks = [asyncio.create_task(consume(client.generate(p, params))) for p in prompts]
        await asyncio.sleep(0.5)
        assert not any(task.done() for task in tasks)

        os.kill(client.processes.processes[victim].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        assert time.monotonic() - killed_at < 5.0
        assert all(isinstance(result, EngineDeadError) for result in results), results

        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(consume(client.generate(prompts[0], params)), 1.0)
        with pytest.raises(EngineDeadError):
            client.check_health()
        assert not client.is_running
    finally:
        async with asyncio.timeout(30):
            await client.close()
    assert not [pid for pid in pids if pid_exists(pid)]


@pytest.mark.parametrize("victim", ["worker0", "detokenizer"])
async def test_kill_9_of_an_actor_fails_pending_calls_within_5_seconds(long_context_model_dir, victim):
    await kill_during_generation(long_context_model_dir, victim)


async def test_close_leaves_no_process_and_two_engines_coexist(tiny_llama_dir, tiny_qwen2_dir):
    first = AsyncClient(tiny_llama_dir, kv_cache_memory="32MiB", num_input_processors=2)
    second = AsyncClient(tiny_qwen2_dir, kv_cache_memory="32MiB")
    async with asyncio.timeout(120):
        await asyncio.gather(first.start(), second.start())
    pids = [p.pid for c in (first, second) for p in c.processes.processes.values()]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    try:
        async with asyncio.timeout(30):
            assert await first.ping() < 5.0 and await second.ping() < 5.0
            outs = await asyncio.gather(first.generate_batch(["Hello world!"] * 6, params, use_tqdm=False),
                                        second.generate_batch(["Hello world!"], params, use_tqdm=False))
        assert all(len(out[0].outputs[0].token_ids) == 5 for out in outs)
        # the two input processors tokenized alike
        assert len({tuple(o.prompt_token_ids) for o in outs[0]}) == 1
    finally:
        async with asyncio.timeout(30):
            await asyncio.gather(first.close(), second.close())
    assert not [pid for pid in pids if pid_exists(pid)]
    with pytest.raises(EngineDeadError):
        first.check_health()


async def test_a_model_that_cannot_load_fails_start_up_cleanly(tmp_path, tiny_llama_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(tiny_llama_dir):
        if name != "model.safetensors":
            (broken / name).write_bytes((open(os.path.join(tiny_llama_dir, name), "rb")).read())
    client = AsyncClient(str(broken), kv_cache_memory="32MiB")
    with pytest.raises(EngineStartupError, match="worker0"):
        async with asyncio.timeout(120):
            await client.start()
    assert not [p.pid for p in client.processes.processes.values() if pid_exists(p.pid)]
