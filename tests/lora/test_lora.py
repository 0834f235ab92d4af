"""LoRA adapters in the engine against PEFT: greedy output per request equals PeftModel's
on the same weights, for batches mixing adapters of different ranks and targets with the
base model, through the C++ one-call step, the Python forward, chunked prefill with
preemption, and tensor parallelism (gloo); the prefix cache kept apart per adapter; the
workers' slot and host-memory eviction."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors import LLM, AsyncClient, LoRAAdapterError, LoRARequest, SamplingParams
from tests.lora_adapters import build_lora_adapter, peft_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# (rank, target modules, alpha, rsLoRA, layers): ranks and targets differ, one adapts one layer only
ADAPTERS = {
    "all8": dict(rank=8),
    "qvdown16": dict(rank=16, target_modules=["q_proj", "v_proj", "down_proj"], alpha=8),
    "ogateup12rs": dict(rank=12, target_modules=["o_proj", "gate_proj", "up_proj"], use_rslora=True),
    "k4layer1": dict(rank=4, target_modules=["k_proj", "o_proj"], alpha=32, layers_to_transform=[1]),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, index + 1, build_lora_adapter(tiny_llama_dir, str(root / name), seed=index,
                                                                    **options))
            for index, (name, options) in enumerate(ADAPTERS.items())}


def make_prompts(count: int, seed: int, lengths: tuple[int, ...] = (4, 11, 19, 35)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


@pytest.fixture(scope="module")
def mixed_workload(tiny_llama_dir, adapters) -> tuple[list[list[int]], list[LoRARequest | None], list[list[int]]]:
    """Prompts, each one's adapter (None: the base model), interleaved, and PEFT's greedy tokens."""
    prompts, loras, expected = [], [], []
    for index, lora in enumerate([*adapters.values(), None]):
        group = make_prompts(3, seed=index)
        prompts += group
        loras += [lora] * len(group)
        expected += peft_greedy(tiny_llama_dir, lora.lora_path if lora else None, group, GREEDY.max_tokens)
    order = random.Random(7).sample(range(len(prompts)), len(prompts))  # adapters mixed in every step
    base = [e for e, lora in zip(expected, loras) if lora is None]
    for e, lora in zip(expected, loras):
        if lora is not None:
            assert e not in base  # each adapter changes the output
    return [prompts[i] for i in order], [loras[i] for i in order], [expected[i] for i in order]


def generated(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("engine", [
    dict(max_loras=4),  # every adapter in a step: the C++ one-call step
    dict(max_loras=2, attention_backend="torch"),  # the Python forward; the scheduler holds adapters back
])
def test_mixed_adapters_and_base_match_peft(tiny_llama_dir, mixed_workload, engine):
    prompts, loras, expected = mixed_workload
    llm = LLM(tiny_llama_dir, enable_lora=True, kv_cache_memory="32MiB", **engine)
    assert generated(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == expected
    assert (llm.engine.runner.model_step is not None) == ("attention_backend" not in engine)


def test_chunked_prefill_and_preemption_match_peft(tiny_llama_dir, mixed_workload):
    # 16-token steps chunk the longer prompts; 24 blocks of 4 tokens cannot hold every
    # request, so some are preempted and recomputed; one slot: one adapter at a time
    prompts, loras, expected = mixed_workload
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=1, max_num_batched_tokens=16, block_size=4,
              num_kv_blocks=24)
    assert generated(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == expected
    assert llm.scheduler.num_preemptions > 0
    assert llm.engine.runner.lora_slots.num_slot_writes >= len(ADAPTERS)


def test_adapters_evicted_from_slots_and_host_memory_are_read_again(tiny_llama_dir, adapters, mixed_workload):
    prompts, loras, expected = mixed_workload
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=1, max_cpu_loras=2, kv_cache_memory="32MiB")
    slots = llm.engine.runner.lora_slots
    first, second, third = list(adapters.values())[:3]
    cases = [(p, lora, e) for p, lora, e in zip(prompts, loras, expected) if lora in (first, second, third)]
    for wanted in (first, second, third, first, first):  # first leaves host memory when third comes
        for prompt, lora, tokens in cases:
            if lora == wanted:
                assert generated(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)) == [tokens]
    assert (slots.num_loads, slots.num_slot_writes) == (4, 4)


async def test_tensor_parallel_2_matches_peft(tiny_llama_dir, mixed_workload):
    prompts, loras, expected = mixed_workload
    async with asyncio.timeout(240):
        async with AsyncClient(tiny_llama_dir, enable_lora=True, max_loras=3, tensor_parallel_size=2,
                               kv_cache_memory="32MiB") as client:
            outputs = await client.generate_batch(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert generated(outputs) == expected


def test_prefix_cache_is_kept_apart_per_adapter(tiny_llama_dir, adapters):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, kv_cache_memory="32MiB")
    pool = llm.scheduler.block_pool
    prompt = make_prompts(1, seed=3, lengths=(70,))  # four full blocks of 16 to share
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def hit_tokens(lora: LoRARequest | None) -> int:
        before = pool.num_prefix_hit_tokens
        llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return pool.num_prefix_hit_tokens - before

    first, second = adapters["all8"], adapters["qvdown16"]
    assert hit_tokens(first) == 0
    assert hit_tokens(second) == 0  # the same tokens under another adapter: no hit
    assert hit_tokens(None) == 0  # nor for the base model
    assert hit_tokens(first) == 64 and hit_tokens(second) == 64 and hit_tokens(None) == 64  # each its own
    renamed = LoRARequest("another-name", first.lora_int_id, first.lora_path)
    assert hit_tokens(renamed) == 64  # the same adapter (id and path) under another name shares


async def test_async_client_checks_adds_and_forgets_adapters(tiny_llama_dir, adapters, mixed_workload, tmp_path):
    prompts, loras, expected = mixed_workload
    lora = adapters["qvdown16"]
    missing = LoRARequest("missing", 90, str(tmp_path / "nowhere"))
    async with asyncio.timeout(120):
        async with AsyncClient(tiny_llama_dir, enable_lora=True, max_loras=2, kv_cache_memory="16MiB") as client:
            assert await client.add_lora(lora) is True and await client.add_lora(lora) is False
            assert await client.list_loras() == {lora.lora_int_id}
            with pytest.raises(LoRAAdapterError, match="no such directory"):
                await client.add_lora(missing)
            with pytest.raises(LoRAAdapterError, match="already adapter 'qvdown16'"):
                await client.add_lora(LoRARequest("clash", lora.lora_int_id, missing.lora_path))
            # a request for a bad adapter is refused by the input processor; the engine goes on
            with pytest.raises(LoRAAdapterError, match="no such directory") as refused:
                await client.generate([5, 6, 7], GREEDY, lora_request=missing)
            assert refused.value.param == "lora_request"
            with pytest.raises(LoRAAdapterError, match="must be a LoRARequest"):
                client.generate([5, 6, 7], GREEDY, lora_request={"lora_name": "x"})
            index = loras.index(lora)
            output = await client.generate(prompts[index], GREEDY, lora_request=lora)
            assert output.outputs[0].token_ids == expected[index]
            assert await client.remove_lora(lora.lora_int_id) and not await client.remove_lora(lora.lora_int_id)
            assert await client.list_loras() == set()


def test_beam_search_with_adapters_equals_peft_beams(tiny_llama_dir, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors import BeamSearchParams
    from tests.frontend.test_beam_search import assert_same_beams, hf_beams, troupe_beams

    prompts = make_prompts(2, seed=11)
    loras = [adapters["all8"], adapters["ogateup12rs"]]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, kv_cache_memory="16MiB")
    outputs = llm.beam_search(prompts, params, lora_request=loras)  # one adapter per prompt
    for prompt, lora, output in zip(prompts, loras, outputs):
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32")
        peft_model = PeftModel.from_pretrained(base, lora.lora_path).eval()
        assert_same_beams(troupe_beams(output, prompt, params), hf_beams(peft_model, prompt, params))


def test_a_lora_delta_on_gguf_weights_does_not_depend_on_the_batch(smollm2_dir, tmp_path):
    """The default model's Q4_1 blocks quantize each layer's input per block of 32, so a
    last-bit difference in a LoRA delta can move an int8 rounding and a logprob by 0.1: a
    prompt alone (two copies: every step has two rows, so the base runs one kernel) and in a
    batch of eight must get the same logprobs to the bit."""
    adapter = LoRARequest("smol", 1, build_lora_adapter(smollm2_dir, str(tmp_path / "smol"), rank=8))
    llm = LLM(enable_lora=True, max_lora_rank=8, kv_cache_memory="256MiB")  # the embedded .gguf, quantized
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 3000) for _ in range(length)] for length in (37, 50, 23, 61, 44, 29, 70, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    batch = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)
    for index in (0, 3):
        pair = llm.generate([prompts[index]] * 2, params, use_tqdm=False, lora_request=adapter)
        for output in (pair[0].outputs[0], pair[1].outputs[0]):
            assert output.token_ids == batch[index].outputs[0].token_ids
            assert output.logprobs == batch[index].outputs[0].logprobs
