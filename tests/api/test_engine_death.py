"""The app over an engine whose actor died, in-process (the launcher would exit at once,
so there is no window to ask it): /health turns 503, generation requests get 503 in the
OpenAI shape and never reach the engine, and the server's own routes still answer."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest_asyncio

from actors import AsyncClient
from api import ServerSettings, build_app

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest_asyncio.fixture(scope="module")
async def app_and_client(tiny_llama_dir):
    client = AsyncClient(tiny_llama_dir, kv_cache_memory="32MiB")
    async with asyncio.timeout(120):
        await client.start()
    try:
        yield build_app(client, ServerSettings(served_model_names=["tiny"])), client
    finally:
        async with asyncio.timeout(30):
            await client.close()


async def test_a_dead_engine_makes_health_and_generation_503(app_and_client):
    app, client = app_and_client
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30.0) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200

        os.kill(client.actor_pids()["scheduler"], signal.SIGKILL)
        async with asyncio.timeout(10):
            await client.wait_until_dead()

        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert (await http.get("/ping")).status_code == 503 and (await http.post("/ping")).status_code == 503
        for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x"}),
                            ("/invocations", CHAT)):
            response = await http.post(route, json=body)
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "server_error"
            assert response.json()["error"]["code"] == "engine_dead"
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200 and 'troupe_http_requests_total{route="/health",status="503"} 1.0' in \
            metrics.text
        assert "vllm:num_requests_running" not in metrics.text  # no stale engine gauges
        assert (await http.get("/v1/models")).status_code == 200
