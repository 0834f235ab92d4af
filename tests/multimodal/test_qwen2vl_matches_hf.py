"""A tiny random Qwen2-VL through the offline LLM against Hugging Face's generate on the same
weights, tokens and logprobs: one and two images per prompt in several sizes and aspect
ratios, batched with text-only prompts, chunked prefill splitting image spans, preemption,
prefix caching keyed by the image; M-RoPE's positions against Hugging Face's get_rope_index;
Qwen2.5-VL (window attention in its ViT) batched and chunked."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

import torch

from actors import LLM, SamplingParams
from actors.models.mrope import prompt_positions
from actors.models.qwen2_vl import Qwen2VLVisionEncoder
from tests.multimodal.tiny_llava import data_url, draw_image
from tests.multimodal.tiny_qwen2vl import IMAGE, hf_qwen2vl

MANY_IMAGES = '{"image": 4}'  # prompts of several images (the default is 1, as vLLM's)

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def run_both(llm: LLM, model_dir: str, prompts: list[tuple[str, list]]) -> None:
    """Our greedy tokens and logprobs of (text with images written as IMAGE, images) prompts
    equal Hugging Face's."""
    tokenizer = llm.get_tokenizer()
    token_prompts = [(tokenizer.encode(text), images) for text, images in prompts]
    requests = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images
                else {"prompt_token_ids": ids} for ids, images in token_prompts]
    outputs = llm.generate(requests, GREEDY, use_tqdm=False)
    expected = hf_qwen2vl(model_dir, token_prompts, MAX_TOKENS)
    for output, (tokens, logprobs) in zip(outputs, expected):
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=2e-4)


def mixed_prompts(seed: int) -> list[tuple[str, list]]:
    # (width, height): grids 2x4, 6x6, 2x8 (tall and thin), 10x14 patches
    images = [draw_image(w, h, seed + i) for i, (w, h) in enumerate([(60, 40), (90, 90), (30, 120), (200, 150)])]
    return [(f"Hello {IMAGE} what is in the picture?", [images[0]]),
            ("The quick brown fox jumps over the lazy dog.", []),
            (f"{IMAGE} and {IMAGE}: which one is brighter?", [images[1], images[2]]),
            (f"Paris is the capital of France. {IMAGE}", [images[3]]),
            ("Once upon a time there was a little robot", [])]


def test_images_batched_with_text_match_hf(tiny_qwen2vl_dir, monkeypatch):
    calls = count_encoder_calls(monkeypatch)
    llm = LLM(tiny_qwen2vl_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    run_both(llm, tiny_qwen2vl_dir, mixed_prompts(seed=0))
    # images of one size, started in one step: encoded in one batched pass
    run_both(llm, tiny_qwen2vl_dir, [(f"Look {IMAGE} here", [draw_image(90, 90, 40 + i)]) for i in range(3)])
    assert len(calls) == 4 + 3


def test_the_image_and_its_positions_change_the_output(tiny_qwen2vl_dir, monkeypatch):
    llm = LLM(tiny_qwen2vl_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    ids = llm.get_tokenizer().encode(f"Hello {IMAGE} what?")

    def tokens(image) -> list[int]:
        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
        return llm.generate(request, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    first = tokens(draw_image(90, 90, 1))
    assert first != tokens(draw_image(90, 90, 2))
    # plain 1D positions (no M-RoPE) give another output: the test above checks M-RoPE
    from actors.models.vision_runner import VisionRunner

    monkeypatch.setattr("actors.models.qwen2_vl.Qwen2VLRunner.step_inputs", VisionRunner.step_inputs)
    llm = LLM(tiny_qwen2vl_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB", enable_prefix_caching=False)
    assert tokens(draw_image(90, 90, 1)) != first


def count_encoder_calls(monkeypatch) -> list:
    calls = []
    real_encode = Qwen2VLVisionEncoder.encode_many
    monkeypatch.setattr(Qwen2VLVisionEncoder, "encode_many",
                        lambda self, images: calls.extend(grid for _, grid in images) or real_encode(self, images))
    return calls  # the grids of the images encoded (several in one call where a step starts several)


def assert_worker_state_dropped(llm: LLM) -> None:
    """No request's encoder features or positions stay at the worker (the last ones leave
    with the next step's finished ids)."""
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.runner.vision.cache and not llm.engine.runner.vision.positions.requests


def test_chunked_prefill_splitting_images_matches_hf_and_encodes_each_image_once(tiny_qwen2vl_dir, monkeypatch):
    # a 5-token budget splits the 9- and 35-token image spans over several steps
    calls = count_encoder_calls(monkeypatch)
    llm = LLM(tiny_qwen2vl_dir, limit_mm_per_prompt=MANY_IMAGES, max_num_batched_tokens=5, kv_cache_memory="64MiB")
    prompts = mixed_prompts(seed=5)
    run_both(llm, tiny_qwen2vl_dir, prompts)
    assert len(calls) == sum(len(images) for _, images in prompts)
    assert_worker_state_dropped(llm)


def test_preemption_recomputes_images_and_positions_and_matches_hf(tiny_qwen2vl_dir, monkeypatch):
    # 20 blocks of 4 tokens cannot hold the five requests as they decode: the newest are
    # preempted, and their images and M-RoPE positions computed again when they resume
    calls = count_encoder_calls(monkeypatch)
    llm = LLM(tiny_qwen2vl_dir, limit_mm_per_prompt=MANY_IMAGES,
              block_size=4, num_kv_blocks=20, enable_prefix_caching=False)
    # every prompt with an image, so that whichever is preempted has one
    prompts = [(text, images) if images else (f"{text} {IMAGE}", [draw_image(60, 40, 30)])
               for text, images in mixed_prompts(seed=6)]
    run_both(llm, tiny_qwen2vl_dir, prompts)
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert len(calls) > sum(len(images) for _, images in prompts)
    assert_worker_state_dropped(llm)


def test_prefix_cache_hits_the_same_image_only(tiny_qwen2vl_dir):
    llm = LLM(tiny_qwen2vl_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB", block_size=4)
    ids = llm.get_tokenizer().encode(f"Paris is the capital of France. Berlin is {IMAGE} Germany and more text")
    image_offset = ids.index(llm.config.model.vision.image_token_id)
    first, same, other = draw_image(90, 90, 7), draw_image(90, 90, 7), draw_image(90, 90, 8)

    def run(image):
        output = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY,
                              use_tqdm=False)[0]
        completion = output.outputs[0]
        return completion.token_ids, output.num_cached_tokens

    tokens_first, cached_first = run(first)
    tokens_same, cached_same = run(same)
    tokens_other, cached_other = run(other)
    assert cached_first == 0
    assert cached_same >= image_offset + 9  # the image's 9 tokens' blocks too
    assert 0 < cached_other <= image_offset  # only the blocks before the image
    expected = hf_qwen2vl(tiny_qwen2vl_dir, [(ids, [first]), (ids, [other])], MAX_TOKENS)
    assert [tokens_first, tokens_other] == [tokens for tokens, _ in expected]
    assert tokens_same == tokens_first


def test_chat_with_a_data_url_matches_hf(tiny_qwen2vl_dir):
    llm = LLM(tiny_qwen2vl_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB")
    image = draw_image(70, 50, 3)
    content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": data_url(image)}},
               {"type": "text", "text": "what is it?"}]
    chat = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    text = f"<|im_start|>user\nLook:\n{IMAGE}\nwhat is it?<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert chat.outputs[0].token_ids == hf_qwen2vl(tiny_qwen2vl_dir, [(ids, [image])], MAX_TOKENS)[0][0]


def test_positions_match_hf_get_rope_index():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    config = Qwen2VLConfig(vision_config={"spatial_merge_size": 2})
    # text, a 1x4x6 image (6 tokens), text, a 1x8x2 image (4 tokens), text
    token_types = [0] * 3 + [1] * 6 + [0] * 2 + [1] * 4 + [0] * 5
    grids = [(1, 4, 6), (1, 8, 2)]
    expected, delta = Qwen2VLModel.get_rope_index(
        type("Model", (), {"config": config, "get_vision_position_ids": Qwen2VLModel.get_vision_position_ids})(),
        torch.tensor([token_types]), torch.tensor([token_types]), image_grid_thw=torch.tensor(grids))
    ours, our_delta = prompt_positions(len(token_types), [(3, 6, grids[0]), (11, 4, grids[1])], merge=2)
    assert torch.equal(ours, expected[:, 0]) and our_delta == delta.item()


def test_unsupported_features_are_refused_at_start_up(tiny_qwen2vl_dir):
    with pytest.raises(ValueError, match="LoRA"):
        LLM(tiny_qwen2vl_dir, enable_lora=True)
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(tiny_qwen2vl_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_qwen2_5_vl_matches_hf_batched_and_chunked(tiny_qwen25vl_dir, monkeypatch):
    # its ViT: RMSNorm, gated MLP, windows of 2 x 2 merged patches (edge windows smaller:
    # the 10 x 14 grid) in block 0, full attention in block 1
    calls = count_encoder_calls(monkeypatch)
    run_both(LLM(tiny_qwen25vl_dir, limit_mm_per_prompt=MANY_IMAGES,
                 kv_cache_memory="64MiB"), tiny_qwen25vl_dir, mixed_prompts(seed=11))
    llm = LLM(tiny_qwen25vl_dir, limit_mm_per_prompt=MANY_IMAGES, max_num_batched_tokens=5, kv_cache_memory="64MiB")
    run_both(llm, tiny_qwen25vl_dir, mixed_prompts(seed=12))
    assert len(calls) == 2 * sum(len(images) for _, images in mixed_prompts(seed=0))
    assert_worker_state_dropped(llm)


def test_the_checkpoints_flat_config_layout_is_read():
    from actors.config.vision import split_vision_config

    # as Qwen/Qwen2-VL-2B-Instruct's config.json (abridged): text keys at the top, rope_scaling
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "hidden_size": 1536, "num_attention_heads": 12,
              "num_key_value_heads": 2, "rope_theta": 1000000.0, "image_token_id": 151655,
              "vision_start_token_id": 151652, "vision_end_token_id": 151653,
              "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
              "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                                "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2,
                                "temporal_patch_size": 2}}
    text, vision = split_vision_config(config, "config.json")
    assert text["architectures"] == ["Qwen2ForCausalLM"] and "rope_scaling" not in text
    assert text["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    q = vision.qwen2_vl
    assert (q.mrope_section, q.depth, q.embed_dim, q.in_channels, q.patch_features) == ((16, 24, 24), 32, 1280, 3, 1176)
    assert vision.image_token_id == 151655 and q.vision_end_token_id == 151653
    with pytest.raises(ValueError, match="mrope_section"):
        split_vision_config({**config, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24]}}, "config.json")
