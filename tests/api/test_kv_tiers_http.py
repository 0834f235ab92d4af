"""A server with a host KV tier (--kv-offload-size, --preemption-mode swap) and a KV pool
too small for its load: requests preempted by swapping answer what they answer alone, the
tiers' metrics say so, and a prompt larger than the whole pool is a 400 naming the limit."""

from __future__ import annotations

import contextlib
import random
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.api.conftest import AUTH, MODEL_NAME, ServerProcess, served, wait_until_idle
from tests.api.test_errors import assert_openai_error


def test_swapping_server_answers_as_alone_and_reports_the_tiers(tiny_llama_dir, tmp_path):
    process = ServerProcess(tiny_llama_dir, tmp_path / "server.log", "--log-level", "warning", "--block-size", "4",
                            "--num-kv-blocks", "24", "--max-num-batched-tokens", "32", "--kv-offload-size", "4MiB",
                            "--preemption-mode", "swap")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(20)] for _ in range(6)]

    def complete(client: httpx.Client, prompt: list[int]) -> list:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with contextlib.contextmanager(served)(process) as server:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120.0) as client:
            with ThreadPoolExecutor(len(prompts)) as pool:  # six requests of 13 blocks, 24 blocks in all
                together = list(pool.map(lambda prompt: complete(client, prompt), prompts))
            metrics = wait_until_idle(client, timeout=30.0)
            alone = [complete(client, prompt) for prompt in prompts]
            too_long = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5] * 100, "max_tokens": 1})
    assert together == alone
    assert metrics["vllm:num_preemptions_total"] > 0
    assert metrics["troupe_num_preemptions_swap_total"] == metrics["vllm:num_preemptions_total"]
    assert metrics["troupe_kv_blocks_swapped_in_total"] > 0
    assert metrics["vllm:num_requests_swapped"] == 0
    assert_openai_error(too_long, 400)
    assert "KV cache" in too_long.json()["error"]["message"] and "96 tokens" in too_long.json()["error"]["message"]
