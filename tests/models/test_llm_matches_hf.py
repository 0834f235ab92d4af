"""The engine's greedy output and logprobs against Hugging Face transformers on the same
fp32 weights: whole batches, chunked prefill, preemption, and the real SmolLM2."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import LLM, SamplingParams


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


PROMPT_LENGTHS = [3, 9, 17, 32, 33, 50, 64, 100]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list]:
    """Each prompt alone (no padding), greedy, with the log-softmax of every step's logits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # no EOS: generation runs to max_tokens without masking EOS out (as ignore_eos does)
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                                 output_scores=True, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logprobs.append([step[0].float().log_softmax(-1) for step in out.logits])
    return tokens, logprobs


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_greedy_batch_matches_hf_token_for_token(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(model_dir, kv_cache_memory="64MiB")
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS)
    expected, _ = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_greedy_matches_hf_with_chunked_prefill_and_preemption(tiny_llama_dir):
    # a 16-token budget chunks every prompt longer than that; 40 blocks of 4 tokens (160
    # slots) cannot hold eight requests at once, so the newest ones are preempted and recomputed
    llm = LLM(tiny_llama_dir, max_num_batched_tokens=16, block_size=4, num_kv_blocks=40)
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=1)
    expected, _ = hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_top_logprobs_agree_with_hf_log_softmax(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, kv_cache_memory="64MiB")
    prompts = make_prompts(llm.config.model.vocab_size, [5, 40, 21], seed=2)
    expected_tokens, expected_logprobs = hf_greedy(tiny_qwen3_dir, prompts, 6)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    for output, tokens, steps in zip(llm.generate(prompts, params, use_tqdm=False),
                                     expected_tokens, expected_logprobs):
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        assert len(completion.logprobs) == len(tokens)
        for token, position, hf_logprobs in zip(tokens, completion.logprobs, steps):
            assert token in position and position[token].rank == 1
            top_ids = hf_logprobs.topk(5).indices.tolist()
            assert set(top_ids) <= set(position)
            for token_id, logprob in position.items():
                assert abs(logprob.logprob - float(hf_logprobs[token_id])) < 1e-3
        assert completion.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for t, p in zip(tokens, completion.logprobs)))


def test_prompt_logprobs_agree_with_hf(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=16)
    prompt = make_prompts(llm.config.model.vocab_size, [40], seed=3)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hf = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position][prompt[position]]
        assert abs(entry.logprob - float(hf[position - 1, prompt[position]])) < 1e-3


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_dir):
    llm = LLM(smollm2_dir, kv_cache_memory="256MiB")
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
             "1, 2, 3, 4,", "The quick brown fox", "Emoji test: 🎉", "日本語のテキスト",
             "A long prompt about the history of computing machines, " * 4]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    expected, _ = hf_greedy(smollm2_dir, prompts, 10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].outputs[0].text == llm.tokenizer.decode(expected[0], skip_special_tokens=True)
