"""Images through the real server (`python -m actors.launch`) and the openai client: chat
messages with image_url data URLs, streaming and not, against Hugging Face's greedy tokens;
and http(s) URLs served by the test on 127.0.0.1; bad images, too many images, URLs that
fail, time out or are too large, answered with 400s naming the field, the server serving on.
(An image sent to a text-only model: tests/api/test_errors.py.)"""

from __future__ import annotations

import base64
import io

import openai
import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from tests.api.conftest import MODEL_NAME, ServerProcess, served
from tests.multimodal.image_server import image_server
from tests.multimodal.tiny_llava import data_url, draw_image, hf_greedy_llava

MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


SERVED_IMAGE = draw_image(52, 40, 11)  # what the local image server serves as /image.png


@pytest.fixture(scope="module")
def images_url():
    with image_server(SERVED_IMAGE) as url:
        yield url


@pytest.fixture(scope="module")
def llava_server(tiny_llava_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "1")  # /slow.png answers after 3 s
        process = ServerProcess(tiny_llava_dir, tmp_path_factory.mktemp("llava_server") / "server.log",
                                "--limit-mm-per-prompt", '{"image": 2}', "--log-level", "warning")
    yield from served(process)


@pytest.fixture(scope="module")
def client(llava_server):
    return openai.OpenAI(base_url=f"{llava_server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def image_message(*urls: str, text: str = "what is it?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def expected_tokens(model_dir: str, tokenizer, images: list, text: str = "what is it?") -> list[int]:
    rendered = "<|im_start|>user\n" + "\n".join(["<image>"] * len(images) + [text]) + \
        "<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    return hf_greedy_llava(model_dir, [(ids, images)], MAX_TOKENS)[0]


def test_data_urls_match_hf_streaming_and_not(client, tiny_llava_dir):
    from PIL import Image
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    png, jpeg = draw_image(48, 36, 1), draw_image(30, 60, 2)
    jpeg_url = data_url(jpeg, "JPEG")
    # JPEG is lossy: Hugging Face gets the image the server decodes
    decoded_jpeg = Image.open(io.BytesIO(base64.b64decode(jpeg_url.split(",", 1)[1]))).convert("RGB")
    for urls, images in (([data_url(png)], [png]), ([data_url(png), jpeg_url], [png, decoded_jpeg])):
        expected = tokenizer.decode(expected_tokens(tiny_llava_dir, tokenizer, images))
        reply = client.chat.completions.create(model=MODEL_NAME, messages=image_message(*urls), **GREEDY)
        assert reply.choices[0].message.content == expected
        stream = client.chat.completions.create(model=MODEL_NAME, messages=image_message(*urls), stream=True,
                                                **GREEDY)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected


def test_an_http_url_matches_hf_streaming_and_not(client, tiny_llava_dir, images_url):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    expected = tokenizer.decode(expected_tokens(tiny_llava_dir, tokenizer, [SERVED_IMAGE]))
    messages = image_message(f"{images_url}/image.png")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert reply.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected


@pytest.mark.parametrize("urls, field, message", [
    (["data:image/png;base64,AAAA"], "image_url", "could not be decoded"),
    (["data:image/png;base64,%%%"], "image_url", "could not be decoded"),
    (["data:text/plain;base64,aGVsbG8="], "image_url", "image type"),
    (["{images}/missing.png"], "image_url", "Not Found"),
    (["{images}/slow.png"], "image_url", "timed out"),
    (["{images}/big.png"], "image_url", "bytes allowed"),
    (["http://127.0.0.1:1/cat.png"], "image_url", "failed"),
    (["file:///etc/passwd"], "image_url", "--allowed-local-media-path"),
    ([data_url(draw_image(30, 30, 3))] * 3, "messages", "at most 2"),
    (["{images}/image.png"] * 3, "messages", "at most 2"),
])
def test_bad_images_are_400s_naming_the_field(client, images_url, urls, field, message):
    urls = [url.format(images=images_url) for url in urls]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=image_message(*urls), **GREEDY)
    assert message in str(error.value)
    assert error.value.body["param"] == field
    # the server serves on
    reply = client.chat.completions.create(model=MODEL_NAME, messages=image_message(data_url(draw_image(30, 30, 4))),
                                           **GREEDY)
    assert reply.choices[0].finish_reason == "length"
