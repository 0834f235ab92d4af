"""Workers as Ray actors over several Ray nodes: a ray.cluster_utils.Cluster on this
machine (a head and a worker node with one CPU each), so that the two tensor-parallel
ranks cannot share a node. The rank on the driver's node keeps ipc, the other talks tcp;
greedy tokens equal the mp backend's, and two pipeline stages over the two nodes one
worker's; a SIGKILL of the other node's worker fails every
pending request within 5 s; a cluster too small for the ranks is refused at start-up, one
whose CPUs another job holds fails after a bounded wait.
Skipped without the ray package (the troupe[ray] extra)."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors import LLM, AsyncClient, SamplingParams
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, make_prompts
from tests.engine.test_ray_executor import kill_fails_requests
from tests.engine.test_supervision import pid_exists

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    cluster.add_node(num_cpus=1, num_gpus=0)
    ray.init(address=cluster.address, include_dashboard=False)
    try:
        cluster.wait_for_nodes(timeout=60)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


async def test_tensor_parallel_over_two_ray_nodes(make_tiny_model, two_node_cluster, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group

    from actors.engine import ray_executor
    from actors.errors import EngineStartupError
    from actors.engine.ray_executor import RayWorkerProcess

    model_dir = make_tiny_model("llama", max_position_embeddings=8192)
    with LLM(model_dir, kv_cache_memory="32MiB", tensor_parallel_size=2) as mp:
        prompts = make_prompts(mp.config.model.vocab_size, PROMPT_LENGTHS, seed=7)
        expected = [o.outputs[0].token_ids for o in mp.generate(prompts, GREEDY, use_tqdm=False)]

    # four ranks on two one-CPU nodes: refused at once, naming the shortfall
    too_big = AsyncClient(model_dir, kv_cache_memory="32MiB", tensor_parallel_size=4,
                          distributed_executor_backend="ray")
    started = time.monotonic()
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        async with asyncio.timeout(60):
            await too_big.start()
    assert time.monotonic() - started < 30

    # enough CPUs in all, but one held by another job: a bounded wait, then a clear failure
    other_job = placement_group([{"CPU": 1}])
    ray.get(other_job.ready(), timeout=30)
    monkeypatch.setattr(ray_executor, "_PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(EngineStartupError, match="did not free 2 CPU bundles"):
        async with asyncio.timeout(60):
            await AsyncClient(model_dir, kv_cache_memory="32MiB", tensor_parallel_size=2,
                              distributed_executor_backend="ray").start()
    remove_placement_group(other_job)
    monkeypatch.undo()

    client = AsyncClient(model_dir, kv_cache_memory="32MiB", tensor_parallel_size=2,
                         distributed_executor_backend="ray")
    async with asyncio.timeout(180):
        await client.start()
    workers = {name: process for name, process in client.processes.processes.items() if name.startswith("worker")}
    pids = list(client.actor_pids().values())
    try:
        assert all(isinstance(worker, RayWorkerProcess) for worker in workers.values())
        remote = [name for name, worker in workers.items() if not worker.local]
        assert len(remote) == 1, "the two ranks should be on two Ray nodes"
        addresses = client.processes.addresses
        assert addresses[remote[0]].startswith("tcp://") and addresses[f"plans{remote[0][-1]}"].startswith("tcp://")
        local = next(name for name in workers if name not in remote)
        assert addresses[local].startswith("ipc://")

        outputs = await asyncio.wait_for(client.generate_batch(prompts, GREEDY, use_tqdm=False), 60)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert await client.ping(5.0) > 0  # the remote rank answers over tcp

        await kill_fails_requests(client, prompts[:3], workers[remote[0]].pid)
    finally:
        async with asyncio.timeout(60):
            await client.close()
    assert not [pid for pid in pids if pid_exists(pid)]

    # two pipeline stages on the two nodes: one worker's tokens (the last stage, which answers
    # the scheduler, may be the remote one: its results then come over tcp too)
    single = LLM(model_dir, kv_cache_memory="32MiB")
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    async with asyncio.timeout(240), AsyncClient(model_dir, kv_cache_memory="32MiB", pipeline_parallel_size=2,
                                                 distributed_executor_backend="ray",
                                                 max_num_batched_tokens=32) as stages:
        assert sum(not worker.local for name, worker in stages.processes.processes.items()
                   if name.startswith("worker")) == 1
        outputs = await stages.generate_batch(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
