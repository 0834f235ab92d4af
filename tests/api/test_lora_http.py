"""LoRA adapters over the HTTP API, as vLLM serves them: an adapter is a model (its name in
the `model` field), given at start by --lora-modules or loaded at runtime through
/v1/load_lora_adapter; PEFT's greedy tokens on the same adapter are the oracle.

One server (module scope) serves two adapters from the start and allows runtime updating;
the last tests start servers of their own (no runtime updating; a bad adapter at launch)."""

from __future__ import annotations

import json
import os
import threading

import httpx
import openai
import pytest

from actors.config import runtime_lora_updating_allowed
from api.server import parse_args
from api.server_flags import openai_server_settings, parse_lora_module
from api.lora_models import LoRAModulePath
from tests.api.conftest import MODEL_NAME, ServerProcess, served
from tests.lora_adapters import build_lora_adapter, peft_greedy

PROMPT = [5, 6, 7, 8, 9]
MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True}
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
              "--log-level", "warning"]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_http")
    return {"sql": build_lora_adapter(tiny_llama_dir, str(root / "sql"), rank=8, seed=0),
            "chatty": build_lora_adapter(tiny_llama_dir, str(root / "chatty"), rank=16, seed=1,
                                         target_modules=["q_proj", "v_proj", "down_proj"]),
            "runtime": build_lora_adapter(tiny_llama_dir, str(root / "runtime"), rank=4, seed=2),
            "rank32": build_lora_adapter(tiny_llama_dir, str(root / "rank32"), rank=32, seed=3)}


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir, adapter_dirs, tmp_path_factory):
    """sql (name=path) and chatty (JSON, with base_model_name) from the start; runtime
    updating allowed by vLLM's environment variable."""
    chatty = json.dumps({"name": "chatty", "path": adapter_dirs["chatty"], "base_model_name": MODEL_NAME})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        process = ServerProcess(tiny_llama_dir, tmp_path_factory.mktemp("lora_server") / "server.log", *LORA_FLAGS,
                                "--lora-modules", f"sql={adapter_dirs['sql']}", chatty)
    yield from served(process)


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def completion_tokens(http: httpx.Client, model: str) -> list[int]:
    response = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, **GREEDY})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["token_ids"]


def test_an_adapter_model_generates_peft_greedy_tokens(http, tiny_llama_dir, adapter_dirs):
    base = completion_tokens(http, MODEL_NAME)
    assert base == peft_greedy(tiny_llama_dir, None, [PROMPT], MAX_TOKENS)[0]
    for name in ("sql", "chatty"):
        tokens = completion_tokens(http, name)
        assert tokens == peft_greedy(tiny_llama_dir, adapter_dirs[name], [PROMPT], MAX_TOKENS)[0]
        assert tokens != base  # the adapter is applied, not skipped


def test_chat_with_an_adapter_model(client, tiny_llama_dir, adapter_dirs):
    messages = [{"role": "user", "content": "Hi there"}]
    reply = client.chat.completions.create(model="chatty", messages=messages, temperature=0.0, max_tokens=6,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    assert reply.model == "chatty"
    expected = peft_greedy(tiny_llama_dir, adapter_dirs["chatty"], [reply.prompt_token_ids], 6)[0]
    assert reply.choices[0].token_ids == expected
    # streamed, the same adapter gives the same text
    chunks = list(client.chat.completions.create(model="chatty", messages=messages, temperature=0.0, max_tokens=6,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert {chunk.model for chunk in chunks} == {"chatty"}
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) \
        == reply.choices[0].message.content


def test_responses_tokenize_and_beam_search_take_adapter_models(client, http):
    assert client.responses.create(model="sql", input="Hi", max_output_tokens=3).model == "sql"
    tokenized = http.post("/tokenize", json={"model": "sql", "prompt": "Hi there"})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"]
    beams = {}
    for model in (MODEL_NAME, "sql"):
        response = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4, "n": 2,
                                                      "use_beam_search": True})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        beams[model] = [choice["text"] for choice in response.json()["choices"]]
    assert beams["sql"] != beams[MODEL_NAME]


def test_models_lists_the_base_then_the_adapters(client, tiny_llama_dir, adapter_dirs):
    cards = client.models.list().data
    assert [card.id for card in cards] == [MODEL_NAME, "sql", "chatty"]
    # root is the served name: the server's directories are no client's business
    assert cards[0].parent is None and cards[0].root == MODEL_NAME
    assert [(card.root, card.parent) for card in cards[1:]] == [("sql", MODEL_NAME), ("chatty", MODEL_NAME)]
    card = client.models.retrieve("chatty")
    assert (card.id, card.root, card.parent) == ("chatty", "chatty", MODEL_NAME)


def test_an_unknown_model_gets_vllms_404(http, client):
    for route, body in [("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2}),
                        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                        ("/tokenize", {"model": "nope", "prompt": "x"})]:
        response = http.post(route, json=body)
        assert response.status_code == 404, response.text
        assert response.json() == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                             "param": "model", "code": 404}}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_the_lora_request_body_field_stays_refused(http, adapter_dirs):
    lora_request = {"lora_name": "sql", "lora_int_id": 1, "lora_path": adapter_dirs["sql"]}
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "lora_request": lora_request})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_request"


def test_an_adapter_loaded_at_runtime_serves_until_unloaded(http, tiny_llama_dir, adapter_dirs):
    path = adapter_dirs["runtime"]
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": path})
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'runtime' added successfully.")
    assert completion_tokens(http, "runtime") == peft_greedy(tiny_llama_dir, path, [PROMPT], MAX_TOKENS)[0]
    assert [card["id"] for card in http.get("/v1/models").json()["data"]][-1] == "runtime"

    again = http.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": path})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'runtime' has already been loaded."

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"}).status_code == 200
    gone = http.post("/v1/completions", json={"model": "runtime", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert "runtime" not in [card["id"] for card in http.get("/v1/models").json()["data"]]
    unknown = http.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": "The lora adapter 'runtime' cannot be found.",
                                       "type": "NotFoundError", "param": "lora_name", "code": 404}


@pytest.mark.parametrize("body, status, message, param", [
    ({"lora_name": "wide", "lora_path": "rank32"}, 400, "over the engine's max_lora_rank of 16", "lora_path"),
    ({"lora_name": "void", "lora_path": "/no/such/adapter"}, 400, "no LoRA adapter can be read at", "lora_path"),
    ({"lora_name": "nameless"}, 400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_path"),
    ({"lora_name": MODEL_NAME, "lora_path": "rank32"}, 400, "is a served name of the base model", "lora_name"),
])
def test_a_load_the_server_cannot_serve_is_400_and_the_server_serves_on(http, tiny_llama_dir, adapter_dirs, body,
                                                                         status, message, param):
    if body.get("lora_path") == "rank32":
        body = {**body, "lora_path": adapter_dirs["rank32"]}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"] and response.json()["error"]["param"] == param
    assert body["lora_name"] not in [card["id"] for card in http.get("/v1/models").json()["data"]][1:]
    assert completion_tokens(http, "sql") == peft_greedy(tiny_llama_dir, adapter_dirs["sql"], [PROMPT], MAX_TOKENS)[0]


def test_a_load_says_the_same_of_every_path_that_holds_no_adapter(http, tiny_llama_dir, adapter_dirs):
    """No error tells which server paths exist: a missing path, a directory of other files, a
    file and an unreadable path all get one message."""
    paths = ["/no/such/adapter", tiny_llama_dir, os.path.join(adapter_dirs["sql"], "adapter_config.json"), "/root",
             "/proc/self"]
    answers = {json.dumps(http.post("/v1/load_lora_adapter", json={"lora_name": "probe", "lora_path": path}).json())
               for path in paths}
    assert len(answers) == 1, answers
    assert json.loads(answers.pop())["error"]["param"] == "lora_path"


def test_concurrent_loads_of_one_name_serialize(lora_server, adapter_dirs):
    statuses: list[int] = []

    def load() -> None:
        with httpx.Client(base_url=lora_server.url, timeout=60.0) as http:
            statuses.append(http.post("/v1/load_lora_adapter",
                                      json={"lora_name": "twin", "lora_path": adapter_dirs["runtime"]}).status_code)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(statuses) == [200, 400, 400, 400]
    with httpx.Client(base_url=lora_server.url, timeout=60.0) as http:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "twin"}).status_code == 200


def test_without_runtime_updating_the_routes_are_absent(tiny_llama_dir, adapter_dirs, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    process = ServerProcess(tiny_llama_dir, tmp_path / "server.log", *LORA_FLAGS,
                            "--lora-modules", f"sql={adapter_dirs['sql']}")
    try:
        with httpx.Client(base_url=process.url, timeout=60.0) as http:
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                assert http.post(route, json={"lora_name": "x", "lora_path": adapter_dirs["runtime"]}).status_code \
                    == 404
            assert completion_tokens(http, "sql") == peft_greedy(tiny_llama_dir, adapter_dirs["sql"], [PROMPT],
                                                                 MAX_TOKENS)[0]
    finally:
        assert process.stop() == 0, process.log()


def test_a_bad_lora_module_path_stops_the_launch_naming_it(tiny_llama_dir, adapter_dirs, tmp_path):
    missing = str(tmp_path / "no-such-adapter")
    with pytest.raises(RuntimeError, match="exited with 1") as error:
        ServerProcess(tiny_llama_dir, tmp_path / "server.log", *LORA_FLAGS,
                      "--lora-modules", f"sql={adapter_dirs['sql']}", f"missing={missing}")
    assert f"--lora-modules: the adapter 'missing' at {missing} cannot be served" in str(error.value)
    assert "no such directory" in str(error.value)


def test_lora_modules_take_vllms_two_forms():
    assert parse_lora_module("sql=/adapters/sql") == LoRAModulePath("sql", "/adapters/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "base"}') \
        == LoRAModulePath("sql", "/a/sql", "base")
    assert parse_lora_module('{"name": "sql", "path": "/a=b"}') == LoRAModulePath("sql", "/a=b")
    args = parse_args(["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])
    assert args.lora_modules == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y")]


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "the name 'a' is given twice"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"], "is a served name of the base model"),
    (["--enable-lora", "--lora-modules", "nopath"], "expected name=path or a JSON object"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], "needs a non-empty name and path"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "rank": 8}'], "unknown field"),
])
def test_bad_lora_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("value, allowed", [("true", True), ("1", True), ("True", True), ("0", False),
                                            ("false", False), ("", False), (None, False)])
def test_runtime_updating_is_allowed_by_vllms_variable_or_the_flag(value, allowed, monkeypatch):
    if value is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    assert runtime_lora_updating_allowed() is allowed
    settings = openai_server_settings(parse_args(["--enable-lora"]))
    assert settings["allow_runtime_lora_updating"] is allowed
    flagged = openai_server_settings(parse_args(["--enable-lora", "--allow-runtime-lora-updating"]))
    assert flagged["allow_runtime_lora_updating"] is True
