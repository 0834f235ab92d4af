"""MoE decoders (actors/models/moe.py) against Hugging Face transformers on the same fp32
weights: greedy tokens and logprobs, batched (tokens routed unevenly over the experts), with
chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest

from actors import LLM, SamplingParams
from tests.models.moe_models import MOE_FAMILIES, build_tiny_moe
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe_dir(request, tmp_path_factory) -> str:
    return build_tiny_moe(str(tmp_path_factory.mktemp(request.param)), request.param)


def _assert_matches(outputs, expected_tokens, expected_logprobs) -> None:
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens
    for output, steps in zip(outputs, expected_logprobs):
        for token, position, hf_logprobs in zip(output.outputs[0].token_ids, output.outputs[0].logprobs, steps):
            for token_id, logprob in position.items():
                assert abs(logprob.logprob - float(hf_logprobs[token_id])) < 1e-3


def test_moe_greedy_and_logprobs_match_hf(moe_dir):
    # 8 prompts of 3 to 100 tokens in one batch: the experts get uneven shares of the rows
    llm = LLM(moe_dir, kv_cache_memory="64MiB")
    assert llm.config.model.moe is not None
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS)
    expected = hf_greedy(moe_dir, prompts, GREEDY.max_tokens)
    _assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), *expected)


def test_moe_matches_hf_with_chunked_prefill_prefix_caching_and_preemption(moe_dir):
    # a 16-token budget chunks the long prompts; 40 blocks of 4 tokens cannot hold all the
    # requests, so some are preempted; the shared 24-token prefix is served from the cache
    llm = LLM(moe_dir, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40, enable_prefix_caching=True)
    vocab = llm.config.model.vocab_size
    prefix = make_prompts(vocab, [24], seed=5)[0]
    prompts = [prefix + p for p in make_prompts(vocab, [3, 9, 17, 30], seed=1)] + make_prompts(vocab, [50, 64], seed=2)
    expected = hf_greedy(moe_dir, prompts, GREEDY.max_tokens)
    _assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), *expected)
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_sparse_layers_hold_stacked_experts_for_the_cpu_kernel(moe_dir):
    # on the CPU the experts are moe_cpu.cpp's packed fp32 panels; dense layers keep their MLP
    model = LLM(moe_dir, kv_cache_memory="16MiB").engine.runner.model
    moe = model.config.moe
    assert sorted(model.sparse) == list(moe.sparse_layers) and moe.num_experts >= 8 and moe.top_k >= 2
    for index, layer in enumerate(model.layers):
        sparse = model.sparse.get(index)
        assert (layer.gate_up_proj is None) == (sparse is not None)
        if sparse is not None:
            assert sparse.experts.cpu is not None and sparse.experts.cpu.num_experts == moe.num_experts
