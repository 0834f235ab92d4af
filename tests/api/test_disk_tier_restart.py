"""The disk KV tier across a real server restart (the issue's setup, scaled to a tiny model):
a 160-block device pool, a host tier of 90 blocks and --kv-offload-dir; a 2,000-token prefix
(125 blocks, more than the host tier holds) computed, then evicted by two other long prompts;
the server stopped with SIGTERM and started again with the same flags. Asked the prefix
again, the new server loads what the host tier holds of it from the files (the external
prefix-cache hits counter moves by that much) and answers as the first did."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.api.conftest import AUTH, MODEL_NAME, ServerProcess, scrape_metrics, wait_until_idle

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K and V of the tiny Llama's 2 layers, 2 KV heads of 16, fp32, 16 tokens
HOST_BLOCKS = 90


def start(model_dir: str, log_path, kv_dir) -> ServerProcess:
    return ServerProcess(model_dir, log_path, "--api-key", AUTH["Authorization"].split()[1], "--max-model-len", "4096",
                         "--block-size", "16", "--num-kv-blocks", "160", "--max-num-seqs", "4",
                         "--kv-offload-dir", str(kv_dir), "--kv-offload-size", str(HOST_BLOCKS * BLOCK_BYTES))


def complete(client: httpx.Client, prompt: list[int]) -> dict:
    response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0.0, "ignore_eos": True, "logprobs": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_restarted_server_loads_a_prefix_larger_than_its_host_tier_from_disk(long_context_llama_dir, tmp_path):
    rng = random.Random(5)
    prefix = [rng.randrange(3, 380) for _ in range(2000)]
    evictors = [[rng.randrange(3, 380) for _ in range(2020)] for _ in range(2)]
    kv_dir = tmp_path / "kv"
    first = start(long_context_llama_dir, tmp_path / "first.log", kv_dir)
    try:
        with httpx.Client(base_url=first.url, headers=AUTH, timeout=120.0) as client:
            before = complete(client, prefix)
            for prompt in evictors:
                complete(client, prompt)
            wait_until_idle(client, timeout=30.0)
    finally:
        assert first.stop() == 0
    assert len(list(kv_dir.glob("*.kv"))) >= 3 * 125  # every full block of the three prompts has its file

    second = start(long_context_llama_dir, tmp_path / "second.log", kv_dir)
    try:
        with httpx.Client(base_url=second.url, headers=AUTH, timeout=120.0) as client:
            hits_before = scrape_metrics(client).get("vllm:external_prefix_cache_hits_total", 0.0)
            again = complete(client, prefix)
            hits = scrape_metrics(client)["vllm:external_prefix_cache_hits_total"] - hits_before
    finally:
        assert second.stop() == 0
    # the host tier's worth of leading blocks came from disk (the rest was computed)
    assert hits >= (HOST_BLOCKS - 1) * 16, hits
    assert again["choices"][0]["text"] == before["choices"][0]["text"]
    # (the prompt's chunks start elsewhere than the first server's, so the sums do)
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        before["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
