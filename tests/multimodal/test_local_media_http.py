"""file:// image URLs through the real server and the openai client, under
--allowed-local-media-path: a file inside the directory answers as its data URL does; a path
outside it (by `..` or by a symlink), a missing file and a file that is no image are 400s
naming image_url, and the server serves on. (Unset, file URLs are refused: test_llava_http.py.)"""

from __future__ import annotations

import os

import openai
import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from tests.api.conftest import MODEL_NAME, ServerProcess, served
from tests.multimodal.test_llava_http import GREEDY, image_message
from tests.multimodal.tiny_llava import data_url, draw_image

IMAGE = draw_image(44, 38, 31)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    (allowed / "sub").mkdir(parents=True)
    IMAGE.save(allowed / "sub" / "cat.png")
    IMAGE.save(root / "outside.png")
    os.symlink(root / "outside.png", allowed / "link.png")  # inside by name, outside by target
    (allowed / "notes.png").write_text("not an image")
    return allowed


@pytest.fixture(scope="module")
def client(tiny_llava_dir, media_dir, tmp_path_factory):
    process = ServerProcess(tiny_llava_dir, tmp_path_factory.mktemp("media_server") / "server.log",
                            "--allowed-local-media-path", str(media_dir), "--log-level", "warning")
    for server in served(process):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def test_a_file_url_inside_the_directory_answers_as_its_data_url(client, media_dir):
    by_file = client.chat.completions.create(model=MODEL_NAME,
                                             messages=image_message(f"file://{media_dir}/sub/cat.png"), **GREEDY)
    by_data = client.chat.completions.create(model=MODEL_NAME, messages=image_message(data_url(IMAGE)), **GREEDY)
    assert by_file.choices[0].message.content == by_data.choices[0].message.content
    assert by_file.usage.prompt_tokens == by_data.usage.prompt_tokens
    dotted = client.chat.completions.create(  # `..` that stays inside is fine
        model=MODEL_NAME, messages=image_message(f"file://{media_dir}/sub/../sub/cat.png"), **GREEDY)
    assert dotted.choices[0].message.content == by_data.choices[0].message.content


@pytest.mark.parametrize("path, message", [
    ("{dir}/../outside.png", "outside the allowed local media path"),
    ("{dir}/link.png", "outside the allowed local media path"),
    ("/etc/hostname", "outside the allowed local media path"),
    ("{dir}/missing.png", "could not be read"),
    ("{dir}/sub", "could not be read"),
    ("{dir}/notes.png", "could not be decoded"),
])
def test_bad_file_urls_are_400s_naming_image_url(client, media_dir, path, message):
    url = "file://" + path.format(dir=media_dir)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=image_message(url), **GREEDY)
    assert message in str(error.value)
    assert error.value.body["param"] == "image_url"
    reply = client.chat.completions.create(model=MODEL_NAME, messages=image_message(data_url(draw_image(30, 30, 4))),
                                           **GREEDY)
    assert reply.choices[0].finish_reason == "length"


def test_a_file_url_in_a_prompt_dict_offline(tiny_llava_dir, media_dir):
    from actors import LLM, SamplingParams
    from messages.common import InvalidRequestError

    llm = LLM(tiny_llava_dir, kv_cache_memory="64MiB", allowed_local_media_path=str(media_dir))
    ids = llm.get_tokenizer().encode("Hello <image> what?")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = [llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, params,
                            use_tqdm=False)[0].outputs[0].token_ids
               for image in (f"file://{media_dir}/sub/cat.png", IMAGE)]
    assert outputs[0] == outputs[1]
    with pytest.raises(InvalidRequestError, match="outside") as error:
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": f"file://{media_dir}/link.png"}},
                     params, use_tqdm=False)
    assert error.value.param == "multi_modal_data"
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        LLM(tiny_llava_dir, allowed_local_media_path=str(media_dir / "sub" / "cat.png"))


@pytest.mark.parametrize("body, field", [
    ({"prompt": "Hello <image>", "extra_body": {"multi_modal_data": {"image": "data:image/png;base64,AAAA"}}},
     "multi_modal_data"),
    ({"prompt": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, "prompt"),
    ({"prompt": {"prompt": "Hello <image>", "multi_modal_data": {"image": "x"}}}, "prompt"),
])
def test_completions_refuse_images_by_name(client, body, field):
    # vLLM takes images through chat messages and offline prompt dicts only
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, max_tokens=2, **body)
    assert error.value.body["param"].startswith(field)  # (prompt[0]: the part that is not text)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=image_message(data_url(IMAGE)), **GREEDY)
    assert chat.choices[0].finish_reason == "length"
