"""The input processor's request options and checks, the sampler's allowed_token_ids and
bad words, cache_salt in the prefix cache, and LLM's vLLM call shapes (prompt dicts,
per-prompt priority, chat options)."""

from __future__ import annotations

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from actors import LLM, InvalidRequestError, SamplingParams
from actors.input_processor.processor import InputProcessor
from actors.layers.sampler import Sampler
from messages.input_processor import ChatOptions
from tests.conftest import build_tiny_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    tokenizer = build_tiny_tokenizer()
    # a tokenizer that adds BOS by itself, as Llama's do
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                                    special_tokens=[("<|endoftext|>", 0)])
    return InputProcessor(tokenizer, len(tokenizer), max_model_len=64)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory="16MiB", max_num_batched_tokens=256)


def test_add_special_tokens_for_text_prompts_and_chats(processor):
    plain = processor.tokenizer.encode("Hello world", add_special_tokens=False)
    assert processor.process("Hello world", SamplingParams())[1] == [0, *plain]
    assert processor.process("Hello world", SamplingParams(), add_special_tokens=False)[1] == plain
    messages = [{"role": "user", "content": "Hello"}]
    rendered = processor.process(None, SamplingParams(), messages=messages)[1]
    assert rendered[0] != 0  # the chat template's text, without the tokenizer's BOS
    assert processor.process(None, SamplingParams(), messages=messages, add_special_tokens=True)[1] == [0, *rendered]


def test_truncate_prompt_tokens_keeps_the_last_tokens(processor):
    prompt = list(range(10, 100))  # longer than max_model_len
    assert processor.process(prompt, SamplingParams(truncate_prompt_tokens=5))[1] == prompt[-5:]
    assert processor.process(prompt, SamplingParams(truncate_prompt_tokens=-1))[1] == prompt[-63:]
    with pytest.raises(InvalidRequestError, match="max_model_len") as raised:
        processor.process(prompt, SamplingParams())
    assert raised.value.param == "prompt"


def test_bad_words_become_token_sequences_with_and_without_a_space(processor):
    params = SamplingParams(bad_words=["dog", " quick brown"])
    processor.process([5, 6], params)
    encode = processor.tokenizer.encode
    expected = [encode("dog", add_special_tokens=False), encode(" dog", add_special_tokens=False),
                encode("quick brown", add_special_tokens=False), encode(" quick brown", add_special_tokens=False)]
    assert params.bad_words_token_ids == [ids for index, ids in enumerate(expected)
                                          if index % 2 == 0 or ids[-len(expected[index - 1]):] != expected[index - 1]]


@pytest.mark.parametrize("kwargs, param", [({"priority": 2}, "priority"), ({"cache_salt": ""}, "cache_salt")])
def test_request_options_are_checked(processor, kwargs, param):
    with pytest.raises(InvalidRequestError) as raised:
        processor.process([5, 6], SamplingParams(), **kwargs)
    assert raised.value.param == param


class _State:
    def __init__(self, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        self.params, self.token_ids, self.num_prompt_tokens = params, prompt + output, len(prompt)


def test_the_sampler_keeps_to_allowed_token_ids_and_off_bad_word_endings():
    sampler = Sampler(eos_token_ids=(0,), seed=0)
    logits = torch.zeros(3, 50)
    logits[:, 9] = 10.0  # the favourite everywhere
    allowed = _State(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]), [1, 2], [])
    logits[0, 4] = 1.0
    # the bad word [7, 9]: its ending 9 is banned only right after a 7 in the output
    after_seven = _State(SamplingParams(temperature=0.0, bad_words_token_ids=[[7, 9]]), [7], [5, 7])
    elsewhere = _State(SamplingParams(temperature=0.0, bad_words_token_ids=[[7, 9]]), [7], [5])
    tokens, _ = sampler(logits, [allowed, after_seven, elsewhere])
    assert tokens[0] == 4 and tokens[1] != 9 and tokens[2] == 9


def test_cache_salt_keeps_prefix_cache_entries_apart(llm):
    prompt = [(5 * i + 1) % 300 + 3 for i in range(40)]

    def cached(prompt_input) -> int:
        return llm.generate(prompt_input, GREEDY, use_tqdm=False)[0].num_cached_tokens

    llm.scheduler.block_pool.reset_prefix_cache()
    assert cached(prompt) == 0 and cached(prompt) == 32
    assert cached({"prompt_token_ids": prompt, "cache_salt": "a"}) == 0
    assert cached({"prompt_token_ids": prompt, "cache_salt": "a"}) == 32
    assert cached({"prompt_token_ids": prompt, "cache_salt": "b"}) == 0


def test_prompt_dicts_and_per_prompt_priority(llm):
    text = "Hello world"
    by_text = llm.generate(text, GREEDY, use_tqdm=False)[0]
    by_dict = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)[0]
    by_ids = llm.generate({"prompt_token_ids": by_text.prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert len(llm.generate([text, text], GREEDY, use_tqdm=False, priority=[0, 0])) == 2
    for bad, param in [({"prompt": text, "images": []}, "prompt"), ({"prompt": text, "prompt_token_ids": [1]}, "prompt")]:
        with pytest.raises(InvalidRequestError) as raised:
            llm.generate(bad, GREEDY, use_tqdm=False)
        assert raised.value.param == param
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.generate([text, text], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.generate([text, text], GREEDY, use_tqdm=False, priority=[0, 1])
    assert not llm.engine.has_unfinished()


def test_chat_options_offline(llm):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    continued = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False,
                         continue_final_message=True)[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello",
                                    add_special_tokens=False)
    assert continued.prompt_token_ids == expected
    templated = llm.chat(messages[:1], GREEDY, use_tqdm=False, chat_template="{{ x }}:{{ messages[0]['content'] }}",
                         chat_template_kwargs={"x": "Q"})[0]
    assert templated.prompt_token_ids == llm.tokenizer.encode("Q:Hi", add_special_tokens=False)
    options = ChatOptions(add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequestError):
        llm.inputs.render_chat(messages, options)
