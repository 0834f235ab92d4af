"""The app over two data-parallel replicas, in-process: /health lists each replica's
state and stays 200 while one serves; requests go on being answered by the live one; 503
once both are dead."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx

from actors import AsyncClient
from api import ServerSettings, build_app

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


async def test_health_and_serving_with_one_replica_dead(tiny_llama_dir):
    client = AsyncClient(tiny_llama_dir, kv_cache_memory="32MiB", data_parallel_size=2)
    async with asyncio.timeout(120):
        await client.start()
    try:
        transport = httpx.ASGITransport(app=build_app(client, ServerSettings(served_model_names=["tiny"])))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30.0) as http:
            health = await http.get("/health")
            assert health.status_code == 200 and health.json() == {"replicas": ["ok", "ok"]}

            os.kill(client.engine.replicas[0].actor_pids()["scheduler"], signal.SIGKILL)
            async with asyncio.timeout(10):
                await client.engine.replicas[0].wait_until_dead()
            health = await http.get("/health")
            assert health.status_code == 200
            first, second = health.json()["replicas"]
            assert first.startswith("dead: actor scheduler exited") and second == "ok"
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200

            os.kill(client.engine.replicas[1].actor_pids()["scheduler"], signal.SIGKILL)
            async with asyncio.timeout(10):
                await client.wait_until_dead()
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 503
    finally:
        async with asyncio.timeout(30):
            await client.close()
