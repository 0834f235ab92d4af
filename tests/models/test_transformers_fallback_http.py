"""The Transformers fallback through the real server (`python -m actors.launch --model-impl
transformers`) and the openai client: prompts of different lengths sent together, in one
request and in concurrent ones, streamed and not, against Hugging Face's greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.api.conftest import MODEL_NAME, ServerProcess, served
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.models.test_transformers_fallback import build_fallback_model

MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory) -> str:
    return build_fallback_model(str(tmp_path_factory.mktemp("tiny-granite-http")), "granite")


@pytest.fixture(scope="module")
def client(granite_dir, tmp_path_factory):
    # 16 tokens a step: the prompts' prefills run in chunks beside other requests' decodes
    process = ServerProcess(granite_dir, tmp_path_factory.mktemp("fallback_server") / "server.log",
                            "--model-impl", "transformers", "--max-num-batched-tokens", "16", "--block-size", "4",
                            "--log-level", "warning")
    for server in served(process):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def test_batched_completions_match_hf_through_the_openai_client(client, granite_dir):
    prompts = make_prompts(380, [3, 11, 26, 41], seed=7)
    expected, _ = hf_greedy(granite_dir, prompts, MAX_TOKENS)
    # one request of several prompts: the engine runs them in the same steps
    reply = client.completions.create(model=MODEL_NAME, prompt=prompts, **GREEDY)
    got = {choice.index: choice for choice in reply.choices}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(granite_dir)
    texts = [tokenizer.decode(tokens) for tokens in expected]
    assert [got[i].text for i in range(len(prompts))] == texts
    assert reply.usage.completion_tokens == MAX_TOKENS * len(prompts)

    # concurrent streamed requests: each arrives while the others run
    def stream(prompt: list[int]) -> str:
        chunks = client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **GREEDY)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(stream, prompts)) == texts
