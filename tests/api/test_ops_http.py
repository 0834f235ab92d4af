"""vLLM's development-mode routes: absent by default; with VLLM_SERVER_DEV_MODE=1, /sleep,
/wake_up, /is_sleeping and /reset_prefix_cache, a request sent while asleep waits and
finishes after wake-up with the text it would have had."""

from __future__ import annotations

import contextlib
import threading

import httpx

from tests.api.conftest import API_KEY, AUTH, ServerProcess, served

COMPLETION = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_dev_mode_routes_are_absent_by_default(http):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/reset_prefix_cache")):
        assert http.request(method, path).status_code == 404


def test_sleep_wake_and_reset_over_http(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    process = ServerProcess(tiny_llama_dir, tmp_path / "server.log", "--log-level", "warning", "--api-key", API_KEY)
    with contextlib.contextmanager(served)(process) as server, \
            httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as http:
        # the routes that free the engine's memory or drop its cache need the API key too
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/reset_prefix_cache")):
            assert httpx.request(method, f"{server.url}{path}").status_code == 401
        expected = http.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
        assert http.post("/reset_prefix_cache").status_code == 200
        assert http.post("/sleep", params={"level": "3"}).json()["error"]["param"] == "level"
        assert http.post("/sleep", params={"level": "2"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        waiting: dict = {}
        sender = threading.Thread(target=lambda: waiting.update(http.post("/v1/completions", json=COMPLETION).json()))
        sender.start()
        sender.join(0.5)
        assert sender.is_alive()  # queued while the engine sleeps
        assert http.post("/wake_up", params={"tags": "nonsense"}).json()["error"]["param"] == "tags"
        assert http.post("/wake_up", params=[("tags", "weights")]).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up", params=[("tags", "kv_cache")]).status_code == 200
        sender.join(30)
        assert not sender.is_alive() and waiting["choices"][0]["text"] == expected
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
