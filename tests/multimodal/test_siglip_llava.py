"""LLaVA with a SigLIP vision tower through the offline LLM against Hugging Face's generate
on the same weights: greedy tokens and logprobs, one and two images per prompt batched with
text, chunked prefill splitting an image span, both feature strategies."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from actors import LLM, SamplingParams
from actors.models.siglip import SiglipVisionEncoder
from tests.multimodal.tiny_llava import draw_image
from tests.multimodal.tiny_siglip_llava import build_tiny_siglip_llava, hf_greedy_with_logprobs

MANY_IMAGES = '{"image": 4}'  # prompts of several images (the default is 1, as vLLM's)

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def siglip_dirs(tmp_path_factory) -> dict[str, str]:
    return {strategy: build_tiny_siglip_llava(str(tmp_path_factory.mktemp(f"siglip-{strategy}")), strategy,
                                              feature_layer=-1 if strategy == "full" else -2)
            for strategy in ("full", "default")}


def prompts(seed: int) -> list[tuple[str, list]]:
    images = [draw_image(w, h, seed + i) for i, (w, h) in enumerate([(40, 30), (28, 70), (64, 64)])]
    return [("Hello <image> what is in the picture?", [images[0]]),
            ("The quick brown fox jumps over the lazy dog.", []),
            ("<image> and <image>: which one is brighter?", [images[1], images[2]])]


@pytest.mark.parametrize("strategy, num_image_tokens, batched_tokens", [("full", 9, None), ("default", 8, None),
                                                                        ("full", 9, 5)])
def test_siglip_llava_matches_hf_tokens_and_logprobs(siglip_dirs, strategy, num_image_tokens, batched_tokens):
    model_dir = siglip_dirs[strategy]
    with open(f"{model_dir}/preprocessor_config.json") as f:
        assert json.load(f)["image_processor_type"] == "SiglipImageProcessor"
    kwargs = {"max_num_batched_tokens": batched_tokens} if batched_tokens else {}  # 5: images span two steps
    llm = LLM(model_dir, limit_mm_per_prompt=MANY_IMAGES, kv_cache_memory="64MiB", **kwargs)
    assert isinstance(llm.engine.runner.vision.encoder, SiglipVisionEncoder)
    tokenizer = llm.get_tokenizer()
    token_prompts = [(tokenizer.encode(text), images) for text, images in prompts(seed=len(strategy))]
    requests = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images
                else {"prompt_token_ids": ids} for ids, images in token_prompts]
    outputs = llm.generate(requests, PARAMS, use_tqdm=False)
    expected_tokens, expected_logprobs = hf_greedy_with_logprobs(model_dir, token_prompts, PARAMS.max_tokens,
                                                                 num_image_tokens)
    image_token_id = llm.config.model.vision.image_token_id
    for output, (ids, images), tokens, steps in zip(outputs, token_prompts, expected_tokens, expected_logprobs):
        assert output.prompt_token_ids.count(image_token_id) == num_image_tokens * len(images)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for token, position, hf_logprobs in zip(tokens, completion.logprobs, steps):
            assert position[token].rank == 1
            for token_id, logprob in position.items():
                assert abs(logprob.logprob - float(hf_logprobs[token_id])) < 1e-3


def test_an_unknown_vision_tower_is_refused_by_name(siglip_dirs, tmp_path):
    import shutil

    model_dir = shutil.copytree(siglip_dirs["full"], tmp_path / "other")
    config = json.loads((model_dir / "config.json").read_text())
    config["vision_config"]["model_type"] = "dinov2"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vision tower 'dinov2' is not supported"):
        LLM(str(model_dir))


def test_an_image_processor_of_another_size_is_refused_at_start_up(siglip_dirs, tmp_path):
    import shutil

    model_dir = shutil.copytree(siglip_dirs["full"], tmp_path / "resized")
    processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    processor["size"] = {"height": 56, "width": 56}  # the tower's position embeddings cover 42 x 42
    (model_dir / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ValueError, match="makes 56x56 images, the vision tower takes 42x42"):
        LLM(str(model_dir))
