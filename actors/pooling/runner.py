"""The model runner's side of pooling requests: a pooling request's scheduled prompt rows
become a PoolingSpan of the step's final hidden states; the Pooler (pooler.py) keeps what a
chunked prompt carries between steps; when a prompt ends, its pooled vector is finished as
the model's task and the request's PoolingParams say (an embedding truncated and
normalised, or a classifier's scores) and goes back as float32 bytes.

Pooling requests never reach the sampler: the runner asks `takes(request_id)` and leaves
them out of the rows that get logits."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from actors.pooling.classifier import ScoreHead, reranker_score_head
from actors.config.pooler import PoolerConfig
from actors.pooling.pooler import Pooler, PoolingSpan, finish_embedding, finish_logits
from messages.pooling import PER_TOKEN_TASKS, PooledData, PoolingParams


class PoolingRunner:
    def __init__(self, config: PoolerConfig, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if config.task == "classify" and head is None:
            raise ValueError("a classification model needs its score head")
        self.config = config
        self.head = head
        self.pooler = Pooler()
        self.params: dict[str, PoolingParams] = {}  # live pooling requests

    def add_request(self, request_id: str, params: PoolingParams) -> None:
        self.params[request_id] = params

    def remove_request(self, request_id: str) -> None:
        """Finished, aborted or preempted: a preempted request starts over at its prompt's first token."""
        self.params.pop(request_id, None)
        self.pooler.discard(request_id)

    def takes(self, request_id: str) -> bool:
        return request_id in self.params

    def span(self, request_id: str, start_row: int, first_token: int, num_tokens: int,
             num_prompt_tokens: int) -> PoolingSpan:
        """A request's rows of this step: prompt tokens [first_token, first_token + num_tokens).
        A per-token task (reward, token_embed, token_classify) pools every row (ALL)."""
        pooling_type = "ALL" if self.params[request_id].task in PER_TOKEN_TASKS else self.config.pooling_type
        return PoolingSpan(request_id, start_row, num_tokens, pooling_type, is_first=first_token == 0,
                           is_last=first_token + num_tokens == num_prompt_tokens)

    def outputs(self, hidden: torch.Tensor, spans: list[PoolingSpan]) -> dict[str, PooledData]:
        """The finished output of every span that ends its prompt."""
        pooled = self.pooler.pool(hidden, spans)
        return {request_id: _as_pooled_data(self._finish(vector, self.params[request_id]))
                for request_id, vector in pooled.items()}

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        config = self.config
        if config.task == "embed":
            normalize = config.normalize if params.normalize is None else params.normalize
            return finish_embedding(vector, normalize, params.dimensions)
        logits = self.head(vector.unsqueeze(0) if vector.dim() == 1 else vector)
        activation = config.activation if params.use_activation in (None, True) else None
        scores = finish_logits(logits, activation)
        return scores[0] if vector.dim() == 1 else scores


def pooling_runner(config: PoolerConfig, hidden_size: int, score_weight: object | None, dummy: bool,
                   dtype: torch.dtype, device: torch.device, seed: int = 0, lm_head: torch.Tensor | None = None,
                   tokenizer_path: str | None = None,
                   head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PoolingRunner:
    """The runner of a pooling model: a classifier's head as given (an encoder's own), from
    its checkpoint's score weight (a tensor or a lazy safetensors slice), from its LM head's
    rows of config.classifier_from_token, or random with dummy weights."""
    if config.task != "classify":
        return PoolingRunner(config)
    if head is not None:
        return PoolingRunner(config, head)
    if config.classifier_from_token:
        ids = _token_ids(tokenizer_path, config.classifier_from_token)
        if config.two_way:  # the tokens are (false, true): a one-label head of their difference
            return PoolingRunner(config, reranker_score_head(lm_head, yes_token_id=ids[1], no_token_id=ids[0]))
        return PoolingRunner(config, ScoreHead(lm_head[torch.tensor(ids, device=lm_head.device)].contiguous()))
    if score_weight is None:
        if not dummy:
            raise ValueError("the checkpoint has no score.weight: it is not a ...ForSequenceClassification model")
        generator = torch.Generator().manual_seed(seed + 1)
        score_weight = torch.randn(config.num_labels or 1, hidden_size, generator=generator) * hidden_size**-0.5
    weight = score_weight[:] if not isinstance(score_weight, torch.Tensor) else score_weight
    return PoolingRunner(config, ScoreHead(weight.to(device=device, dtype=dtype).contiguous()))


def _token_ids(tokenizer_path: str, tokens: tuple[str, ...]) -> list[int]:
    """Each token's id in the model's vocabulary (ValueError for one it lacks)."""
    from actors.models.loader import load_tokenizer

    vocab = load_tokenizer(tokenizer_path).get_vocab()
    missing = [token for token in tokens if token not in vocab]
    if missing:
        raise ValueError(f"hf_overrides: classifier_from_token {missing} are not tokens of the model's vocabulary")
    return [vocab[token] for token in tokens]


def _as_pooled_data(tensor: torch.Tensor) -> PooledData:
    array = np.ascontiguousarray(tensor.detach().to("cpu", torch.float32).numpy(), dtype="<f4")
    return PooledData(array.tobytes(), list(array.shape))
