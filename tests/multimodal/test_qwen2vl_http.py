"""A tiny Qwen2-VL through the real server (`python -m actors.launch`) and the openai client:
a chat with two data-URL images of different aspect ratios, streaming and not, against
Hugging Face's greedy tokens; a bad image is a 400 naming the field, and the server serves on."""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("PIL", reason="images need pillow (a dependency in pyproject.toml)")

from tests.api.conftest import MODEL_NAME, ServerProcess, served
from tests.multimodal.tiny_llava import data_url, draw_image
from tests.multimodal.tiny_qwen2vl import IMAGE, hf_qwen2vl

MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(tiny_qwen2vl_dir, tmp_path_factory):
    process = ServerProcess(tiny_qwen2vl_dir, tmp_path_factory.mktemp("qwen2vl_server") / "server.log",
                            "--limit-mm-per-prompt", '{"image": 2}', "--log-level", "warning")
    for server in served(process):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def test_two_images_match_hf_streaming_and_not_and_a_bad_one_is_a_400(client, tiny_qwen2vl_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2vl_dir)
    images = [draw_image(90, 60, 1), draw_image(40, 110, 2)]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}
                                             for image in images] + [{"type": "text", "text": "compare them"}]}]
    rendered = f"<|im_start|>user\n{IMAGE}\n{IMAGE}\ncompare them<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    expected = tokenizer.decode(hf_qwen2vl(tiny_qwen2vl_dir, [(ids, images)], MAX_TOKENS)[0][0])
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert reply.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=bad, **GREEDY)
    assert error.value.body["param"] == "image_url"
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert reply.choices[0].message.content == expected
