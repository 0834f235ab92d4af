"""The classification head of a decoder (LlamaForSequenceClassification,
Qwen2ForSequenceClassification, Qwen3ForSequenceClassification), and vLLM's conversion of a
Qwen3-Reranker language model into a one-label score head.

The head is `score.weight` [num_labels, hidden] with no bias, applied to the decoder's
final-normed hidden state of each prompt's last token (the LAST pooling of pooler.py):
exactly what the Hugging Face classes return as logits for an unpadded prompt.

Weight names. A ...ForSequenceClassification checkpoint names its decoder as a
...ForCausalLM one does (`model.embed_tokens.weight`, `model.layers.{i}.*`,
`model.norm.weight`), has no `lm_head.weight`, and adds `score.weight`. So the decoder's
LlamaModel.load_weights can be given the checkpoint less `score.weight`
(decoder_weights splits it off): without an `lm_head.weight` it ties its LM head to the
embeddings, which a pooling model never uses. Note that load_model_config accepts only the
...ForCausalLM architectures; a classifier's config.json names ...ForSequenceClassification.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

SCORE_WEIGHT = "score.weight"


class ScoreHead:
    """A bias-free linear map from a pooled hidden state to num_labels logits."""

    def __init__(self, weight: torch.Tensor) -> None:  # [num_labels, hidden]
        assert weight.dim() == 2, weight.shape
        self.weight = weight

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, num_labels] fp32
        return F.linear(pooled.to(self.weight.dtype), self.weight).float()


def split_score_weight(weights: Iterable[tuple[str, torch.Tensor]],
                       found: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less `score.weight`, for the decoder's load_weights; the
    score weight lands in found[SCORE_WEIGHT] as the stream passes it (one pass over the
    safetensors, so a large checkpoint is not read twice)."""
    for name, tensor in weights:
        if name == SCORE_WEIGHT:
            found[SCORE_WEIGHT] = tensor
        else:
            yield name, tensor


def load_score_head(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> ScoreHead:
    """The score head of a checkpoint's tensors (e.g. loader.iter_weights(model_dir));
    ValueError when it has none."""
    for name, tensor in weights:
        if name == SCORE_WEIGHT:
            return ScoreHead(tensor.to(device=device, dtype=dtype).contiguous())
    raise ValueError(f"checkpoint is missing weight {SCORE_WEIGHT!r}: not a ...ForSequenceClassification model")


def reranker_score_head(lm_head: torch.Tensor,  # [vocab, hidden] the decoder's LM head
                        yes_token_id: int, no_token_id: int) -> ScoreHead:
    """vLLM's Qwen3-Reranker conversion: a one-label head whose logit is logit(yes) -
    logit(no), so that its sigmoid is the softmax probability of "yes" over {yes, no}
    (sigmoid(a - b) = e^a / (e^a + e^b)). Use it with activation "sigmoid"."""
    vocab_size = lm_head.shape[0]
    for token_id in (yes_token_id, no_token_id):
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {vocab_size}")
    # kept in fp32: the two rows are close, and in bf16 their difference would lose its low bits
    weight = lm_head[yes_token_id].float() - lm_head[no_token_id].float()
    return ScoreHead(weight.unsqueeze(0))
