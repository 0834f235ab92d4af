"""A vision server with the defaults, as an attacker finds it: image URLs to the server's
own network refused before anything connects (SSRF), one image per prompt (vLLM's default),
decompression bombs refused at their header with the input processor's peak memory
unmoved, the largest allowed images decoded within a stated memory bound, a NUL in a file
URL a 400. Every refusal a 400 naming the field, the server serving on."""

from __future__ import annotations

import base64
import concurrent.futures
import io
from pathlib import Path

import openai
import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from actors.config import DEFAULT_MAX_IMAGE_PIXELS
from tests.api.conftest import MODEL_NAME, ServerProcess, served
from tests.multimodal.image_server import image_server
from tests.multimodal.tiny_llava import data_url, draw_image

GREEDY = {"temperature": 0.0, "max_tokens": 2, "extra_body": {"ignore_eos": True}}
# The bound the docs state: 8 requests at once, each with a 4096 x 4096 image (the default
# --max-image-pixels), raise the input processor's peak resident memory by less than this
# (its work runs on one thread: one image decoded at a time, 48 MiB of RGB plus its copies)
MAX_PEAK_GROWTH = 400 * 2**20


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    draw_image(30, 30, 1).save(directory / "cat.png")
    return directory


@pytest.fixture(scope="module")
def default_server(tiny_llava_dir, tmp_path_factory, media_dir):
    process = ServerProcess(tiny_llava_dir, tmp_path_factory.mktemp("default_vision_server") / "server.log",
                            "--allowed-local-media-path", str(media_dir), "--log-level", "warning")
    yield from served(process)


@pytest.fixture(scope="module")
def client(default_server):
    with openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as client:
        yield client


def ask(client, *urls: str):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return client.chat.completions.create(model=MODEL_NAME, messages=[
        {"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}], **GREEDY)


def refusal(client, *urls: str) -> dict:
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, *urls)
    body = error.value.body
    assert " at 0x" not in body["message"] and "object at" not in body["message"], body
    return body


def peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "127.1.2.3", "0.0.0.0"])
def test_urls_into_the_servers_own_network_are_refused_unasked(client, host):
    with image_server(draw_image(30, 30, 2)) as images:
        body = refusal(client, f"http://{host}:{images.port}/image.png")
        assert body["param"] == "image_url" and "--allow-private-media-addresses" in body["message"]
        assert images.hits == []  # nothing connected


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png",
                                 "http://192.168.1.1/x.png", "http://[fd00::1]/x.png", "http://[::ffff:127.0.0.1]/x"])
def test_link_local_and_private_addresses_are_refused_before_any_connection(client, url):
    # refused from the address alone: no packet leaves for these
    assert "--allow-private-media-addresses" in refusal(client, url)["message"]


def test_one_image_per_prompt_by_default(client):
    image = data_url(draw_image(30, 30, 3))
    body = refusal(client, image, image)
    assert body["param"] == "messages" and "at most 1" in body["message"]
    assert ask(client, image).choices[0].finish_reason == "length"


def test_a_decompression_bomb_is_refused_at_its_header(client, default_server):
    """A 13000 x 13000 PNG of one bit a pixel is a few KB; decoded as RGB it would be 507 MB."""
    from PIL import Image

    bomb = png_data_url(Image.new("1", (13_000, 13_000)))
    assert len(bomb) < 100_000
    pid = default_server.actor_pids["input_processor0"]
    before = peak_rss(pid)
    for _ in range(3):
        body = refusal(client, bomb)
        assert body["param"] == "image_url" and "--max-image-pixels" in body["message"]
    assert peak_rss(pid) - before < 50 * 2**20
    assert ask(client, data_url(draw_image(30, 30, 4))).choices[0].finish_reason == "length"


def test_eight_requests_with_the_largest_images_stay_under_the_memory_bound(client, default_server):
    from PIL import Image

    side = int(DEFAULT_MAX_IMAGE_PIXELS ** 0.5)
    largest = [png_data_url(Image.new("RGB", (side, side), (i * 30, 90, 200))) for i in range(8)]
    pid = default_server.actor_pids["input_processor0"]
    before = peak_rss(pid)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda url: ask(client, url), largest))
    assert all(reply.choices[0].finish_reason == "length" for reply in replies)
    assert peak_rss(pid) - before < MAX_PEAK_GROWTH, (peak_rss(pid) - before) / 2**20
    # one pixel more is refused
    body = refusal(client, png_data_url(Image.new("RGB", (side + 1, side))))
    assert "--max-image-pixels" in body["message"]


@pytest.mark.parametrize("url", ["file:///tmp/a\x00b.png", "file:///tmp/a%00b.png", "file://%00/x.png"])
def test_a_nul_in_a_file_url_is_a_400(client, url):
    assert refusal(client, url)["param"] == "image_url"


def test_a_file_under_the_allowed_path_still_serves(client, media_dir):
    assert ask(client, f"file://{media_dir}/cat.png").choices[0].finish_reason == "length"
