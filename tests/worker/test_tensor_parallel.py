"""Tensor parallelism on the CPU (gloo): greedy tokens identical to one rank, each rank
holding its share of the weights, and a dead rank failing every request."""

from __future__ import annotations

import asyncio

import pytest

from actors import LLM, AsyncClient, SamplingParams
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, make_prompts
from tests.engine.test_supervision import kill_during_generation

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


async def greedy_tokens(model_dir: str, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], dict]:
    """The greedy tokens of an actor engine, and its local workers' ready reports."""
    engine_args.setdefault("kv_cache_memory", "32MiB")
    async with asyncio.timeout(180):
        async with AsyncClient(model_dir, **engine_args) as client:
            outputs = await client.generate_batch(prompts, GREEDY, use_tqdm=False)
            ready = {name: client.processes.ready[name].info for name in client.processes.processes
                     if name.startswith("worker")}
    return [o.outputs[0].token_ids for o in outputs], ready


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),  # 4 heads, 2 KV heads: one KV head a rank
    ("qwen3", {"head_dim": 32}),  # q/k norms
    ("llama", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: replicated
    ("qwen2", {"vocab_size": 383}),  # qkv biases, a vocabulary that does not split evenly
])
async def test_tp2_greedy_tokens_equal_one_rank(make_tiny_model, arch, overrides):
    model_dir = make_tiny_model(arch, **overrides)
    one = LLM(model_dir, kv_cache_memory="32MiB")
    prompts = make_prompts(one.config.model.vocab_size, PROMPT_LENGTHS, seed=40)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    tokens, ready = await greedy_tokens(model_dir, prompts, tensor_parallel_size=2)
    assert tokens == expected
    total = one.engine.runner.model.num_weight_bytes()
    for info in ready.values():
        # the norms are replicated, the rest split: a bit over half each
        assert total / 2 <= info["weight_bytes"] < 0.6 * total


@pytest.mark.slow
async def test_tp3_on_smollm2_equals_one_rank(smollm2_dir):
    # SmolLM2-135M: 9 heads and 3 KV heads, so 3 ranks of 3 heads and 1 KV head
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 19556, 28, 957, 1462, 314, 216]]
    with LLM(smollm2_dir, kv_cache_memory="64MiB") as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    tokens, ready = await greedy_tokens(smollm2_dir, prompts, tensor_parallel_size=3)
    assert tokens == expected and len(ready) == 3


async def test_kill_9_of_rank_1_fails_pending_requests_and_stops_every_rank(make_tiny_model):
    await kill_during_generation(make_tiny_model("llama", max_position_embeddings=8192), "worker1",
                                 tensor_parallel_size=2)


def test_tensor_parallel_size_must_divide_the_heads(tiny_llama_dir):
    with pytest.raises(ValueError, match="attention heads"):
        LLM(tiny_llama_dir, tensor_parallel_size=3)

