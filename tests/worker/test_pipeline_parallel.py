"""Pipeline parallelism on the CPU (gloo): greedy tokens identical to Hugging Face's with
2 and 3 stages and with 2 stages of 2 tensor-parallel ranks, through chunked prefill and
preemption; each stage holding its layers only; a dead stage failing every request."""

from __future__ import annotations

import asyncio
import json

import pytest

from actors import LLM, AsyncClient, SamplingParams
from actors.config.parallel_flags import stage_layers
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, hf_greedy, make_prompts
from tests.engine.test_supervision import kill_during_generation

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch, pp, tp, overrides", [
    ("llama", 2, 1, {}),  # 2 layers: one a stage
    ("qwen2", 3, 1, {"num_hidden_layers": 4, "tie_word_embeddings": True}),  # 2+1+1; the last stage's tied head
    ("llama", 2, 2, {"num_hidden_layers": 3}),  # 4 ranks: 2 stages of 2 tensor-parallel ranks
])
async def test_stages_match_hf_through_chunked_prefill_and_preemption(make_tiny_model, arch, pp, tp, overrides):
    model_dir = make_tiny_model(arch, **overrides)
    prompts = make_prompts(383 if arch == "qwen2" else 300, PROMPT_LENGTHS, seed=1)
    expected, _ = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    # a 24-token budget (a plan gets 1/P of it) chunks the longer prompts; 40 blocks of 4 tokens cannot hold all
    # eight requests, so some are preempted and recomputed
    async with asyncio.timeout(180):
        async with AsyncClient(model_dir, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                               max_num_batched_tokens=24, block_size=4, num_kv_blocks=40) as client:
            outputs = await client.generate_batch(prompts, GREEDY, use_tqdm=False)
            stats = await client.get_stats()
            ready = {name: client.processes.ready[name].info for name in client.processes.processes
                     if name.startswith("worker")}
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats["num_preemptions"] > 0
    assert len(ready) == pp * tp
    whole = LLM(model_dir, kv_cache_memory="8MiB").engine.runner.model.num_weight_bytes()
    assert all(info["weight_bytes"] < 0.8 * whole for info in ready.values())


@pytest.mark.slow
async def test_two_stages_on_smollm2_equal_one_worker(smollm2_dir):
    """The embedded model over 2 stages (15 layers each; the tied head on the last), its prompts chunked
    by a small budget, against one worker's greedy tokens."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 19556, 28, 957, 1462, 314, 216] * 4]
    with LLM(smollm2_dir, kv_cache_memory="64MiB") as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    async with asyncio.timeout(300):
        async with AsyncClient(smollm2_dir, pipeline_parallel_size=2, max_num_batched_tokens=16,
                               kv_cache_memory="64MiB") as client:
            outputs = await client.generate_batch(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


async def test_two_stages_compute_different_plans_at_once(make_tiny_model, tmp_path, monkeypatch):
    from actors.worker.pipeline import STAGE_TIMES_DIR

    monkeypatch.setenv(STAGE_TIMES_DIR, str(tmp_path))  # the stages write their step times at shutdown
    model_dir = make_tiny_model("llama", num_hidden_layers=4, hidden_size=256, intermediate_size=1024)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    async with asyncio.timeout(120):
        async with AsyncClient(model_dir, pipeline_parallel_size=2, kv_cache_memory="32MiB") as client:
            await client.generate_batch(make_prompts(300, [64] * 16, seed=2), params, use_tqdm=False)
    first, last = ([(start + waited, end) if stage == 0 else (end - (end - start - waited), end)
                    for start, end, waited in json.loads((tmp_path / f"stage{stage}.json").read_text())["steps"]]
                   for stage in (0, 1))
    overlap = sum(max(0.0, min(end, end1) - max(start, start1)) for start, end in first for start1, end1 in last)
    busy = sum(end - start for start, end in last)
    # run one after the other, the stages' compute would never overlap
    assert overlap > 0.2 * busy


def test_each_stage_sizes_its_kv_cache_from_its_own_layers(make_tiny_model):
    from actors.engine.args import EngineArgs
    from actors.worker.device_config import num_kv_blocks, resolve_device
    from actors.worker.pipeline import stage_engine, stage_of

    model_dir = make_tiny_model("llama", num_hidden_layers=3)
    one = num_kv_blocks(resolve_device(EngineArgs(model_dir, kv_cache_memory="6MiB").build()))
    staged = resolve_device(EngineArgs(model_dir, kv_cache_memory="6MiB", pipeline_parallel_size=3).build())
    # a third of the layers each: three times the blocks in the same memory
    assert [num_kv_blocks(stage_engine(staged, stage_of(staged, rank))) for rank in range(3)] == [3 * one] * 3


def test_layers_split_evenly_with_the_remainder_on_the_earlier_stages():
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(stage_layers(30, 4, s)) for s in range(4)] == [8, 8, 7, 7]


@pytest.mark.parametrize("victim", ["worker0", "worker1"])  # the first stage, the last (which answers)
async def test_kill_9_of_a_stage_fails_pending_requests(make_tiny_model, victim):
    await kill_during_generation(make_tiny_model("llama", max_position_embeddings=8192), victim,
                                 pipeline_parallel_size=2)


@pytest.mark.parametrize("options, named", [
    ({"enable_lora": True}, "enable_lora"),
    ({"pipeline_parallel_size": 3}, "layers"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
    ({"runner": "pooling"}, "pooling models"),
    ({"nnodes": 3}, r"nnodes \(3\) must divide tensor_parallel_size \(1\) x pipeline_parallel_size \(2\)"),
])
def test_unsupported_combinations_are_refused_by_name(tiny_llama_dir, options, named):
    with pytest.raises(ValueError, match=named):
        LLM(tiny_llama_dir, **{"pipeline_parallel_size": 2, **options})


def test_the_ray_backend_without_ray_names_the_extra(tiny_llama_dir, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "ray" else
                        find_spec(name, *rest))
    with pytest.raises(ValueError, match=r"distributed_executor_backend.*troupe\[ray\]"):
        LLM(tiny_llama_dir, distributed_executor_backend="ray")
