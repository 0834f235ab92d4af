"""Speculative decoding end to end in the offline engine (LLM: scheduler, worker and
detokenizer in one process): greedy output token-identical to decoding without it, for
ngram and suffix at k = 1, 3, 5, with chunked prefill, prefix caching, preemption, n = 2,
stop strings, stop tokens and max_tokens landing inside speculated runs; seeded sampling
reproducible; bad configs refused at start-up. Tiny random models fall into loops, so
drafts get accepted: each test checks acceptances happened, so the path really ran."""

from __future__ import annotations

import pytest

from actors import LLM, SamplingParams
from tests.models.test_llm_matches_hf import make_prompts

ENGINE_ARGS = dict(kv_cache_memory="64MiB", max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def loop_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts with repeated spans (the model then repeats too) and one without."""
    short, longer, plain = make_prompts(vocab_size, [6, 10, 20], seed=3)
    return [short * 4, longer * 3, plain]


def spec_config(method: str, k: int) -> dict:
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=4)
    return config


def token_ids(outputs) -> list[list[int]]:
    return [[list(c.token_ids) for c in output.outputs] for output in outputs]


def num_accepted(llm: LLM) -> int:
    return llm.scheduler.stats()["spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def base(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def reference(base) -> tuple[list[list[int]], list]:
    prompts = loop_prompts(base.config.model.vocab_size)
    return prompts, token_ids(base.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_output_is_token_identical_to_decoding_without_speculation(tiny_llama_dir, reference, method, k):
    prompts, expected = reference
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=spec_config(method, k))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.scheduler.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert sum(stats[f"spec_decode_num_accepted_tokens_pos_{i}"] for i in range(k)) == \
        stats["spec_decode_num_accepted_tokens"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_chunked_prefill_and_prefix_caching_keep_the_greedy_output(tiny_llama_dir, reference):
    prompts, expected = reference
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=8,
              speculative_config=spec_config("ngram", 3))
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)  # the prompts' blocks come from the cache
    assert token_ids(first) == token_ids(second) == expected
    assert all(output.num_cached_tokens > 0 for output in second[:2])
    assert num_accepted(llm) > 0


def test_preemption_keeps_the_greedy_output(tiny_llama_dir, reference):
    prompts, expected = reference
    # 7 blocks of 16 tokens: the three requests (up to 78 tokens each) cannot all stay
    llm = LLM(tiny_llama_dir, num_kv_blocks=7, max_num_batched_tokens=256, speculative_config=spec_config("suffix", 3))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_max_tokens_stop_tokens_and_stop_strings_inside_speculated_runs_end_the_output_there(tiny_llama_dir, base,
                                                                                              reference):
    prompts, expected = reference
    loop = prompts[0]
    full = expected[0][0]
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=spec_config("ngram", 5))
    # every length from 2 to 24: most end inside a run of accepted drafts
    by_length = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(2, 25)]
    outputs = llm.generate([loop] * len(by_length), by_length, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [full[:m] for m in range(2, 25)]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    # stop token ids and stop strings taken from all along the output (a stop string that
    # completes inside a step's accepted run: test_detokenizer.py, and SmolLM2's test below)
    base_text = base.generate([loop], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop_strings = {base_text[i:i + 2] for i in range(0, len(base_text) - 2)} - {""}
    stopped = [SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[full[i]]) for i in range(5, 40, 5)]
    stopped += [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop],
                               include_stop_str_in_output=i % 2 == 0)
                for i, stop in enumerate(sorted(s for s in stop_strings if "\ufffd" not in s))]
    want = base.generate([loop] * len(stopped), stopped, use_tqdm=False)
    got = llm.generate([loop] * len(stopped), stopped, use_tqdm=False)
    for got_output, want_output in zip(got, want):
        got_completion, want_completion = got_output.outputs[0], want_output.outputs[0]
        assert (got_completion.text, list(got_completion.token_ids), got_completion.finish_reason,
                got_completion.stop_reason) == (want_completion.text, list(want_completion.token_ids),
                                                want_completion.finish_reason, want_completion.stop_reason)
    assert sum(o.outputs[0].finish_reason == "stop" for o in want) > len(stopped) // 2
    assert num_accepted(llm) > 0


def assert_seeded_sampling_reproduces_beside_others(llm: LLM, prompts: list[list[int]]) -> None:
    """A seeded n=2 request gives the same output alone and between unseeded ones."""
    seeded = SamplingParams(n=2, temperature=0.7, top_p=0.95, top_k=50, seed=1234, max_tokens=32, ignore_eos=True)
    alone = token_ids(llm.generate(prompts[:1], seeded, use_tqdm=False))
    unseeded = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    mixed = llm.generate([prompts[1], prompts[0], prompts[2]], [unseeded, seeded, unseeded], use_tqdm=False)
    assert token_ids(mixed[1:2]) == alone
    assert alone[0][0] != alone[0][1]  # each completion its own seed


def test_n_2_speculates_per_sequence_and_seeded_sampling_is_reproducible(tiny_llama_dir, reference):
    prompts, expected = reference
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=spec_config("ngram", 3))
    greedy_n2 = SamplingParams(n=2, temperature=0.0, max_tokens=48, ignore_eos=True)
    assert token_ids(llm.generate(prompts[:1], greedy_n2, use_tqdm=False)) == [expected[0] * 2]
    assert_seeded_sampling_reproduces_beside_others(llm, prompts)
    stats = llm.scheduler.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_a_request_with_logprobs_or_penalties_decodes_without_drafts_beside_speculating_ones(tiny_llama_dir, base,
                                                                                             reference):
    prompts, expected = reference
    llm = LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=spec_config("ngram", 3))
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    penalized = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, repetition_penalty=1.3)
    params = [with_logprobs, penalized, GREEDY]
    got = llm.generate(prompts, params, use_tqdm=False)
    want = base.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want) and token_ids(got)[2] == expected[2]
    # the same tokens and ranks; the values to float32 noise (the batch's shape differs)
    for got_position, want_position in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs, strict=True):
        assert {t: p.rank for t, p in got_position.items()} == {t: p.rank for t, p in want_position.items()}
        assert all(got_position[t].logprob == pytest.approx(p.logprob, abs=1e-4) for t, p in want_position.items())


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 300}, "must fit in max_num_batched_tokens"),
    ('{"method": "ngram", ', "not valid JSON"),
])
def test_bad_speculative_configs_fail_at_start_up(tiny_llama_dir, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama_dir, **ENGINE_ARGS, speculative_config=config)


def test_a_pooling_model_cannot_speculate(tiny_llama_dir):
    with pytest.raises(ValueError, match="pooling model"):
        LLM(tiny_llama_dir, **ENGINE_ARGS, runner="pooling", speculative_config=spec_config("ngram", 2))


def test_smollm2_copying_a_passage_accepts_drafts_and_keeps_the_greedy_output(smollm2_dir):
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin of oil "
               "and a cloth folded into a neat square.")
    messages = [{"role": "user", "content": "Repeat this sentence exactly:\n\n" + passage}]
    params = [SamplingParams(temperature=0.0, max_tokens=32),
              SamplingParams(temperature=0.0, max_tokens=32, stop=["spiral"])]  # inside a copied run
    outputs = []
    for config in (None, spec_config("ngram", 5)):
        llm = LLM(smollm2_dir, kv_cache_memory="64MiB", speculative_config=config)
        outputs.append([o.outputs[0] for o in llm.chat([messages, messages], params, use_tqdm=False)])
    for without, with_drafts in zip(*outputs):
        assert (list(with_drafts.token_ids), with_drafts.text, with_drafts.finish_reason) == \
            (list(without.token_ids), without.text, without.finish_reason)
    assert passage[:40] in outputs[0][0].text  # it copies, so drafts from the prompt match
    assert outputs[0][1].finish_reason == "stop" and outputs[0][1].text.endswith("the ")
    assert num_accepted(llm) >= 10
