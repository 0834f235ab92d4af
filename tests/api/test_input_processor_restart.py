"""An input processor's death costs only the requests it held (actors/frontend/input_routing.py): on a
real server, the input processor is killed while it holds one request; that request gets a
500 naming the cause, a request already past it (generating) finishes whole, the stored
/v1/responses survive, a new input processor serves the next requests, and the server
never exits. A worker's death stays fatal (tests/api/test_engine_death.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.api.conftest import AUTH, MODEL_NAME, ServerProcess, actor_name, child_pids, pid_alive


def input_processor_pid(server: ServerProcess) -> int:
    pids = [pid for pid in child_pids(server.popen.pid) if actor_name(pid) == "input_processor0" and pid_alive(pid)]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.fixture
def server(long_context_llama_dir, tmp_path):
    server = ServerProcess(long_context_llama_dir, tmp_path / "server.log", "--api-key",
                           AUTH["Authorization"].split()[1], "--max-model-len", "4096")
    yield server
    if server.popen.poll() is None:
        server.stop()


def test_a_dead_input_processor_fails_only_what_it_held_and_is_replaced(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as client:
        stored = client.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2})
        assert stored.status_code == 200, stored.text
        # a request past the input processor: generating when the processor dies
        long_body = {"model": MODEL_NAME, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        long_result: dict = {}

        def stream_long() -> None:
            with client.stream("POST", "/v1/completions", json=long_body) as response:
                chunks = [json.loads(line[6:]) for line in response.iter_lines()
                          if line.startswith("data: {")]
                long_result.update(status=response.status_code, chunks=chunks)

        streamer = threading.Thread(target=stream_long)
        streamer.start()
        time.sleep(1.0)  # its first tokens are out (it runs for seconds more)
        # one the processor holds when it dies: sent while the processor is stopped
        dead_pid = input_processor_pid(server)
        os.kill(dead_pid, signal.SIGSTOP)
        held: dict = {}
        sender = threading.Thread(target=lambda: held.update(response=client.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})))
        sender.start()
        time.sleep(0.5)  # delivered to the stopped processor's socket
        os.kill(dead_pid, signal.SIGKILL)
        assert streamer.is_alive(), "the long request was over before the input processor died"
        sender.join(30)
        response = held["response"]
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert "input processor input_processor0 exited with code -9" in error["message"], error
        assert error["type"] == "server_error"

        streamer.join(60)
        assert long_result["status"] == 200
        text_chunks = [chunk for chunk in long_result["chunks"] if chunk["choices"]]
        assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for chunk in text_chunks if chunk["choices"][0]["text"]) >= 1000  # it went on to its end

        after = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
        assert after.status_code == 200, after.text
        assert input_processor_pid(server) != dead_pid
        assert client.get(f"/v1/responses/{stored.json()['id']}").status_code == 200
        assert client.get("/health").status_code == 200
    assert server.popen.poll() is None
    assert "exited with code -9" in server.log()
