"""A server started with --scheduling-policy priority takes each request's `priority`
(vLLM's extra field) on completions, chat and pooling-free routes alike; the greedy text
does not depend on it."""

from __future__ import annotations

import contextlib

import openai

from tests.api.conftest import ServerProcess, served


def test_priority_server_takes_priorities_and_answers_the_same_text(tiny_llama_dir, tmp_path):
    process = ServerProcess(tiny_llama_dir, tmp_path / "server.log", "--log-level", "warning",
                            "--scheduling-policy", "priority", "--max-num-seqs", "2")
    with contextlib.contextmanager(served)(process) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=60.0) as client:
            model = client.models.list().data[0].id
            texts = [client.completions.create(model=model, prompt="the cat", max_tokens=8, temperature=0.0,
                                               extra_body={"priority": priority}).choices[0].text
                     for priority in (0, -3, 7)]
            chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, extra_body={"priority": 2})
    assert texts[0] == texts[1] == texts[2] and chat.choices[0].finish_reason in ("length", "stop")
