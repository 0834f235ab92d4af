"""Pooling models over HTTP, as vLLM serves them: /v1/embeddings through the real openai
client, /pooling, /classify, /score and /rerank, on two real servers of tiny random Qwen3
models, with sentence-transformers and Hugging Face as the oracles.

- an embedder saved by sentence-transformers (a bare Qwen3Model, last-token pooling,
  normalised), with a context of 192 tokens so that a long input is refused;
- a cross-encoder: a Qwen3ForSequenceClassification with one label, named in id2label."""

from __future__ import annotations

import array
import base64

import httpx
import openai
import pytest
import torch

from tests.api.conftest import AUTH, MODEL_NAME, ServerProcess, scrape_metrics, served
from tests.pooling.test_pooling_engine import save_embedder, sentence_transformers_embeddings

PROMPTS = ["The cat sat on the mat.", "hello", "A much longer sentence, about nothing in particular, goes on " * 3,
           "def add(a, b): return a + b"]
EMBEDDER_MAX_MODEL_LEN = 192  # room for PROMPTS, not for a long input
LABEL = "relevant"


def start_server(model_dir: str, log_dir, *flags: str):
    """A server of model_dir, stopped (and checked to leave no process) when the module ends."""
    yield from served(ServerProcess(model_dir, log_dir / "server.log", "--log-level", "warning", *flags))


@pytest.fixture(scope="module")
def embedder_dir(tiny_qwen3_dir, tmp_path_factory) -> str:
    return save_embedder(tiny_qwen3_dir, str(tmp_path_factory.mktemp("embedder")), "lasttoken", normalize=True)


@pytest.fixture(scope="module")
def embedder_server(embedder_dir, tmp_path_factory):
    yield from start_server(embedder_dir, tmp_path_factory.mktemp("embedder_server"),
                            "--max-model-len", str(EMBEDDER_MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def expected_embeddings(embedder_dir) -> torch.Tensor:
    return sentence_transformers_embeddings(embedder_dir, PROMPTS)


@pytest.fixture(scope="module")
def openai_client(embedder_server):
    with openai.OpenAI(base_url=f"{embedder_server.url}/v1", api_key="-", max_retries=0, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def http(embedder_server):
    with httpx.Client(base_url=embedder_server.url, timeout=60.0) as client:
        yield client


def assert_same_directions(actual, expected: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(actual), expected, dim=-1)
    assert cosine.min() >= 0.9999, cosine


def test_openai_embeddings_equal_sentence_transformers_as_floats_and_as_base64(openai_client, expected_embeddings):
    # the client's default asks for base64 and decodes it itself; "float" asks for a list
    for kwargs in ({}, {"encoding_format": "float"}):
        response = openai_client.embeddings.create(model=MODEL_NAME, input=PROMPTS, **kwargs)
        assert [item.index for item in response.data] == list(range(len(PROMPTS)))
        assert_same_directions([item.embedding for item in response.data], expected_embeddings)
        assert response.model == MODEL_NAME and response.usage.prompt_tokens == response.usage.total_tokens > 0
    # asked for explicitly, base64 comes back as sent: little-endian float32 bytes
    raw = openai_client.embeddings.create(model=MODEL_NAME, input=PROMPTS, encoding_format="base64")
    decoded = [array.array("f", base64.b64decode(item.embedding)).tolist() for item in raw.data]
    assert_same_directions(decoded, expected_embeddings)


def test_token_id_inputs_equal_the_model_run_by_hugging_face_in_input_order(openai_client, embedder_dir):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedder_dir)
    token_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS[:3]]
    model = AutoModel.from_pretrained(embedder_dir).eval()
    with torch.no_grad():  # the saved embedder pools the last token's state, then normalises
        last_rows = torch.stack([model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in token_ids])
    expected = torch.nn.functional.normalize(last_rows, dim=-1)
    batch = openai_client.embeddings.create(model=MODEL_NAME, input=token_ids[::-1])
    assert [item.index for item in batch.data] == [0, 1, 2]
    assert_same_directions([item.embedding for item in batch.data], expected.flip(0))
    one = openai_client.embeddings.create(model=MODEL_NAME, input=token_ids[0])
    assert_same_directions([one.data[0].embedding], expected[:1])
    assert one.usage.prompt_tokens == len(token_ids[0])


def test_pooling_route_returns_the_pooled_vectors(http, expected_embeddings):
    response = http.post("/pooling", json={"input": PROMPTS[:2]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert [item["object"] for item in body["data"]] == ["pooling", "pooling"]
    assert_same_directions([item["data"] for item in body["data"]], expected_embeddings[:2])


def test_score_and_rerank_use_the_cosine_of_embeddings(http, expected_embeddings):
    cosines = torch.nn.functional.cosine_similarity(expected_embeddings[:1], expected_embeddings[1:], dim=-1)
    for fields in ({"text_1": PROMPTS[0], "text_2": PROMPTS[1:]}, {"queries": PROMPTS[0], "documents": PROMPTS[1:]}):
        response = http.post("/score", json=fields)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["id"].startswith("score-") and [item["index"] for item in body["data"]] == [0, 1, 2]
        assert all(item["object"] == "score" for item in body["data"])
        torch.testing.assert_close(torch.tensor([item["score"] for item in body["data"]]), cosines,
                                   rtol=1e-4, atol=1e-4)
    ranked = sorted(range(3), key=lambda index: cosines[index].item(), reverse=True)
    response = http.post("/v1/rerank", json={"query": PROMPTS[0], "documents": PROMPTS[1:], "top_n": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    assert [result["index"] for result in body["results"]] == ranked[:2]
    assert [result["document"]["text"] for result in body["results"]] == [PROMPTS[1 + i] for i in ranked[:2]]
    bare = http.post("/rerank", json={"query": PROMPTS[0], "documents": PROMPTS[1:], "return_documents": False})
    assert [result["index"] for result in bare.json()["results"]] == ranked
    assert all("document" not in result for result in bare.json()["results"])


def test_bad_pooling_requests_get_a_400_naming_the_field(openai_client, http):
    for bad_input in ([], "", [[]]):
        response = http.post("/v1/embeddings", json={"input": bad_input})
        assert response.status_code == 400 and response.json()["error"]["param"] == "input", response.text
    too_long = "word " * 400
    response = http.post("/v1/embeddings", json={"input": too_long})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input", response.text
    truncated = http.post("/v1/embeddings", json={"input": too_long, "truncate_prompt_tokens": EMBEDDER_MAX_MODEL_LEN})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == EMBEDDER_MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as error:  # the model was not trained for Matryoshka sizes
        openai_client.embeddings.create(model=MODEL_NAME, input="hello", dimensions=8)
    assert error.value.param == "dimensions"
    for route, body, param in (
            ("/v1/embeddings", {"input": "hello", "encoding_format": "hex"}, "encoding_format"),
            ("/v1/embeddings", {"input": "hello", "priority": 1}, "priority"),
            ("/score", {"text_1": "a", "text_2": "b", "queries": "a"}, "queries"),
            ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
            ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n")):
        response = http.post(route, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_routes_this_model_cannot_serve_get_a_400_naming_the_route(openai_client, http):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4)
    assert "/v1/completions" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    assert "/v1/chat/completions" in error.value.message
    response = http.post("/classify", json={"input": "hello"})
    assert response.status_code == 400 and "/classify" in response.json()["error"]["message"]


def test_metrics_count_each_pooled_input_as_a_successful_request(http):
    before = scrape_metrics(http).get('vllm:request_success_total{finished_reason="stop"}', 0.0)
    assert http.post("/v1/embeddings", json={"input": PROMPTS}).status_code == 200
    after = scrape_metrics(http)['vllm:request_success_total{finished_reason="stop"}']
    assert after - before == len(PROMPTS)


# ---- a cross-encoder: a one-label classifier ----

@pytest.fixture(scope="module")
def cross_encoder(make_tiny_model, tmp_path_factory):
    """(its directory, the Hugging Face model, its tokenizer)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = make_tiny_model("qwen3", head_dim=32, rope_theta=1000000.0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, id2label={0: LABEL},
                                                               label2id={LABEL: 0}).eval()
    with torch.no_grad():  # a random head spreads the scores, so the order is clear
        model.score.weight.normal_(0.0, 0.5)
    model.config.pad_token_id = 0
    out_dir = str(tmp_path_factory.mktemp("cross_encoder"))
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.save_pretrained(out_dir)
    return out_dir, model, tokenizer


@pytest.fixture(scope="module")
def cross_encoder_server(cross_encoder, tmp_path_factory):
    yield from start_server(cross_encoder[0], tmp_path_factory.mktemp("cross_encoder_server"))


@pytest.fixture(scope="module")
def cross_encoder_http(cross_encoder_server):
    with httpx.Client(base_url=cross_encoder_server.url, timeout=60.0) as client:
        yield client


def hf_probability(model, token_ids: list[int]) -> float:
    with torch.no_grad():
        return torch.sigmoid(model(torch.tensor([token_ids])).logits[0, 0]).item()


def test_classify_equals_hugging_face_sigmoid_with_the_label_of_id2label(cross_encoder, cross_encoder_http):
    _, model, tokenizer = cross_encoder
    response = cross_encoder_http.post("/classify", json={"input": PROMPTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("classify-")
    expected = [hf_probability(model, tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
    torch.testing.assert_close(torch.tensor([item["probs"][0] for item in body["data"]]), torch.tensor(expected),
                               rtol=1e-4, atol=1e-5)
    assert {(item["label"], item["num_classes"]) for item in body["data"]} == {(LABEL, 1)}


def test_cross_encoder_scores_and_reranks_each_pair_as_one_input(cross_encoder, cross_encoder_http):
    _, model, tokenizer = cross_encoder
    expected = [hf_probability(model, tokenizer(PROMPTS[0], text_pair=document)["input_ids"])
                for document in PROMPTS[1:]]
    response = cross_encoder_http.post("/v1/score", json={"text_1": PROMPTS[0], "text_2": PROMPTS[1:]})
    assert response.status_code == 200, response.text
    torch.testing.assert_close(torch.tensor([item["score"] for item in response.json()["data"]]),
                               torch.tensor(expected), rtol=1e-4, atol=1e-5)
    reranked = cross_encoder_http.post("/v2/rerank", json={"query": PROMPTS[0], "documents": PROMPTS[1:],
                                                           "top_n": 1}).json()
    best = max(range(3), key=expected.__getitem__)
    assert [result["index"] for result in reranked["results"]] == [best]
    assert abs(reranked["results"][0]["relevance_score"] - expected[best]) < 1e-4


def test_a_classifier_refuses_embeddings_and_generation_naming_the_route(cross_encoder_http):
    for route, body in (("/v1/embeddings", {"input": "hello"}),
                        ("/v1/completions", {"prompt": "hello", "max_tokens": 4})):
        response = cross_encoder_http.post(route, json=body)
        assert response.status_code == 400 and route in response.json()["error"]["message"], response.text


@pytest.fixture(scope="module")
def generative_http(server):
    """The session's shared server (a tiny Llama that generates), with its API key."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as client:
        yield client


def test_a_generative_model_refuses_pooling_routes_naming_the_flag(generative_http):
    for route in ("/v1/embeddings", "/pooling", "/classify"):
        response = generative_http.post(route, json={"input": "hello"})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert route in message and "--runner pooling" in message
    response = generative_http.post("/score", json={"text_1": "a", "text_2": "b"})
    assert response.status_code == 400 and "/score" in response.json()["error"]["message"]
    invoked = generative_http.post("/invocations", json={"input": "hello"})
    assert invoked.status_code == 400 and invoked.json()["error"]["param"] == "input"


def test_invocations_dispatch_pooling_bodies_by_their_fields(http, cross_encoder_http):
    """SageMaker's /invocations answers as the route the body's fields ask for."""
    invoked, direct = (torch.tensor([d["embedding"] for d in http.post(route, json={"input": PROMPTS[:2]}).json()["data"]])
                       for route in ("/invocations", "/v1/embeddings"))
    torch.testing.assert_close(invoked, direct, rtol=1e-5, atol=1e-6)
    rerank = {"query": PROMPTS[0], "documents": PROMPTS[1:]}
    invoked, direct = (http.post(route, json=rerank).json()["results"] for route in ("/invocations", "/rerank"))
    assert [r["index"] for r in invoked] == [r["index"] for r in direct]
    # (scores within float rounding: the batch each text's embedding rode in may differ)
    assert [r["relevance_score"] for r in invoked] == pytest.approx([r["relevance_score"] for r in direct], rel=1e-5)
    score = {"text_1": PROMPTS[0], "text_2": PROMPTS[1:]}
    invoked, direct = (http.post(route, json=score).json()["data"] for route in ("/invocations", "/score"))
    assert [d["score"] for d in invoked] == pytest.approx([d["score"] for d in direct], rel=1e-5)
    invoked, direct = (cross_encoder_http.post(route, json={"input": PROMPTS[:2]}).json()["data"]
                       for route in ("/invocations", "/classify"))
    assert [d["label"] for d in invoked] == [d["label"] for d in direct]
    assert [d["probs"] for d in invoked] == [pytest.approx(d["probs"], rel=1e-5) for d in direct]
    assert http.post("/invocations", json={"documents": ["a"]}).status_code == 400
