"""Beam search against Hugging Face transformers' own beam search on the same fp32 weights:
the same beams in the same order, token for token, with EOS reached and early stops; the
beams' prompt blocks shared through the prefix cache; bad parameters refused; and the
async path through real actor processes equal to the offline one."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import LLM, BeamSearchParams, InvalidRequestError, SamplingParams
from messages.input_processor import ChatOptions
from tests.frontend.test_async_client import ENGINE_ARGS, client  # noqa: F401 - client is a fixture
from tests.models.test_llm_matches_hf import make_prompts

# With seed 1, these prompts reach EOS in some beams, and the 17-token one ends before
# max_tokens (every finished beam beats what the live ones can still reach).
PROMPT_LENGTHS, PROMPT_SEED = [5, 17, 33], 1


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_beams(model, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    """HF's beams for one prompt (no padding), best first: (output tokens up to and with the
    first EOS, HF's score)."""
    eos_token_ids = None if params.ignore_eos else model.generation_config.eos_token_id
    eos_set = set(eos_token_ids if isinstance(eos_token_ids, list) else [eos_token_ids] if eos_token_ids else [])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), num_beams=params.beam_width,
                             num_return_sequences=params.beam_width, do_sample=False,
                             length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                             max_new_tokens=params.max_tokens, eos_token_id=eos_token_ids,
                             pad_token_id=min(eos_set) if eos_set else 0,
                             output_scores=True, return_dict_in_generate=True)
    beams = []
    for tokens, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        ends = [i for i, token in enumerate(tokens) if token in eos_set]
        beams.append((tokens[:ends[0] + 1] if ends else tokens, score))
    return beams


def troupe_beams(output, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    beams = []
    for sequence in output.sequences:
        tokens = sequence.tokens[len(prompt):]
        beams.append((tokens, sequence.cum_logprob / len(tokens) ** params.length_penalty))
    return beams


def assert_same_beams(got: list[tuple[list[int], float]], expected: list[tuple[list[int], float]]) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, score), (_, hf_score) in zip(got, expected):
        assert score == pytest.approx(hf_score, abs=1e-3)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
@pytest.mark.parametrize("beam_width", [2, 4])
def test_beams_equal_hf_beams_token_for_token_in_order(llm, hf_model, beam_width, length_penalty):
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=PROMPT_SEED)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=10, length_penalty=length_penalty)
    outputs = llm.beam_search(prompts, params)  # all prompts searched together
    for prompt, output in zip(prompts, outputs):
        assert len(output.sequences) == beam_width
        assert_same_beams(troupe_beams(output, prompt, params), hf_beams(hf_model, prompt, params))


def test_eos_ends_beams_and_the_search_stops_early_as_hf(llm, hf_model):
    eos_token_ids = set(llm.config.model.eos_token_ids)
    prompt = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=PROMPT_SEED)[1]
    params = BeamSearchParams(beam_width=2, max_tokens=10)
    [output] = llm.beam_search([prompt], params)
    expected = hf_beams(hf_model, prompt, params)
    assert_same_beams(troupe_beams(output, prompt, params), expected)
    # every beam ended in EOS, and HF stopped before max_tokens: so did we
    assert max(len(tokens) for tokens, _ in expected) < params.max_tokens
    for sequence in output.sequences:
        assert sequence.tokens[-1] in eos_token_ids
        assert (sequence.finish_reason, sequence.stop_reason) == ("stop", sequence.tokens[-1])
        # the text leaves the EOS token's text out, unless include_stop_str_in_output
        assert sequence.text == llm.tokenizer.decode(sequence.tokens[:-1])
    [with_stop] = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=10,
                                                            include_stop_str_in_output=True))
    assert [s.text for s in with_stop.sequences] == [llm.tokenizer.decode(s.tokens) for s in output.sequences]


@pytest.mark.parametrize("early_stopping, length_penalty", [(True, 1.0), ("never", 2.0), (False, -1.0)])
def test_early_stopping_modes_equal_hf(llm, hf_model, early_stopping, length_penalty):
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=PROMPT_SEED)
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    for prompt, output in zip(prompts, llm.beam_search(prompts, params)):
        assert_same_beams(troupe_beams(output, prompt, params), hf_beams(hf_model, prompt, params))


def test_ignore_eos_runs_every_beam_to_max_tokens_as_hf_without_eos(llm, hf_model):
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=PROMPT_SEED)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    for prompt, output in zip(prompts, llm.beam_search(prompts, params)):
        assert_same_beams(troupe_beams(output, prompt, params), hf_beams(hf_model, prompt, params))
        assert all(s.finish_reason == "length" and len(s.tokens) == len(prompt) + 6 for s in output.sequences)


def test_prompt_forms_give_the_same_beams(llm):
    text = "The quick brown fox"
    token_ids = llm.tokenizer.encode(text)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    outputs = llm.beam_search([text, {"prompt": text}, {"prompt_token_ids": token_ids}, token_ids], params)
    assert len({str([s.tokens for s in output.sequences]) for output in outputs}) == 1
    assert outputs[0].sequences[0].tokens[:len(token_ids)] == token_ids
    [single] = llm.beam_search(text, params)  # one prompt, not in a list
    assert [s.tokens for s in single.sequences] == [s.tokens for s in outputs[0].sequences]


def test_beams_share_the_prompt_blocks_and_run_as_one_batch(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB", block_size=16, max_num_batched_tokens=512)
    prompt = make_prompts(llm.config.model.vocab_size, [200], seed=5)[0]
    num_prompt_blocks = -(-len(prompt) // 16)  # 13
    held, batch_sizes, max_ref_counts = [], [], []
    pool, launch = llm.scheduler.block_pool, llm.engine.runner.launch

    def watched_launch(plan, previous=None):  # between schedule() and update(): the step's blocks are held
        if plan.num_scheduled_tokens:  # (a model step; not a plan that only drops state)
            held.append(llm.scheduler.stats()["num_held_blocks"])
            batch_sizes.append(len(plan.num_scheduled_tokens))
            max_ref_counts.append(max(pool.ref_count(b) for b in range(pool.num_blocks)))
        return launch(plan, previous)

    llm.engine.runner.launch = watched_launch  # (every step is launched, with or without asynchronous steps)
    beam_width = 4
    llm.beam_search([prompt], BeamSearchParams(beam_width=beam_width, max_tokens=5, ignore_eos=True))
    # step 1 is the prompt alone; each later step runs its 4 beams in one model step
    assert batch_sizes == [1] + [beam_width] * 4
    # 4 beams of a 13-block prompt without sharing would hold 52 blocks; they hold the
    # prompt's 12 full blocks once, plus one block each for their own last tokens
    assert max(held) <= num_prompt_blocks + beam_width < beam_width * num_prompt_blocks
    assert max(max_ref_counts) == beam_width  # the shared blocks are referenced by every beam
    stats = llm.scheduler.stats()
    assert stats["num_prefix_hit_tokens"] >= 4 * beam_width * 12 * 16
    assert stats["num_held_blocks"] == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=21, max_tokens=4), "beam_width"),
    (dict(beam_width=2.5, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-0.5), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
])
def test_invalid_params_raise_invalid_request_error_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as error:
        BeamSearchParams(**kwargs)
    assert error.value.param == field and field in str(error.value)


def test_invalid_requests_raise_before_any_engine_request(llm):
    vocab = llm.config.model.vocab_size
    with pytest.raises(InvalidRequestError) as error:  # 19 beams + the model's 2 EOS ids > 20 logprobs
        llm.beam_search(["Hello"], BeamSearchParams(beam_width=19, max_tokens=2))
    assert error.value.param == "beam_width"
    with pytest.raises(InvalidRequestError) as error:
        llm.beam_search(["Hello", [vocab]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert error.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as error:
        llm.beam_search(["Hello"], SamplingParams(max_tokens=2))
    assert error.value.param == "params"
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_smollm2_beams_equal_hf_beams(smollm2_dir):
    llm = LLM(smollm2_dir, kv_cache_memory="256MiB")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [llm.tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):"]]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    for prompt, output in zip(prompts, llm.beam_search(prompts, params)):
        assert_same_beams(troupe_beams(output, prompt, params), hf_beams(model, prompt, params))


# ---- the async path, through real actor processes (test_async_client's client fixture) ----

async def test_async_beam_search_gives_the_offline_beams(client, llm):
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=PROMPT_SEED)
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    async with asyncio.timeout(120):
        results = await asyncio.gather(*[client.beam_search(p, params, request_id=f"beam-{i}")
                                         for i, p in enumerate(prompts)])
    for i, (prompt, result, expected) in enumerate(zip(prompts, results, llm.beam_search(prompts, params))):
        assert result.request_id == f"beam-{i}" and result.finished
        assert result.prompt_token_ids == prompt
        assert [c.index for c in result.outputs] == [0, 1, 2]
        for completion, sequence in zip(result.outputs, expected.sequences):
            assert completion.token_ids == sequence.tokens[len(prompt):]
            assert completion.cumulative_logprob == pytest.approx(sequence.cum_logprob, abs=1e-5)
            assert completion.finish_reason == sequence.finish_reason
            assert len(completion.logprobs) == len(completion.token_ids)


async def test_async_beam_search_of_text_and_chat(client, llm):
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    messages = [{"role": "user", "content": "Hello world!"}]
    async with asyncio.timeout(120):
        by_text = await client.beam_search({"prompt": "Once upon a time"}, params)
        by_chat = await client.beam_search_chat(messages, params)
    [expected_text] = llm.beam_search(["Once upon a time"], params)
    [expected_chat] = llm.beam_search([llm.inputs.render_chat(messages, ChatOptions())], params)
    assert by_text.prompt == "Once upon a time"
    for result, expected in ((by_text, expected_text), (by_chat, expected_chat)):
        num_prompt_tokens = len(result.prompt_token_ids)
        assert [c.token_ids for c in result.outputs] == [s.tokens[num_prompt_tokens:] for s in expected.sequences]
    with pytest.raises(InvalidRequestError):
        await client.beam_search("Hello", BeamSearchParams(beam_width=19, max_tokens=2))
    async with asyncio.timeout(5):  # every beam request has finished and released its blocks
        while (await client.get_stats())["num_held_blocks"]:
            await asyncio.sleep(0.05)
