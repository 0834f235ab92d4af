"""Asynchronous steps (async_scheduling, on by default): a step is launched before the one
before it is finished, its decodes taking that step's tokens on the device. The outputs are
the same as with every step finished before the next (async_scheduling=False): greedy and
seeded sampling, stops, min_tokens, n, logprobs, penalties, preemption, aborts, speculative
decoding, LoRA adapters mixed in a batch; and a step
that needs the last tokens on the host (a grammar, bad words, a custom processor) waits for
them instead of running ahead. The in-process engine (LLM) runs ahead on the CPU too; the
actor engine's worker does whenever the next plan is already there (always on a GPU)."""

from __future__ import annotations

import asyncio

import pytest

from actors import LLM, AsyncClient, SamplingParams, StructuredOutputsParams
from tests.models.test_llm_matches_hf import make_prompts

ENGINE_ARGS = dict(kv_cache_memory="64MiB", max_num_batched_tokens=128, seed=0)


def _outputs(outputs) -> list:
    """What must be identical: each completion's tokens, text, finish and stop reasons, and the
    logprobs' tokens (their values are compared by _assert_same: a step's batch may hold other
    rows with and without asynchronous steps, and fp32 rounds a row's sums by the batch's shape)."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [{t: p.logprob for t, p in step.items()} for step in c.logprobs])
             for c in o.outputs] for o in outputs]


def _assert_same(ahead: list, behind: list) -> None:
    assert len(ahead) == len(behind)
    for request_ahead, request_behind in zip(ahead, behind):
        for (*fields, logprobs), (*expected_fields, expected_logprobs) in zip(request_ahead, request_behind):
            assert fields == expected_fields
            assert (logprobs is None) == (expected_logprobs is None)
            for step, expected in zip(logprobs or [], expected_logprobs or []):
                assert step.keys() == expected.keys()
                assert all(abs(step[t] - expected[t]) < 1e-4 for t in step)


def _both(model: str, prompts, params, lora_request=None, **engine_args) -> tuple[list, list, int]:
    """The outputs with and without asynchronous steps, and how many steps ran ahead."""
    results, run_ahead = [], 0
    for async_scheduling in (True, False):
        with LLM(model, **{**ENGINE_ARGS, **engine_args}, async_scheduling=async_scheduling) as llm:
            results.append(_outputs(llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)))
            if async_scheduling:
                run_ahead = llm.engine.runner.steps_run_ahead
    return results[0], results[1], run_ahead


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    return make_prompts(384, [3, 17, 40, 9, 64, 25, 5, 31], seed=5)


def test_greedy_stops_and_lengths_are_the_same(tiny_llama_dir, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, stop_token_ids=[40 + i], min_tokens=i % 3)
              for i in range(len(prompts))]
    ahead, behind, run_ahead = _both(tiny_llama_dir, prompts, params)
    _assert_same(ahead, behind)
    assert run_ahead > 10  # most steps were launched before the one before them finished


def test_seeded_sampling_with_penalties_n_and_logprobs_is_the_same(tiny_llama_dir, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=100 + i, n=2, max_tokens=12, logprobs=3,
                             presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                             stop=["a", "e"] if i % 2 else None)
              for i in range(len(prompts))]
    ahead, behind, run_ahead = _both(tiny_llama_dir, prompts, params)
    _assert_same(ahead, behind)
    assert run_ahead > 0


def test_preemption_in_a_small_cache_gives_the_same_outputs(tiny_llama_dir, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ahead, behind, _ = _both(tiny_llama_dir, prompts * 2, params, max_num_seqs=6)
    small = dict(num_kv_blocks=24, max_num_seqs=6)  # a few sequences' worth: preemption
    ahead_small, behind_small, run_ahead = _both(tiny_llama_dir, prompts * 2, params, **small)
    assert ahead_small == behind_small == ahead == behind
    assert run_ahead > 0


def test_speculative_decoding_gives_the_same_outputs(tiny_llama_dir, prompts):
    # repetitive prompts, so the n-gram proposer finds drafts and some are accepted
    repetitive = [(p[:4] * 12)[:40] for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[60 + i]) for i in range(len(prompts))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    ahead, behind, _ = _both(tiny_llama_dir, repetitive, params, speculative_config=spec)
    _assert_same(ahead, behind)
    plain, _, _ = _both(tiny_llama_dir, repetitive, params)
    assert [[c[0] for c in o] for o in ahead] == [[c[0] for c in o] for o in plain]  # greedy: speculation changes nothing


def test_lora_adapters_mixed_in_a_batch_give_the_same_outputs(tiny_llama_dir, prompts, tmp_path):
    from actors import LoRARequest
    from tests.lora_adapters import build_lora_adapter

    adapters = [LoRARequest(f"a{i}", i + 1, build_lora_adapter(tiny_llama_dir, str(tmp_path / f"a{i}"), seed=i))
                for i in range(2)]
    loras = [adapters[0], None, adapters[1], adapters[0], None, adapters[1], adapters[1], None]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ahead, behind, run_ahead = _both(tiny_llama_dir, prompts, params, lora_request=loras, enable_lora=True,
                                     max_loras=2, max_lora_rank=16)
    _assert_same(ahead, behind)
    assert run_ahead > 0


def test_steps_that_read_the_outputs_on_the_host_wait_for_them(tiny_llama_dir, prompts):
    def double_last(output_ids: list[int], logits):  # a custom processor: reads the output on the host
        if output_ids:
            logits[output_ids[-1] % 384] += 5.0
        return logits

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(temperature=0.0, max_tokens=10, logits_processors=[double_last]),
              SamplingParams(temperature=0.0, max_tokens=10, bad_words=["the"]),
              SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))]
    for param in params:
        ahead, behind, run_ahead = _both(tiny_llama_dir, prompts[:3], param)
        _assert_same(ahead, behind)
        assert run_ahead == 0, param


def test_a_request_aborted_while_its_step_runs_ahead_leaves_the_others_intact(tiny_llama_dir, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(tiny_llama_dir, **ENGINE_ARGS) as llm:
        expected = _outputs(llm.generate(prompts, greedy, use_tqdm=False))
        engine = llm.engine
        ids = llm._add_requests((None, p, greedy, None, None, None) for p in prompts)
        for _ in range(6):
            engine.step()
        engine.abort_request(ids[2])
        finished = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o for o in engine.step()})
        assert sorted(finished) == sorted(i for i in ids if i != ids[2])
        assert [_outputs([finished[i]])[0] for i in ids if i != ids[2]] == [e for k, e in enumerate(expected) if k != 2]


async def test_the_actor_engine_gives_the_same_outputs_with_and_without(tiny_llama_dir, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[50 + i]) for i in range(4)] + \
             [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=16, logprobs=2) for i in range(4)]
    results = []
    for async_scheduling in (True, False):
        client = AsyncClient(tiny_llama_dir, **ENGINE_ARGS, async_scheduling=async_scheduling)
        async with asyncio.timeout(120):
            await client.start()
            try:
                outputs = await client.generate_batch(prompts, params)
            finally:
                await client.close()
        results.append(_outputs(outputs))
    _assert_same(results[0], results[1])
