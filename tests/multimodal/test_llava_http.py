"""Images through the real server (`python -m actors.launch`) and the openai client: chat
messages with image_url data URLs, streaming and not, against Hugging Face's greedy tokens;
and http(s) URLs served by the test on localhost (allowed with --allowed-media-domains
localhost and --allow-private-media-addresses); bad images, too many images or pixels,
formats a data URL does not name, URLs that fail, time out, are too large, name another
host or redirect where they may not, answered with 400s naming the field, the server
serving on. (An image sent to a text-only model: tests/api/test_errors.py; the defaults,
private addresses refused and decompression bombs: test_image_limits_http.py.)"""

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


MAX_IMAGE_PIXELS, MAX_TOTAL_IMAGE_PIXELS = 10_000, 12_000


@pytest.fixture(scope="module")
def images():
    with image_server(SERVED_IMAGE) as server:
        yield server


@pytest.fixture(scope="module")
def llava_server(tiny_llava_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "1")  # /slow.png answers after 3 s
        process = ServerProcess(tiny_llava_dir, tmp_path_factory.mktemp("llava_server") / "server.log",
                                "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "localhost",
                                "--allow-private-media-addresses", "--max-image-pixels", str(MAX_IMAGE_PIXELS),
                                "--max-total-image-pixels", str(MAX_TOTAL_IMAGE_PIXELS), "--log-level", "warning")
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


def test_an_http_url_matches_hf_streaming_and_not(client, tiny_llava_dir, images):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    expected = tokenizer.decode(expected_tokens(tiny_llava_dir, tokenizer, [SERVED_IMAGE]))
    messages = image_message(f"{images.localhost_url}/image.png")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert reply.choices[0].message.content == expected
    # a redirect to an allowed host is followed
    redirected = client.chat.completions.create(model=MODEL_NAME, messages=image_message(
        f"{images.localhost_url}/to-localhost"), **GREEDY)
    assert redirected.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected


FETCH_FAILED = "image_url: fetching the image failed"


def _jpeg_as_png_url() -> str:
    """A data URL that says PNG and holds a JPEG: decoded only as the format it names."""
    return data_url(draw_image(30, 30, 5), "JPEG").replace("image/jpeg", "image/png")


@pytest.mark.parametrize("urls, field, message", [
    (["data:image/png;base64,AAAA"], "image_url", "could not be decoded as PNG"),
    (["data:image/png;base64,%%%"], "image_url", "could not be decoded"),
    (["data:text/plain;base64,aGVsbG8="], "image_url", "image type"),
    ([_jpeg_as_png_url()], "image_url", "could not be decoded as PNG"),
    (["{images}/image.bmp"], "image_url", "could not be decoded as PNG, JPEG, WebP, GIF"),
    # whatever fails upstream is one answer, with nothing of the upstream's own
    (["{images}/missing.png"], "image_url", FETCH_FAILED),
    (["{images}/slow.png"], "image_url", FETCH_FAILED),
    (["http://localhost:1/cat.png"], "image_url", FETCH_FAILED),
    (["{images}/to-ip"], "image_url", FETCH_FAILED),  # a redirect to a host not allowed
    (["{images}/to-ftp"], "image_url", FETCH_FAILED),  # ... or to another scheme
    (["{images}/loop"], "image_url", FETCH_FAILED),
    (["{images}/big.png"], "image_url", "bytes allowed"),
    (["{ip}/image.png"], "image_url", "--allowed-media-domains"),
    (["ftp://localhost/cat.png"], "image_url", "'ftp' URLs are not read"),
    (["file:///etc/passwd"], "image_url", "--allowed-local-media-path"),
    ([data_url(draw_image(30, 30, 3))] * 3, "messages", "at most 2"),
    (["{images}/image.png"] * 3, "messages", "at most 2"),
    ([data_url(draw_image(125, 100, 6))], "image_url", "--max-image-pixels"),
    ([data_url(draw_image(80, 80, 7)), data_url(draw_image(80, 80, 8))], "image_url", "--max-total-image-pixels"),
])
def test_bad_images_are_400s_naming_the_field(client, images, urls, field, message):
    urls = [url.format(images=images.localhost_url, ip=images.url) for url in urls]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=image_message(*urls), **GREEDY)
    assert message in error.value.body["message"], error.value.body
    assert error.value.body["param"] == field
    assert " at 0x" not in error.value.body["message"] and "object at" not in error.value.body["message"]
    # the server serves on
    reply = client.chat.completions.create(model=MODEL_NAME, messages=image_message(data_url(draw_image(30, 30, 4))),
                                           **GREEDY)
    assert reply.choices[0].finish_reason == "length"


def test_a_redirect_where_it_may_not_go_is_never_followed(client, images):
    images.hits.clear()
    for path in ("/to-ip", "/to-ftp"):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL_NAME, messages=image_message(
                f"{images.localhost_url}{path}"), **GREEDY)
    assert images.hits == ["/to-ip", "/to-ftp"]  # the redirects' targets were never asked for
