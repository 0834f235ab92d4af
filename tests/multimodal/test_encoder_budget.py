"""The encoder budget (--max-num-encoder-input-tokens) through the offline LLM on a tiny
LLaVA (4 image tokens per image): many image requests at once, every step's vision encoding
observed at the worker within the budget, outputs equal to the run without a budget; an
image larger than the budget runs alone; a prefix-cache hit ending inside an image's span
charges the image again (the worker encodes it again)."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from actors import LLM, SamplingParams
from actors.models.vision_runner import VisionRunner
from tests.multimodal.tiny_llava import NUM_IMAGE_TOKENS, draw_image, hf_greedy_llava

MANY_IMAGES = '{"image": 4}'  # prompts of several images (the default is 1, as vLLM's)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def observe_encoding(monkeypatch) -> list[int]:
    """Image tokens the worker encodes, per step that has any image rows."""
    per_step: list[int] = []
    real_input_embeds, real_features = VisionRunner.input_embeds, VisionRunner._features

    def features(self, request_id, index, mm, done):
        if index not in self.cache.get(request_id, {}):
            per_step[-1] += mm.length  # not cached: encoded now
        return real_features(self, request_id, index, mm, done)

    def input_embeds(self, embed, input_ids, batch):
        per_step.append(0)
        return real_input_embeds(self, embed, input_ids, batch)

    monkeypatch.setattr(VisionRunner, "_features", features)
    monkeypatch.setattr(VisionRunner, "input_embeds", input_embeds)
    return per_step


def image_requests(llm: LLM, count: int) -> list[dict]:
    tokenizer = llm.get_tokenizer()
    requests = []
    for i in range(count):
        num_images = 1 + i % 3
        text = " ".join(["<image>"] * num_images) + f" picture {i}: what is in it?"
        images = [draw_image(30 + 7 * j, 40 + 5 * i, 1000 + 10 * i + j) for j in range(num_images)]
        requests.append({"prompt_token_ids": tokenizer.encode(text), "multi_modal_data": {"image": images}})
    return requests


def run(llm: LLM, requests: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("budget", [8, 3])  # 3 < one image's 4 tokens: each image runs alone
def test_many_images_at_once_stay_within_the_budget_and_match_the_unbudgeted_run(tiny_llava_dir, monkeypatch,
                                                                                 budget):
    unbudgeted = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES,
                     kv_cache_memory="64MiB", enable_prefix_caching=False)
    requests = image_requests(unbudgeted, 12)
    total = sum(len(r["multi_modal_data"]["image"]) for r in requests) * NUM_IMAGE_TOKENS
    per_step = observe_encoding(monkeypatch)
    expected = run(unbudgeted, requests)
    assert max(per_step) == total  # without a budget the first step encodes every image

    per_step.clear()
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB", enable_prefix_caching=False,
              max_num_encoder_input_tokens=budget)
    assert run(llm, requests) == expected
    assert sum(per_step) == total  # each image encoded once
    assert max(per_step) == max(budget, NUM_IMAGE_TOKENS)  # never more than the budget, or one image alone
    encoder_budget = llm.scheduler.encoder_budget
    assert encoder_budget.num_chunks_cut > 0
    started = [tokens for _, tokens in encoder_budget.recent_steps if tokens]
    assert sum(started) == total and max(started) <= max(budget, NUM_IMAGE_TOKENS)
    assert not llm.engine.runner.vision.cache


def test_a_prefix_hit_inside_an_image_span_charges_the_image_again(tiny_llava_dir, monkeypatch):
    llm = LLM(tiny_llava_dir, limit_mm_per_prompt=MANY_IMAGES,
              kv_cache_memory="64MiB", block_size=4, max_num_encoder_input_tokens=4)
    ids = llm.get_tokenizer().encode("A B C <image>")  # the image last: a hit leaves its last token to compute
    image_offset = ids.index(llm.config.model.vision.image_token_id)
    request = {"prompt_token_ids": ids, "multi_modal_data": {"image": draw_image(40, 40, 5)}}
    per_step = observe_encoding(monkeypatch)
    first = llm.generate(request, GREEDY, use_tqdm=False)[0]
    second = llm.generate(request, GREEDY, use_tqdm=False)[0]
    assert image_offset < second.num_cached_tokens < image_offset + NUM_IMAGE_TOKENS  # the hit ends in the span
    assert sum(per_step) == 2 * NUM_IMAGE_TOKENS  # the worker encoded it again for the rest of its span
    assert [tokens for _, tokens in llm.scheduler.encoder_budget.recent_steps if tokens] == [NUM_IMAGE_TOKENS] * 2
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == hf_greedy_llava(
        tiny_llava_dir, [(ids, [request["multi_modal_data"]["image"]])], GREEDY.max_tokens)[0]
