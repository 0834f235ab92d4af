"""The CPU's steps in one C++ call (actors/models/cpu_step.py) against the model's
op-by-op forward: the same kernels in the same order, so the same bits."""

from __future__ import annotations

import random

import pytest
import torch

from actors import LLM, SamplingParams
from actors.models.cpu_step import CpuModelStep
from actors.worker.model_runner import CachedRequest


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
    # Each engine times the C++ linear against sgemm at start-up; under load two engines
    # can pick different row counts, and the two linears round differently.
    llm.engine.runner.model.backend.few_rows = 4
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


def test_one_call_step_equals_the_op_by_op_forward_on_one_mixed_step(tiny_qwen3_dir):
    """One step straight through both forwards, as the model runner would choose between
    them: three decodes over cached keys (random ones, as a real cache holds), a whole
    prompt and a chunk after a cached prefix, over 4-token blocks."""
    llm = LLM(tiny_qwen3_dir, kv_cache_memory="16MiB", block_size=4)
    runner = llm.engine.runner
    assert runner.model_step is not None  # fp32 on one rank, the C++ kernels built
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1)
    # (tokens in the cache before the step, tokens this step): decodes first, as the runner orders them
    shapes = [(9, 1), (16, 1), (3, 1), (0, 11), (7, 6)]
    batch, next_block = [], 1
    for index, (num_cached, num_new) in enumerate(shapes):
        seq_len = num_cached + num_new
        num_blocks = -(-seq_len // 4)
        token_ids = torch.randint(3, 200, (seq_len,), generator=generator).tolist()
        request = CachedRequest(f"r{index}", token_ids, seq_len, params,
                                list(range(next_block + num_blocks - 1, next_block - 1, -1)), num_cached)
        batch.append((request, num_new))
        next_block += num_blocks
    input_ids, positions, attention = runner._prepare_inputs(batch)
    assert (attention.num_decodes, attention.num_prefills, attention.max_query_len) == (3, 2, 11)
    caches = [(torch.randn(k.shape, generator=generator), torch.randn(v.shape, generator=generator))
              for k, v in runner.kv_caches]
    op_by_op_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        one_call = runner.model_step(runner.model.embed(input_ids), positions, caches, attention)
        op_by_op = runner.model.forward(input_ids, positions, op_by_op_caches, attention)
        torch.testing.assert_close(one_call, op_by_op, rtol=1e-5, atol=1e-5)
        for (k, v), (k_ref, v_ref) in zip(caches, op_by_op_caches):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # the same keys and values stored
        greedy = runner.model.compute_logits(one_call).argmax(-1)
        assert torch.equal(greedy, runner.model.compute_logits(op_by_op).argmax(-1))


def assert_close_outputs(fused, op_by_op, tolerance: float = 1e-4) -> None:
    """The same tokens, and logprobs within tolerance (a one-call layer whose math functions
    are the C library's, not torch's: GELU's tanh, the router's exp)."""
    for a, b in zip(fused, op_by_op, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert abs(step_a[token].logprob - step_b[token].logprob) < tolerance


# Gemma 2 (alternating windows, attention soft cap) and Gemma 3 (5:1 windows, a local RoPE
# table, q/k norms): their layer (two more norms, GELU-tanh) in the one call, against the
# Python forward; GELU's tanh is the C library's, torch's its own, so close rather than equal
GEMMA_CONFIGS = {
    "gemma2": dict(sliding_window=16, num_hidden_layers=3, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                   final_logit_softcapping=5.0, tie_word_embeddings=True),
    "gemma3": dict(sliding_window=32, num_hidden_layers=7, query_pre_attn_scalar=16, rope_local_base_freq=100.0,
                   rope_theta=50000.0, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", list(GEMMA_CONFIGS))
def test_gemma_layers_in_one_call_give_the_op_by_op_results(arch, make_tiny_model, step_sizes):
    model_dir = make_tiny_model(arch, max_position_embeddings=1024, **GEMMA_CONFIGS[arch])
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 90, 41, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    engine = dict(max_num_batched_tokens=48, block_size=8)  # chunks across the windows, mixed with decodes
    fused = generate(model_dir, True, prompts, params, step_sizes, **engine)
    assert 48 in step_sizes and 4 in step_sizes
    op_by_op = generate(model_dir, False, prompts, params, step_sizes, **engine)
    assert_close_outputs(fused, op_by_op)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_moe_layers_in_one_call_give_the_op_by_op_results(family, step_sizes, tmp_path):
    """A mixture-of-experts layer in the one call (the router, its softmax top-k, moe_cpu.cpp's
    experts), a dense layer beside it (Qwen3-MoE's mlp_only_layers), against the Python
    forward; Qwen2-MoE's shared expert and OLMoE's whole-projection q/k norms stay op by op."""
    from tests.models.moe_models import build_tiny_moe

    model_dir = build_tiny_moe(str(tmp_path / family), family)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 60, 23, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    engine = dict(max_num_batched_tokens=32, block_size=8)
    if family in ("qwen2_moe", "olmoe"):
        assert LLM(model_dir, kv_cache_memory="16MiB").engine.runner.model_step is None
        return
    fused = generate(model_dir, True, prompts, params, step_sizes, **engine)
    assert 32 in step_sizes and 4 in step_sizes
    op_by_op = generate(model_dir, False, prompts, params, step_sizes, **engine)
    assert_close_outputs(fused, op_by_op)
