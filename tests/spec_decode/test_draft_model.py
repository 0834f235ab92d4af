"""The draft_model proposer end to end in the offline engine, and in the actor engine with
async scheduling: a draft equal to the target accepts every draft; other drafts (a
layer-skip copy of the target, which agrees sometimes, and a model of another seed, which
hardly ever does) keep the greedy output token-identical to decoding without speculation,
with chunked prefill, prefix caching, preemption, max_tokens and stop strings inside
speculated runs; seeded sampling is reproducible; the draft's real q keeps the target's
distribution under rejection sampling (chi-square); a draft that cannot serve fails at
start-up, naming why."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch
from scipy.stats import chisquare

from actors import LLM, AsyncClient, SamplingParams
from actors.spec_decode.layer_skip import save_layer_skip_draft
from actors.spec_decode.draft_model import draw_drafts
from actors.worker.model_runner import CachedRequest
from actors.spec_decode.speculator import Speculator
from tests.spec_decode.test_speculative_async import completions
from tests.spec_decode.test_speculative_llm import (ENGINE_ARGS, GREEDY, assert_seeded_sampling_reproduces_beside_others,
                                                    loop_prompts, token_ids)


def draft_config(model: str, k: int) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def spec_stats(llm: LLM) -> dict:
    return {key: value for key, value in llm.scheduler.stats().items() if key.startswith("spec_decode")}


@pytest.fixture(scope="module")
def drafts(tiny_llama_dir, make_tiny_model, tmp_path_factory) -> dict[str, str]:
    """The target itself, its first layer alone (agrees sometimes) and a one-layer model of
    another seed (same tokenizer, hardly ever agrees)."""
    return {"target": tiny_llama_dir,
            "layer_skip": save_layer_skip_draft(tiny_llama_dir, str(tmp_path_factory.mktemp("skip")), 1),
            "other_seed": make_tiny_model("llama", seed=1, num_hidden_layers=1)}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> tuple[LLM, list[list[int]], list]:
    base = LLM(tiny_llama_dir, **ENGINE_ARGS)
    prompts = loop_prompts(base.config.model.vocab_size)
    return base, prompts, token_ids(base.generate(prompts, GREEDY, use_tqdm=False))


def test_a_draft_equal_to_the_target_accepts_every_draft(tiny_llama_dir, drafts, reference):
    """Every draft accepted also means the draft's KV of its accepted drafts, kept from the
    step that drafted them, is right: a misplaced one would make the next drafts differ."""
    _, prompts, expected = reference
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=draft_config(drafts["target"], 3))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 40
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft", ["layer_skip", "other_seed"])
def test_greedy_output_is_token_identical_to_decoding_without_speculation(tiny_llama_dir, drafts, reference, draft,
                                                                          k):
    _, prompts, expected = reference
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=draft_config(drafts[draft], k))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 40
    assert sum(stats[f"spec_decode_num_accepted_tokens_pos_{i}"] for i in range(k)) == \
        stats["spec_decode_num_accepted_tokens"]
    if draft == "layer_skip":  # both paths: accepted drafts (their draft KV kept) and rejections
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert llm.scheduler.stats()["num_free_blocks"] == llm.scheduler.stats()["num_total_blocks"]


def test_chunked_prefill_prefix_caching_and_preemption_keep_the_greedy_output(tiny_llama_dir, drafts, reference):
    _, prompts, expected = reference
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=8,
              speculative_config=draft_config(drafts["layer_skip"], 3))
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)  # the prompts' blocks come from the cache
    assert token_ids(first) == token_ids(second) == expected
    assert all(output.num_cached_tokens > 0 for output in second[:2])
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    # 7 blocks of 16 tokens (the target's and the draft's KV each): the three requests
    # (up to 78 tokens each) cannot all stay
    llm = LLM(tiny_llama_dir, num_kv_blocks=7, max_num_batched_tokens=256,
              speculative_config=draft_config(drafts["target"], 3))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0
    # a preempted request's draft starts over, in its new blocks: still every draft accepted
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def test_max_tokens_and_stop_strings_inside_speculated_runs_end_the_output_there(tiny_llama_dir, drafts, reference):
    base, prompts, expected = reference
    loop, full = prompts[0], expected[0][0]
    # the target as its own draft accepts all 5 drafts a step: most limits fall inside a run
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=draft_config(drafts["target"], 5))
    by_length = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(2, 14)]
    outputs = llm.generate([loop] * len(by_length), by_length, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [full[:m] for m in range(2, 14)]
    base_text = base.generate([loop], GREEDY, use_tqdm=False)[0].outputs[0].text
    stops = sorted({base_text[i:i + 2] for i in range(3, len(base_text) - 2, 4)} - {""})
    stopped = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop]) for stop in stops
               if "\ufffd" not in stop]
    want = base.generate([loop] * len(stopped), stopped, use_tqdm=False)
    got = llm.generate([loop] * len(stopped), stopped, use_tqdm=False)
    assert [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in want]
    assert sum(o.outputs[0].finish_reason == "stop" for o in want) > len(stopped) // 2


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama_dir, drafts, reference):
    _, prompts, _ = reference
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=draft_config(drafts["layer_skip"], 3))
    assert_seeded_sampling_reproduces_beside_others(llm, prompts)
    stats = spec_stats(llm)
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_rejection_sampling_with_a_real_drafts_q_keeps_the_targets_distribution(tiny_llama_dir, drafts):
    """One position: the target's and the other-seed draft's logits after a prompt (run by
    transformers), the draft drawn from q as the worker draws it, verified as the worker
    verifies: the emitted token follows the target's p."""
    from transformers import AutoModelForCausalLM

    prompt = torch.tensor([[5, 17, 42, 9, 100, 7]])
    with torch.no_grad():
        p_logits = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)(prompt).logits[0, -1].float()
        q_logits = AutoModelForCausalLM.from_pretrained(drafts["other_seed"])(prompt).logits[0, -1].float()
    num_draws = 30_000
    params = SamplingParams(temperature=0.9, top_k=8, max_tokens=10)  # 8 tokens: a checkable support
    requests = [CachedRequest(str(i), [5, 17, 42, 9, 100, 7], 6, params, [0], 5) for i in range(num_draws)]
    torch.manual_seed(0)
    draft_tokens, q = draw_drafts(q_logits.expand(num_draws, -1), requests, 0)
    # the target scores the decode's position and the draft's: both rows are p here (only
    # the first emitted token is checked; after an accepted draft the bonus comes from row 2)
    logits = p_logits.expand(2 * num_draws, -1)
    emitted = Speculator.verify(logits, requests, [[t] for t in draft_tokens], [row.unsqueeze(0) for row in q])
    first = torch.tensor([tokens[0] for tokens in emitted])
    accepted = sum(len(tokens) == 2 for tokens in emitted) / num_draws
    assert accepted < 0.5  # the draft disagrees often: the residual path carries most draws
    p = torch.softmax(p_logits / 0.9, dim=-1)
    support = p.topk(8).indices
    assert torch.isin(first, support).all()
    observed = torch.bincount(first, minlength=p.numel())[support].double()
    expected = p[support].double() / p[support].double().sum() * num_draws
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4, (observed, expected)


def swapped_tokenizer_copy(model_dir: str, out_dir: str) -> str:
    """model_dir with two tokens' ids swapped in its tokenizer: same vocab size, another tokenizer."""
    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "tokenizer.json")
    with open(path) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    first, second = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])[100:102]]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    with open(path, "w") as f:
        json.dump(tokenizer, f)
    return out_dir


def test_a_draft_that_cannot_serve_fails_at_start_up_naming_why(tiny_llama_dir, make_tiny_model, tmp_path):
    vocab_size = LLM(tiny_llama_dir, **ENGINE_ARGS).config.model.vocab_size
    cases = [
        (draft_config(str(tmp_path / "missing"), 2), {}, "does not load.*no such file"),
        (draft_config(make_tiny_model("llama", vocab_size=vocab_size + 8), 2), {}, "vocab_size"),
        (draft_config(make_tiny_model("llama", max_position_embeddings=128), 2), {}, "max_position_embeddings"),
        (draft_config(swapped_tokenizer_copy(tiny_llama_dir, str(tmp_path / "swapped")), 2), {},
         "another tokenizer"),
        (draft_config(tiny_llama_dir, 2), {"tensor_parallel_size": 2}, "one device"),
        ({"method": "eagle", "model": tiny_llama_dir, "num_speculative_tokens": 2}, {}, "'eagle'"),
    ]
    for config, extra, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama_dir, **ENGINE_ARGS, **extra, speculative_config=config)
    # a lower max_model_len fits the short draft
    LLM(tiny_llama_dir, **ENGINE_ARGS, max_model_len=128,
        speculative_config=draft_config(make_tiny_model("llama", max_position_embeddings=128), 2))


async def test_actor_engine_with_async_scheduling_matches_decoding_without_speculation(tiny_llama_dir, drafts,
                                                                                        reference):
    _, prompts, expected = reference
    client = AsyncClient(tiny_llama_dir, **ENGINE_ARGS, async_scheduling=True,
                         speculative_config=draft_config(drafts["layer_skip"], 3))
    async with asyncio.timeout(120):
        await client.start()
    try:
        results = await asyncio.gather(*[completions(client, p, GREEDY) for p in prompts])
        assert [[r[0][0]] for r in results] == expected
        async with asyncio.timeout(10):
            stats = await client.get_stats()
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    finally:
        async with asyncio.timeout(30):
            await client.close()
