"""Two "nodes" on loopback: two launcher processes, node 0 serving HTTP with rank 0, node 1
running rank 1 alone (gloo and ZeroMQ over tcp between them), give the tokens of one rank,
with the two ranks as tensor-parallel halves or as two pipeline stages (node 1's last stage
then sends the results to node 0's scheduler over tcp); stopping node 0 stops node 1 too."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from actors import LLM, SamplingParams
from messages.transport import free_tcp_port_range
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, make_prompts
from tests.api.conftest import AUTH, ENGINE_FLAGS, MODEL_NAME, REPO_ROOT, ServerProcess


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_launchers_on_loopback_serve_the_tokens_of_one_rank(tiny_llama_dir, tmp_path, split, monkeypatch):
    # the rendezvous, node 0's frontend inbox, a plan socket per rank, the scheduler's inbox (PP)
    port = free_tcp_port_range(5)
    monkeypatch.setenv("TROUPE_ENGINE_KEY", "a shared secret of the two nodes")  # (node 0 inherits it)
    flags = [split, "2", "--nnodes", "2", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "actors.launch", "--model", tiny_llama_dir, *ENGINE_FLAGS,
                              *flags, "--node-rank", "1"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    node0 = None
    try:
        node0 = ServerProcess(tiny_llama_dir, tmp_path / "node0.log", *flags, "--node-rank", "0",
                              "--api-key", AUTH["Authorization"].split()[1])
        assert node1.stdout.readline().startswith("Node 1 running ranks 1..1 of 2")
        llm = LLM(tiny_llama_dir, kv_cache_memory="32MiB")
        prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS, seed=43)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{node0.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
        texts = [choice["text"] for choice in choices]
        assert texts == [llm.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected]
        assert node0.stop() == 0
        assert node1.wait(30) == 0  # the engine's shutdown reached the other node
    finally:
        if node0 is not None and node0.popen.poll() is None:
            node0.kill()
        node1.kill()
        node1.wait(10)
        node1.stdout.close()
