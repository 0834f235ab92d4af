"""A BERT encoder served over HTTP (the engine's encoder step behind the real server and
the openai client), in fp32 and with --quantization int8, against sentence-transformers."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import openai
import pytest
import torch

from actors.config import cache_dir
from tests.api.conftest import ServerProcess, served
from tests.pooling.tiny_bert import SENTENCES, save_bert, save_sentence_transformer


@pytest.fixture(scope="module")
def bert_embedder(tmp_path_factory):
    """(directory, the sentence-transformers model) of a tiny random BERT, mean pooling, normalised."""
    bert_dir = save_bert(str(tmp_path_factory.mktemp("bert")), seed=3)
    out_dir = str(tmp_path_factory.mktemp("bert_embedder"))
    return out_dir, save_sentence_transformer(bert_dir, out_dir, "mean", True)


@pytest.mark.parametrize("quantization,min_cosine", [("none", 0.9999), ("int8", 0.99)])
def test_bert_server_embeds_like_sentence_transformers(bert_embedder, tmp_path, quantization, min_cosine,
                                                       monkeypatch):
    model_dir, model = bert_embedder
    # a kernel cache without the int8 kernels (the others copied, so only those are built):
    # the server builds them while it starts, not when the first request comes (on a loaded
    # machine that build ran past the client's timeout)
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    for library in (Path(cache_dir()) / "kernels").glob("*.so"):
        if not library.name.startswith("int8_linear"):
            shutil.copy(library, cache / "kernels" / library.name)
    monkeypatch.setenv("TROUPE_CACHE", str(cache))
    process = ServerProcess(model_dir, tmp_path / "server.log", "--log-level", "warning",
                            "--quantization", quantization)
    with contextlib.contextmanager(served)(process) as server:
        if quantization == "int8":
            assert list((cache / "kernels").glob("int8_linear-*.so")), "the int8 kernels were not built at start-up"
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=60.0) as client:
            response = client.embeddings.create(model=client.models.list().data[0].id, input=SENTENCES)
        actual = torch.tensor([item.embedding for item in sorted(response.data, key=lambda item: item.index)])
        expected = model.encode(SENTENCES, convert_to_tensor=True)
        assert torch.nn.functional.cosine_similarity(actual, expected, dim=1).min() >= min_cosine
        assert response.usage.prompt_tokens == sum(len(model.tokenizer(s)["input_ids"]) for s in SENTENCES)
