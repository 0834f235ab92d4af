"""Scoring text pairs with a pooling model, as vLLM's score() and /score do, shared by
LLM.score and AsyncClient.score:

- the pairs: one data_1 with every data_2, or data_1[i] with data_2[i];
- how a model scores them (scoring_mode): an embedding model by the cosine of the two
  texts' embeddings (each distinct text embedded once), a classifier with one label (a
  cross-encoder) by its output over the pair tokenized as one input, as its tokenizer
  joins a text pair; any other classifier has no single score and is refused.

torch is imported only where a cosine is computed: the frontend imports this module, and
the API server's process must not pay for torch before it serves a pooling request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from actors.config.pooler import PoolerConfig
from messages.common import InvalidRequestError
from messages.pooling import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput

ScoringMode = Literal["cosine", "cross_encoder"]


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str],
                names: tuple[str, str] = ("data_1", "data_2")) -> tuple[list[str], list[str]]:
    """The two sides of every pair, as equal-length lists; names: the fields an error names
    (an HTTP route calls them text_1 and text_2)."""
    firsts, seconds = _texts(data_1, names[0]), _texts(data_2, names[1])
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not seconds:
        raise InvalidRequestError(f"score needs one {names[0]} or as many as {names[1]} (got {len(firsts)} and "
                                  f"{len(seconds)}), and at least one of each", param=names[1])
    return firsts, seconds


def scoring_mode(pooler: PoolerConfig | None) -> ScoringMode:
    """How the model scores a pair; InvalidRequestError (param "model") when it cannot."""
    if pooler is None:
        raise InvalidRequestError("score needs a pooling model (runner 'pooling')", param="model")
    if pooler.task == "embed":
        return "cosine"
    if pooler.num_labels != 1:
        raise InvalidRequestError(f"score needs a classifier with one label (a cross-encoder); this one has "
                                  f"{pooler.num_labels}", param="model")
    return "cross_encoder"


def distinct_texts(firsts: list[str], seconds: list[str]) -> list[str]:
    """Each text once, in first-seen order: a query scored against many documents is embedded once."""
    return list(dict.fromkeys(firsts + seconds))


def cosine_scores(firsts: list[str], seconds: list[str],
                  embedding_of: dict[str, PoolingRequestOutput]) -> list[ScoringRequestOutput]:
    """Each pair's cosine similarity; embedding_of: text -> its pooled embedding."""
    import torch  # here: see the module's docstring

    scores = []
    for first, second in zip(firsts, seconds):
        first_output, second_output = embedding_of[first], embedding_of[second]
        score = torch.nn.functional.cosine_similarity(first_output.outputs.data, second_output.outputs.data,
                                                      dim=0).item()
        # vLLM's usage of a cosine score counts both texts' tokens
        scores.append(ScoringRequestOutput(
            request_id=f"{first_output.request_id}-{second_output.request_id}", outputs=ScoringOutput(score=score),
            prompt_token_ids=first_output.prompt_token_ids + second_output.prompt_token_ids))
    return scores


def pair_token_ids(tokenizer, firsts: list[str], seconds: list[str]) -> list[list[int]]:
    """Each pair as one cross-encoder input: the tokenizer's own text-pair encoding (its
    special tokens and separators, as the model was trained)."""
    return [tokenizer(first, text_pair=second)["input_ids"] for first, second in zip(firsts, seconds)]


def cross_encoder_scores(outputs: list[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
    """The one label's output of each pair (after the model's activation)."""
    return [ScoringRequestOutput(request_id=output.request_id,
                                 outputs=ScoringOutput(score=float(output.outputs.data[0])),
                                 prompt_token_ids=output.prompt_token_ids) for output in outputs]


def _texts(data: str | Sequence[str], name: str) -> list[str]:
    texts = [data] if isinstance(data, str) else list(data)
    if not all(isinstance(text, str) and text for text in texts):
        raise InvalidRequestError(f"{name} must be a non-empty string or a list of them", param=name)
    return texts
