"""The CPU's steps in one C++ call (actors/worker/cpu_model_step.py) against the model's
op-by-op forward: the same kernels in the same order, so the same bits."""

from __future__ import annotations

import random

import pytest

from actors import LLM, SamplingParams
from actors.worker.cpu_model_step import CpuModelStep


@pytest.fixture
def step_sizes(monkeypatch) -> list[int]:
    """The tokens of each step CpuModelStep runs."""
    sizes: list[int] = []
    run = CpuModelStep.__call__

    def counting(self, hidden, *args):
        sizes.append(hidden.shape[0])
        return run(self, hidden, *args)

    monkeypatch.setattr(CpuModelStep, "__call__", counting)
    return sizes


def generate(model_dir: str, fused: bool, prompts: list[list[int]], params: SamplingParams, step_sizes: list[int],
             **engine):
    llm = LLM(model_dir, kv_cache_memory="64MiB", **engine)
    llm.engine.runner.model.backend.fused_steps = fused
    step_sizes.clear()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert bool(step_sizes) == fused
    return outputs


def assert_same_outputs(fused, op_by_op) -> None:
    for a, b in zip(fused, op_by_op, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.prompt_logprobs == b.prompt_logprobs


# Llama 3 (rope scaling), Qwen2 (qkv bias: the bias is added as F.linear adds it), Qwen3
# (q/k norms); 3 sequences decode through the few-rows linear, 24 through MKL's sgemm
@pytest.mark.parametrize("fixture", ["tiny_llama3_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("num_prompts", [3, 24])
def test_fused_steps_give_the_op_by_op_results_bit_for_bit(fixture, num_prompts, request, step_sizes):
    model_dir = request.getfixturevalue(fixture)
    rng = random.Random(num_prompts)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(1, 40))] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    fused = generate(model_dir, True, prompts, params, step_sizes)
    assert step_sizes[-1] == num_prompts  # decode steps went through it as well as the prefill
    assert_same_outputs(fused, generate(model_dir, False, prompts, params, step_sizes))


def test_steps_mixing_prefill_chunks_and_decodes_give_the_op_by_op_results(tiny_llama_dir, step_sizes):
    # a 16-token budget chunks the prompts and mixes chunks into decode steps; 2-token blocks
    # make every decode cross blocks
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (2, 30, 45, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine = dict(max_num_batched_tokens=16, block_size=2)
    fused = generate(tiny_llama_dir, True, prompts, params, step_sizes, **engine)
    assert 16 in step_sizes and 4 in step_sizes  # full chunked steps, and decodes of all four
    assert_same_outputs(fused, generate(tiny_llama_dir, False, prompts, params, step_sizes, **engine))
