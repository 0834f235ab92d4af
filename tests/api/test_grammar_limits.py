"""A request's grammar costs only that request (docs/security.md): on the default model
(SmolLM2, a 49k vocabulary), a JSON schema of 2,000 random property names takes seconds
to compile; while it compiles, plain requests run as fast as alone (the grammar compiles
before its request is scheduled, on threads of the lowest priority); past
--grammar-compile-timeout the slow request is refused with a 400 naming the limit, and a
schema past --max-grammar-bytes is refused before anything compiles."""

from __future__ import annotations

import random
import statistics
import string
import threading
import time

import httpx
import pytest

from tests.api.conftest import AUTH, MODEL_NAME, ServerProcess

COMPILE_TIMEOUT_S = 8.0


def random_schema(num_properties: int, seed: int) -> dict:
    rng = random.Random(seed)
    names = {"".join(rng.choices(string.ascii_letters, k=12)) for _ in range(num_properties)}
    return {"type": "object", "properties": {name: {"type": "string"} for name in names}}


def plain_latency(client: httpx.Client) -> float:
    start = time.perf_counter()
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "The capital of France is",
                                                    "max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return time.perf_counter() - start


def latencies_beside_slow_grammar(client: httpx.Client, seed: int) -> tuple[list[float], httpx.Response, float]:
    """Plain requests' latencies while a slow grammar's request compiles (until it is
    answered), that request's response and its time."""
    slow: dict = {}

    def send_slow() -> None:
        started = time.perf_counter()
        slow["response"] = client.post("/v1/completions", json=structured(random_schema(2000, seed)))
        slow["seconds"] = time.perf_counter() - started

    sender = threading.Thread(target=send_slow)
    sender.start()
    time.sleep(0.5)  # its compile has started
    beside = []
    while sender.is_alive():
        beside.append(plain_latency(client))
    sender.join(COMPILE_TIMEOUT_S + 60)
    return beside, slow["response"], slow["seconds"]


def structured(schema: dict) -> dict:
    return {"model": MODEL_NAME, "prompt": "A record:", "max_tokens": 8, "temperature": 0.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}}


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir, tmp_path_factory):
    server = ServerProcess(smollm2_dir, tmp_path_factory.mktemp("grammar") / "server.log", "--api-key",
                           AUTH["Authorization"].split()[1], "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S),
                           "--max-grammar-bytes", "100000")
    yield server
    server.stop()


def test_a_slow_grammar_delays_only_its_own_request(smollm2_server):
    with httpx.Client(base_url=smollm2_server.url, headers=AUTH, timeout=120.0) as client:
        plain_latency(client)  # warm, and the grammar backend loaded (the tokenizer's index: once per worker)
        assert client.post("/v1/completions", json=structured(random_schema(3, seed=0))).status_code == 200
        # Up to two rounds, each with a schema of its own: a machine shared with other work
        # can stretch one round's plain requests by chance (a step that waited for the compile
        # stretched them by its whole ~16 s, every round).
        rounds = []
        for seed in (1, 2):
            alone = [plain_latency(client) for _ in range(10)]
            beside, response, seconds = latencies_beside_slow_grammar(client, seed)
            # refused once past the limit (it takes ~16 s alone): a 400 naming the limit, in about that time
            assert response.status_code == 400 and "--grammar-compile-timeout" in response.json()["error"]["message"]
            assert COMPILE_TIMEOUT_S <= seconds < COMPILE_TIMEOUT_S + 5
            assert len(beside) >= 10, "the plain requests were not timed while the grammar compiled"
            rounds.append((statistics.median(beside) - statistics.median(alone), sorted(alone), sorted(beside)))
            if rounds[-1][0] <= 0.1:
                return
        raise AssertionError(f"plain requests took longer while a grammar compiled: (delay, alone, beside) {rounds}")


def test_a_schema_past_the_byte_limit_is_refused_naming_the_field(smollm2_server):
    with httpx.Client(base_url=smollm2_server.url, headers=AUTH, timeout=60.0) as client:
        started = time.perf_counter()
        # ~132 KB as compact JSON, over this server's 100,000 bytes
        response = client.post("/v1/completions", json=structured(random_schema(4000, seed=2)))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "--max-grammar-bytes" in error["message"] and error["param"], error
        assert time.perf_counter() - started < 2.0  # refused before anything compiled
        small = client.post("/v1/completions", json=structured(random_schema(3, seed=3)))
        assert small.status_code == 200, small.text
