"""A tiny random LLaVA through the offline LLM against Hugging Face's generate on the same
weights: one and two images per prompt, images of several sizes and aspect ratios, batched
with text-only prompts, chunked prefill splitting an image's placeholders, preemption, and
prefix caching keyed by the image."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from actors import LLM, SamplingParams
from actors.models.llava import LlavaVisionEncoder
from messages.common import InvalidRequestError
from tests.multimodal.tiny_llava import NUM_IMAGE_TOKENS, data_url, draw_image, hf_greedy_llava

MANY_IMAGES = '{"image": 4}'  # prompts of several images (the default is 1, as vLLM's)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run_both(llm: LLM, model_dir: str, prompts: list[tuple[str, list]]) -> tuple[list, list]:
    """(ours, Hugging Face's) greedy tokens of (text with <image> placeholders, images) prompts."""
    tokenizer = llm.get_tokenizer()
    token_prompts = [(tokenizer.encode(text), images) for text, images in prompts]
    requests = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images
                else {"prompt_token_ids": ids} for ids, images in token_prompts]
    outputs = llm.generate(requests, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], hf_greedy_llava(model_dir, token_prompts, GREEDY.max_tokens)


def mixed_prompts(seed: int) -> list[tuple[str, list]]:
    images = [draw_image(w, h, seed + i) for i, (w, h) in enumerate([(40, 30), (28, 56), (64, 64), (90, 33)])]
    return [("Hello <image> what is in the picture?", [images[0]]),
            ("The quick brown fox jumps over the lazy dog.", []),
            ("<image> and <image>: which one is brighter?", [images[1], images[2]]),
            ("Paris is the capital of France. <image>", [images[3]]),
            ("Once upon a time there was a little robot", [])]


def test_images_batched_with_text_match_hf(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    ours, expected = run_both(llm, tiny_llava_dir, mixed_prompts(seed=0))
    assert ours == expected


def test_an_image_changes_the_output(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    ours, _ = run_both(llm, tiny_llava_dir, [("Hello <image> what?", [draw_image(40, 40, 1)]),
                                              ("Hello <image> what?", [draw_image(40, 40, 2)])])
    assert ours[0] != ours[1]


def count_encoder_calls(monkeypatch) -> list:
    calls = []
    real_call = LlavaVisionEncoder.__call__
    monkeypatch.setattr(LlavaVisionEncoder, "__call__", lambda self, pixels: calls.append(1) or real_call(self, pixels))
    return calls


def test_chunked_prefill_splitting_images_matches_hf_and_encodes_each_image_once(tiny_llava_dir, monkeypatch):
    # a 3-token budget splits every image's 4 placeholders over two steps
    calls = count_encoder_calls(monkeypatch)
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, max_num_batched_tokens=3, kv_cache_memory="64MiB")
    prompts = mixed_prompts(seed=5)
    ours, expected = run_both(llm, tiny_llava_dir, prompts)
    assert ours == expected
    assert len(calls) == sum(len(images) for _, images in prompts)
    assert not llm.engine.runner.vision.cache  # every request's encoder cache is gone


def test_preemption_recomputes_images_and_matches_hf(tiny_llava_dir, monkeypatch):
    # 14 blocks of 4 tokens cannot hold the five requests as they decode: the newest are
    # preempted, and their images encoded again when they resume
    calls = count_encoder_calls(monkeypatch)
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES,
              block_size=4, num_kv_blocks=14, enable_prefix_caching=False)
    prompts = mixed_prompts(seed=6)
    ours, expected = run_both(llm, tiny_llava_dir, prompts)
    assert ours == expected
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert len(calls) > sum(len(images) for _, images in prompts)
    assert not llm.engine.runner.vision.cache


def test_prefix_cache_hits_the_same_image_only(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB", block_size=4)
    tokenizer = llm.get_tokenizer()
    text = "Paris is the capital of France. Berlin is the capital of <image> Germany and more text here"
    ids = tokenizer.encode(text)
    image_offset = ids.index(llm.config.model.vision.image_token_id)
    first, same, other = draw_image(40, 30, 7), draw_image(40, 30, 7), draw_image(40, 30, 8)

    def run(image):
        output = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY,
                              use_tqdm=False)[0]
        return output.outputs[0].token_ids, output.num_cached_tokens

    tokens_first, cached_first = run(first)
    tokens_same, cached_same = run(same)
    tokens_other, cached_other = run(other)
    assert cached_first == 0
    assert cached_same >= image_offset + NUM_IMAGE_TOKENS  # the image's blocks too
    assert cached_other <= image_offset  # only the blocks before the image
    assert cached_other > 0
    expected = hf_greedy_llava(tiny_llava_dir, [(ids, [first]), (ids, [other])], GREEDY.max_tokens)
    assert [tokens_first, tokens_other] == expected
    assert tokens_same == tokens_first


def test_chat_with_a_data_url_matches_a_prompt_dict(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    image = draw_image(50, 40, 3)
    content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": data_url(image)}},
               {"type": "text", "text": "what is it?"}]
    chat = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    # the same conversation with the placeholder written out, and the image beside it
    text = "<|im_start|>user\nLook:\n<image>\nwhat is it?<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    expected = hf_greedy_llava(tiny_llava_dir, [(ids, [image])], GREEDY.max_tokens)
    assert chat.outputs[0].token_ids == expected[0]


@pytest.mark.parametrize("request_kwargs, field, message", [
    ({"multi_modal_data": {"image": [42]}}, "multi_modal_data", "PIL image or a data or http"),
    ({"multi_modal_data": {"image": ["data:image/png;base64,AAAA"]}}, "multi_modal_data", "could not be decoded"),
    ({"multi_modal_data": {"image": ["file:///etc/hostname"]}}, "multi_modal_data",
     "--allowed-local-media-path"),
    ({"multi_modal_data": {"audio": [b""]}}, "multi_modal_data", "'image' key"),
    ({"multi_modal_data": {"image": []}}, "multi_modal_data", "1 image placeholders .* for 0 images"),
])
def test_bad_images_are_refused_by_name(tiny_llava_dir, request_kwargs, field, message):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    ids = llm.get_tokenizer().encode("Hello <image> what?")
    with pytest.raises(InvalidRequestError, match=message) as error:
        llm.generate({"prompt_token_ids": ids, **request_kwargs}, GREEDY, use_tqdm=False)
    assert error.value.param == field


def test_limit_mm_per_prompt(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, kv_cache_memory="64MiB", limit_mm_per_prompt='{"image": 1}')
    ids = llm.get_tokenizer().encode("<image> <image>")
    image = draw_image(30, 30, 1)
    with pytest.raises(InvalidRequestError, match="at most 1") as error:
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image, image]}}, GREEDY, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(tiny_llava_dir, limit_mm_per_prompt='{"video": 1}')


def test_images_to_a_text_only_model_are_refused(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory="64MiB")
    with pytest.raises(InvalidRequestError, match="text-only") as error:
        llm.generate({"prompt": "Hello", "multi_modal_data": {"image": [draw_image(30, 30, 1)]}}, GREEDY,
                     use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    content = [{"type": "image_url", "image_url": {"url": data_url(draw_image(30, 30, 1))}}]
    with pytest.raises(InvalidRequestError, match="text-only"):
        llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("engine_kwargs, name", [({"enable_lora": True}, "LoRA"),
                                                 ({"speculative_config": {"method": "ngram",
                                                                          "num_speculative_tokens": 2}},
                                                  "speculative decoding")])
def test_unsupported_features_are_refused_at_start_up(tiny_llava_dir, engine_kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, **engine_kwargs)


# as llava-hf's templates: a loop over each message's content parts, the template writing <image>
PARTS_TEMPLATE = ("{% for message in messages %}{{ message['role'] | upper }}: "
                  "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
                  "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def test_a_template_looping_over_content_parts_gets_them(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    image = draw_image(44, 36, 9)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "what is it?"}]},
                {"role": "assistant", "content": "a cat"}, {"role": "user", "content": "sure?"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)[0]
    text = "USER: <image>\nwhat is it?ASSISTANT: a catUSER: sure?ASSISTANT:"  # (jinja trims the block ends)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert chat.prompt_token_ids == [t for t in ids for t in ([t] * NUM_IMAGE_TOKENS
                                                              if t == llm.config.model.vision.image_token_id else [t])]
    assert chat.outputs[0].token_ids == hf_greedy_llava(tiny_llava_dir, [(ids, [image])], GREEDY.max_tokens)[0]


def test_an_http_image_url_offline_matches_its_data_url(tiny_llava_dir):
    from tests.multimodal.image_server import image_server

    # the test's image server is on 127.0.0.1: a private address, fetched only when allowed
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES,
              kv_cache_memory="64MiB", allow_private_media_addresses=True)
    image = draw_image(36, 52, 12)
    with image_server(image) as server:
        replies = [llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                          {"type": "text", "text": "what?"}]}], GREEDY,
                            use_tqdm=False)[0] for image_url in (f"{server.url}/image.png", data_url(image))]
        with pytest.raises(InvalidRequestError, match="fetching the image failed") as error:
            llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": f"{server.url}/gone.png"}}]}],
                     GREEDY, use_tqdm=False)
        assert error.value.param == "image_url"
    assert replies[0].outputs[0].token_ids == replies[1].outputs[0].token_ids


def test_n_completions_share_the_image_prompt(tiny_llava_dir):
    # the n sequences share the prompt's blocks; a 5-token budget chunks the image span too
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES,
              kv_cache_memory="64MiB", max_num_batched_tokens=5, block_size=4)
    ids = llm.get_tokenizer().encode("Hello there <image> what is it, tell me?")
    image = draw_image(40, 40, 3)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    expected = hf_greedy_llava(tiny_llava_dir, [(ids, [image])], 6)[0]
    assert [c.token_ids for c in output.outputs] == [expected, expected]


def test_a_repeated_image_is_processed_once_and_the_processor_cache_is_bounded(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    cache = llm.inputs.images.cache
    ids = llm.get_tokenizer().encode("Hello <image> what?")
    image = draw_image(40, 30, 21)

    def run(picture):
        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}
        return llm.generate(request, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    assert run(image) == run(image.copy())  # an equal image, another object
    assert cache.hits == 1 and len(cache.entries) == 1
    entry_bytes = cache.num_bytes
    cache.max_bytes = 3 * entry_bytes
    for seed in range(6):
        run(draw_image(40, 30, 100 + seed))
    assert len(cache.entries) == 3 and cache.num_bytes == 3 * entry_bytes
    assert cache.hits == 1
