"""What a pooling request asks for (PoolingParams, beside SamplingParams) and what it gets
back (PoolingRequestOutput and vLLM's typed views of it: embeddings, class probabilities,
scores). A pooling request runs its prompt through the model and nothing more: no
sampling, no decode steps, no detokenizer. No torch here: the pooled vector travels as
float32 bytes and becomes a tensor only in the caller's process."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from messages.errors import InvalidRequestError

# What a pooling request is for, as vLLM names its pooling tasks.
PoolingTask = Literal["embed", "classify", "score", "encode", "token_embed", "token_classify", "reward"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "encode", "token_embed", "token_classify", "reward")
# tasks whose output is one row per prompt token (ALL pooling), whatever the model's own pooling
PER_TOKEN_TASKS: tuple[str, ...] = ("token_embed", "token_classify", "reward")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """vLLM's PoolingParams. Fields left None take the model's pooler configuration."""

    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: the model's limit
    dimensions: int | None = None  # Matryoshka truncation of an embedding (models that declare it)
    normalize: bool | None = None  # L2-normalise an embedding
    use_activation: bool | None = None  # softmax/sigmoid over classification logits
    activation: bool | None = None  # vLLM's older name of use_activation
    task: str | None = None  # set by the entry point (LLM.embed: "embed"...)

    def __post_init__(self) -> None:
        if self.activation is not None:
            if self.use_activation is not None and self.use_activation != self.activation:
                raise InvalidRequestError("activation and use_activation disagree; send use_activation",
                                          param="use_activation")
            self.use_activation, self.activation = self.activation, None
        self.validate()

    def validate(self) -> None:
        if self.truncate_prompt_tokens is not None:
            _check(not isinstance(self.truncate_prompt_tokens, bool) and
                   (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1),
                   "truncate_prompt_tokens",
                   f"must be -1 (the model's limit) or at least 1, got {self.truncate_prompt_tokens!r}")
        if self.dimensions is not None:
            _check(not isinstance(self.dimensions, bool) and isinstance(self.dimensions, int) and self.dimensions >= 1,
                   "dimensions", f"must be a positive integer, got {self.dimensions!r}")
        if self.task is not None:
            _check(self.task in POOLING_TASKS, "task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    def with_task(self, task: str) -> PoolingParams:
        """These parameters for an entry point's task; a different task already set is an error."""
        if self.task is not None and self.task != task:
            raise InvalidRequestError(f"these PoolingParams are for task {self.task!r}, not {task!r}", param="task")
        return msgspec.structs.replace(self, task=task)


def pooling_params_for(params: object, task: str | None, default_task: str,
                       truncate_prompt_tokens: int | None = None) -> PoolingParams:
    """A caller's pooling_params (None: the defaults) for task (None: their own task, else
    default_task), with truncate_prompt_tokens when given; InvalidRequestError otherwise."""
    if params is None:
        params = PoolingParams()
    elif not isinstance(params, PoolingParams):
        raise InvalidRequestError(f"pooling_params must be PoolingParams, got {type(params).__name__}",
                                  param="pooling_params")
    if truncate_prompt_tokens is not None:
        params = msgspec.structs.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        params.validate()
    return params.with_task(task or params.task or default_task)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{field} {message}", param=field)


class PooledData(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A pooled result on the wire: little-endian float32 bytes and its shape ([dim] for a
    vector, [num_tokens, dim] for per-token pooling)."""

    data: bytes
    shape: list[int]

    def tolist(self) -> list:
        import array

        values = array.array("f")
        values.frombytes(self.data)
        flat = values.tolist()
        if len(self.shape) == 1:
            return flat
        width = self.shape[-1]
        return [flat[i:i + width] for i in range(0, len(flat), width)]


class PoolingOutput(msgspec.Struct, kw_only=True):
    """vLLM's PoolingOutput: data is a torch tensor in the caller's process."""

    data: Any

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


class PoolingRequestOutput(msgspec.Struct, kw_only=True):
    """vLLM's PoolingRequestOutput: one prompt's pooled result."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0


class EmbeddingOutput(msgspec.Struct, kw_only=True):
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class ClassificationOutput(msgspec.Struct, kw_only=True):
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ScoringOutput(msgspec.Struct, kw_only=True):
    score: float


class EmbeddingRequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    finished: bool = True


class ClassificationRequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    finished: bool = True


class ScoringRequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    finished: bool = True
