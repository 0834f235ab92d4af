"""Offline LLM behaviour: prefix caching, seeded sampling, n > 1, stop conditions, and
bad input that must not disturb the engine."""

from __future__ import annotations

import pytest

from actors import LLM, SamplingParams
from tests.models.test_llm_matches_hf import make_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory="64MiB", max_num_batched_tokens=256)


def test_shared_prefix_is_computed_once_and_outputs_stay_identical(llm):
    vocab = llm.config.model.vocab_size
    prefix = make_prompts(vocab, [96], seed=10)[0]
    prompts = [prefix + tail for tail in make_prompts(vocab, [5, 9, 13, 3], seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.scheduler.stats()["num_computed_prefill_tokens"]
    first = llm.generate(prompts, params, use_tqdm=False)
    middle = llm.scheduler.stats()["num_computed_prefill_tokens"]
    second = llm.generate(prompts, params, use_tqdm=False)
    after = llm.scheduler.stats()["num_computed_prefill_tokens"]
    assert after - middle < middle - before
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(o.num_cached_tokens >= 96 for o in second)


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm):
    vocab = llm.config.model.vocab_size
    target = make_prompts(vocab, [20], seed=12)[0]
    others = make_prompts(vocab, [7, 30, 11], seed=13)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.2, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([others[0], target, others[1], others[2]],
                         [unseeded, seeded, unseeded, unseeded], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_gives_n_distinct_completions(llm):
    prompt = make_prompts(llm.config.model.vocab_size, [40], seed=14)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert llm.scheduler.stats()["num_free_blocks"] == llm.scheduler.stats()["num_total_blocks"]


def test_stop_token_id_and_length_finish_reasons(llm):
    prompt = make_prompts(llm.config.model.vocab_size, [12], seed=15)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_token = free.token_ids[3]
    first_hit = free.token_ids.index(stop_token)
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                    stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token
    assert stopped.token_ids == free.token_ids[: first_hit + 1]


def test_stop_string_ends_generation_and_is_cut_from_text(llm):
    prompt = make_prompts(llm.config.model.vocab_size, [12], seed=16)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), "the tiny model should produce some text"
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    kept = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize("field, value", [("max_tokens", -1), ("temperature", -0.5), ("top_p", 0.0),
                                          ("top_p", 1.5), ("n", 0), ("min_p", 2.0), ("logprobs", -1),
                                          ("prompt_logprobs", -1), ("logit_bias", {5: 100.5}),
                                          ("logit_bias", {-1: 1.0}), ("seed", 2**63), ("seed", -(2**63) - 1),
                                          ("allowed_token_ids", []), ("bad_words", [" "]),
                                          ("truncate_prompt_tokens", 0)])
def test_bad_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_prompts_raise_and_the_engine_keeps_serving(llm):
    vocab = llm.config.model.vocab_size
    good = make_prompts(vocab, [10], seed=17)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
    too_long = [5] * llm.config.scheduler.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([good, too_long], params, use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[vocab + 5]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], params, use_tqdm=False)
    # every field the worker reads is checked against the model before anything runs
    for field, params_with_bad_field in [
            ("logit_bias", SamplingParams(max_tokens=4, logit_bias={vocab: 5.0})),
            ("allowed_token_ids", SamplingParams(max_tokens=4, allowed_token_ids=[1, vocab])),
            ("stop_token_ids", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab + 1])),
            ("logprobs", SamplingParams(max_tokens=4, logprobs=21)),  # over the default max_logprobs
            ("prompt_logprobs", SamplingParams(max_tokens=4, prompt_logprobs=21)),
            ("truncate_prompt_tokens", SamplingParams(max_tokens=4, truncate_prompt_tokens=10**6))]:
        with pytest.raises(ValueError, match=field) as raised:
            llm.generate([good], params_with_bad_field, use_tqdm=False)
        assert raised.value.param == field
    assert llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert not llm.engine.has_unfinished()


def test_generation_stops_at_max_model_len(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB", max_model_len=24)
    prompt = make_prompts(llm.config.model.vocab_size, [20], seed=18)[0]
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 4 and output.finish_reason == "length"


def test_chat_applies_the_template(llm):
    outputs = llm.chat([[{"role": "user", "content": "hello"}], [{"role": "user", "content": "bye"}]],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outputs) == 2
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                                 add_generation_prompt=True, tokenize=False)
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)


def test_logit_bias_forces_and_bans_tokens_per_request(llm):
    vocab = llm.config.model.vocab_size
    prompts = make_prompts(vocab, [12, 20], seed=23)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    free = [o.outputs[0] for o in llm.generate(prompts, plain, use_tqdm=False)]
    forced_token = next(t for t in range(3, vocab) if t not in free[0].token_ids)
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1,
                            logit_bias={forced_token: 100.0})
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={free[1].token_ids[0]: -100.0})
    outputs = [o.outputs[0] for o in llm.generate(prompts, [forced, banned], use_tqdm=False)]
    assert outputs[0].token_ids == [forced_token] * 6
    # logprobs stay the model's own: the forced token is not its top choice
    assert outputs[0].logprobs[0][forced_token].rank > 1
    assert outputs[1].token_ids[0] != free[1].token_ids[0]
    # sampling too: +100 dwarfs every other logit
    sampled = SamplingParams(temperature=1.0, seed=4, max_tokens=5, ignore_eos=True, logit_bias={forced_token: 100.0})
    assert llm.generate(prompts[:1], sampled, use_tqdm=False)[0].outputs[0].token_ids == [forced_token] * 5
