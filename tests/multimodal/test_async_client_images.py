"""Images through AsyncClient.generate's prompt dicts (multi_modal_data with a PIL image or
a list, text or token-id prompts, data and http URLs), over real actor processes and ZeroMQ,
against Hugging Face's greedy tokens on the same tiny LLaVA; bad images raise typed errors
(InvalidRequestError naming the field) and the client serves on."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from actors import AsyncClient, InvalidRequestError, SamplingParams
from tests.multimodal.image_server import image_server
from tests.multimodal.tiny_llava import data_url, draw_image, hf_greedy_llava

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest_asyncio.fixture(scope="module")
async def client(tiny_llava_dir):
    async with asyncio.timeout(120):
        client = AsyncClient(tiny_llava_dir, kv_cache_memory="64MiB", limit_mm_per_prompt='{"image": 2}',
                             allow_private_media_addresses=True)  # the test's image server is on 127.0.0.1
        await client.start()
    yield client
    async with asyncio.timeout(30):
        await client.close()


async def generate(client, prompt) -> list[int]:
    async with asyncio.timeout(60):
        output = await client.generate(prompt, GREEDY)
    return output.outputs[0].token_ids


@pytest.mark.asyncio(loop_scope="module")
async def test_prompt_dicts_with_pil_images_match_hf(client, tiny_llava_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    one, two, rgba = draw_image(40, 30, 41), draw_image(28, 70, 42), draw_image(50, 50, 43).convert("RGBA")
    texts = ["Hello <image> what is in the picture?", "<image> and <image>: which one?", "Look <image> now"]
    prompts = [{"prompt": texts[0], "multi_modal_data": {"image": one}},
               {"prompt_token_ids": tokenizer.encode(texts[1]), "multi_modal_data": {"image": [one, two]}},
               {"prompt": texts[2], "multi_modal_data": {"image": [rgba]}},
               {"prompt": "The quick brown fox"}]
    ours = await asyncio.gather(*(generate(client, prompt) for prompt in prompts))  # batched together
    expected = hf_greedy_llava(tiny_llava_dir, [(tokenizer.encode(texts[0]), [one]),
                                                (tokenizer.encode(texts[1]), [one, two]),
                                                (tokenizer.encode(texts[2]), [rgba.convert("RGB")]),
                                                (tokenizer.encode("The quick brown fox"), [])], GREEDY.max_tokens)
    assert ours == expected


@pytest.mark.asyncio(loop_scope="module")
async def test_data_and_http_urls_answer_as_the_pil_image(client):
    image = draw_image(36, 52, 44)
    with image_server(image) as server:
        outputs = [await generate(client, {"prompt": "Hello <image> what?", "multi_modal_data": {"image": picture}})
                   for picture in (image, data_url(image), f"{server.url}/image.png")]
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("multi_modal_data, field, message", [
    ({"image": [draw_image(30, 30, 1)] * 3}, "multi_modal_data", "at most 2"),
    ({"image": [b"not an image"]}, "multi_modal_data", "could not be decoded"),
    ({"image": []}, "multi_modal_data", "1 image placeholders"),
    ({"image": ["http://127.0.0.1:1/cat.png"]}, "image_url", "fetching the image failed"),
    ({"image": ["file:///etc/hostname"]}, "multi_modal_data", "--allowed-local-media-path"),
])
async def test_bad_images_raise_invalid_request_errors(client, multi_modal_data, field, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        await generate(client, {"prompt": "Hello <image> what?", "multi_modal_data": multi_modal_data})
    assert error.value.param == field
    assert await generate(client, {"prompt": "Hello <image>", "multi_modal_data": {"image": draw_image(30, 30, 2)}})


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("multi_modal_data, message", [({"image": [42]}, "PIL image"),
                                                       ({"audio": b""}, "'image' key")])
async def test_images_of_the_wrong_kind_are_refused_at_the_call(client, multi_modal_data, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        client.generate({"prompt": "Hello <image>", "multi_modal_data": multi_modal_data}, GREEDY)
    assert error.value.param == "multi_modal_data"
