"""--mm-processor-cache-gb (vLLM's flag) sizes each input processor's cache of processed
images: 0 turns it off (a repeated image is processed again, with the same output), a size
bounds its bytes, a bad value is refused at start-up by name."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from actors import LLM, SamplingParams
from tests.multimodal.tiny_llava import draw_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("cache_gb, max_entries", [(0, 0), (3 * 9408 / 2**30, 3)])  # 9,408 B: a 28 px image
def test_the_processor_cache_takes_its_size_from_the_flag(tiny_llava_dir, cache_gb, max_entries):
    llm = LLM(tiny_llava_dir, kv_cache_memory="64MiB", mm_processor_cache_gb=cache_gb)
    cache = llm.inputs.images.cache
    ids = llm.get_tokenizer().encode("Hello <image> what?")

    def run(image):
        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
        return llm.generate(request, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    image = draw_image(40, 30, 51)
    assert run(image) == run(image.copy())
    assert cache.hits == (1 if max_entries else 0)
    for seed in range(5):
        run(draw_image(40, 30, 60 + seed))
    assert len(cache.entries) == max_entries and cache.num_bytes <= cache.max_bytes


@pytest.mark.parametrize("kwargs, name", [({"mm_processor_cache_gb": -1}, "mm_processor_cache_gb"),
                                          ({"max_num_encoder_input_tokens": 0}, "max_num_encoder_input_tokens")])
def test_bad_image_flags_are_refused_by_name(tiny_llava_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(tiny_llava_dir, **kwargs)
