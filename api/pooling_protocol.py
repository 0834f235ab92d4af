"""The pooling routes' request and response bodies, as vLLM names them: /v1/embeddings
(OpenAI's shape), /pooling, /classify, /score and /rerank (Jina's and Cohere's shape).

As in protocol.py, msgspec checks every type at decoding and optional fields are
`X | None = None`, so an explicit null means the default."""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from actors.errors import InvalidRequestError
from messages.pooling import PoolingParams

# An input: a string, a list of strings, a list of token ids, or a list of token-id lists
# (msgspec allows one list type per union, so the shape is checked in prompts()).
InputField = str | list[str | int | list[int]]
Prompt = str | list[int]
EncodingFormat = Literal["float", "base64"]


class InputRequest(msgspec.Struct, kw_only=True):
    """What the routes with an `input` share: one engine request per prompt."""

    input: InputField
    model: str | None = None  # None or "": the (first) served model
    user: str | None = None  # accepted and ignored, as OpenAI: troupe keeps no per-user state
    truncate_prompt_tokens: int | None = None  # keep the last k tokens; -1: as many as the model takes
    add_special_tokens: bool | None = True  # the tokenizer's special tokens around a text input
    priority: int | None = 0  # lower first under --scheduling-policy priority; else only 0 (others refused by name)
    request_id: str | None = None  # the response's id (after its prefix); X-Request-Id wins

    def prompts(self) -> list[Prompt]:
        """The prompts this request asks for, in order; 400 naming `input` for an empty one."""
        value = self.input
        if isinstance(value, str):
            prompts: list[Prompt] = [value]
        elif value and all(isinstance(item, int) for item in value):
            prompts = [list(value)]
        elif value and all(isinstance(item, str) for item in value):
            prompts = list(value)
        elif value and all(isinstance(item, list) for item in value):
            prompts = [list(item) for item in value]
        elif not value:
            raise InvalidRequestError("input must not be empty", param="input")
        else:
            raise InvalidRequestError("input must be a string, a list of strings, a list of token ids or a list "
                                      "of token-id lists", param="input")
        if not all(prompts):
            raise InvalidRequestError("input must not hold an empty string or an empty token list", param="input")
        return prompts


class EmbeddingRequest(InputRequest, kw_only=True):
    """POST /v1/embeddings (OpenAI's, with vLLM's extensions)."""

    encoding_format: EncodingFormat | None = "float"
    dimensions: int | None = None  # Matryoshka truncation, for a model trained for it
    normalize: bool | None = None  # None: as the model's pooler says

    def pooling_params(self, task: str) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, dimensions=self.dimensions,
                             normalize=self.normalize, task=task)


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """POST /pooling (vLLM's): the model's pooled output as it is, whatever its task."""


class ClassificationRequest(InputRequest, kw_only=True):
    """POST /classify (vLLM's)."""

    use_activation: bool | None = None  # False: the raw logits; None: the model's activation
    activation: bool | None = None  # vLLM's older name of use_activation

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, use_activation=self.use_activation,
                             activation=self.activation, task="classify")


class ScoreRequest(msgspec.Struct, kw_only=True):
    """POST /score and /v1/score (vLLM's): text_1 with each text_2, or pairwise; vLLM's
    newer names queries and documents mean the same."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int | None = 0
    request_id: str | None = None
    user: str | None = None

    def sides(self) -> tuple[str | list[str], str | list[str], tuple[str, str]]:
        """(first side, second side, the names the request gave them)."""
        if self.text_1 is not None or self.text_2 is not None:
            if self.queries is not None or self.documents is not None:
                raise InvalidRequestError("give text_1 and text_2, or queries and documents, not both",
                                          param="queries")
            return _required(self.text_1, "text_1"), _required(self.text_2, "text_2"), ("text_1", "text_2")
        if self.queries is not None or self.documents is not None:
            return (_required(self.queries, "queries"), _required(self.documents, "documents"),
                    ("queries", "documents"))
        raise InvalidRequestError("score needs text_1 and text_2 (or queries and documents)", param="text_1")


class RerankRequest(msgspec.Struct, kw_only=True):
    """POST /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape, as vLLM)."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None  # None or 0: every document
    return_documents: bool | None = True
    truncate_prompt_tokens: int | None = None
    priority: int | None = 0
    request_id: str | None = None
    user: str | None = None

    def num_results(self) -> int:
        if self.top_n is not None and self.top_n < 0:
            raise InvalidRequestError(f"top_n must be at least 0 (0: every document), got {self.top_n}",
                                      param="top_n")
        return min(self.top_n, len(self.documents)) if self.top_n else len(self.documents)


def _required(value: str | list[str] | None, name: str) -> str | list[str]:
    if value is None:
        raise InvalidRequestError(f"{name} is required", param=name)
    return value


# ---- responses ----

def _now() -> int:
    return int(time.time())


class PoolingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    total_tokens: int = 0  # the same: a pooling request generates nothing


class _ListResponse(msgspec.Struct, kw_only=True):
    """What every pooling response but /rerank's holds around its data."""

    id: str
    model: str
    usage: PoolingUsage
    object: str = "list"
    created: int = msgspec.field(default_factory=_now)


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # a str: base64 of little-endian float32, as OpenAI
    object: str = "embedding"


class EmbeddingResponse(_ListResponse, kw_only=True):
    data: list[EmbeddingData]


class PoolingData(msgspec.Struct, kw_only=True):
    index: int
    data: Any  # a list of floats ([dim]), of lists ([num_tokens, dim]), or base64
    object: str = "pooling"


class PoolingResponse(_ListResponse, kw_only=True):
    data: list[PoolingData]


class ClassificationData(msgspec.Struct, kw_only=True):
    index: int
    label: str  # the label of the highest score, from config.json's id2label
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse, kw_only=True):
    data: list[ClassificationData]


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(_ListResponse, kw_only=True):
    data: list[ScoreData]


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int  # the document's position in the request
    relevance_score: float
    document: RerankDocument | UnsetType = UNSET  # left out with return_documents false


class RerankUsage(msgspec.Struct, kw_only=True):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]  # best first
    usage: RerankUsage


def encode_vector(data: Any, encoding_format: str | None) -> list | str:
    """A pooled float32 tensor as JSON: its values, or with "base64" its little-endian
    float32 bytes in base64, which OpenAI's clients decode themselves."""
    if encoding_format == "base64":
        return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()
