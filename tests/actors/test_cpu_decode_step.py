"""The CPU's decode steps in one C++ call (actors/worker/cpu_decode_step.py) against the
model's op-by-op forward: the same kernels in the same order, so the same bits."""

from __future__ import annotations

import random

import pytest

from actors import LLM, SamplingParams
from actors.worker.cpu_decode_step import CpuDecodeStep


@pytest.fixture
def fused_steps(monkeypatch) -> list[int]:
    """Counts the steps CpuDecodeStep runs (each call appends its number of tokens)."""
    calls: list[int] = []
    run = CpuDecodeStep.__call__

    def counting(self, hidden, *args):
        calls.append(hidden.shape[0])
        return run(self, hidden, *args)

    monkeypatch.setattr(CpuDecodeStep, "__call__", counting)
    return calls


def generate(model_dir: str, fused: bool, prompts: list[list[int]], params: SamplingParams, fused_steps: list[int],
             **engine):
    llm = LLM(model_dir, kv_cache_memory="64MiB", **engine)
    llm.engine.runner.model.backend.fused_decode = fused
    fused_steps.clear()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert bool(fused_steps) == fused
    return outputs


# Llama 3 (rope scaling), Qwen2 (qkv bias: the bias is added as F.linear adds it), Qwen3
# (q/k norms); 3 sequences take the few-rows linear, 24 MKL's sgemm
@pytest.mark.parametrize("fixture", ["tiny_llama3_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("num_prompts", [3, 24])
def test_fused_decode_steps_give_the_op_by_op_results_bit_for_bit(fixture, num_prompts, request, fused_steps):
    model_dir = request.getfixturevalue(fixture)
    rng = random.Random(num_prompts)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(1, 40))] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    fused = generate(model_dir, True, prompts, params, fused_steps)
    assert max(fused_steps) == num_prompts
    op_by_op = generate(model_dir, False, prompts, params, fused_steps)
    for a, b in zip(fused, op_by_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_steps_with_prefill_chunks_take_the_op_by_op_forward(tiny_llama_dir, fused_steps):
    # a 16-token budget chunks the prompts and mixes chunks into decode steps; 2-token blocks
    # make every decode cross blocks
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (2, 30, 45, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = dict(max_num_batched_tokens=16, block_size=2)
    fused = generate(tiny_llama_dir, True, prompts, params, fused_steps, **engine)
    op_by_op = generate(tiny_llama_dir, False, prompts, params, fused_steps, **engine)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in op_by_op]
