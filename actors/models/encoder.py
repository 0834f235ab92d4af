"""BERT-family encoders as the engine runs them: a ModelConfig for the engine's bookkeeping
(sizes, limits; an encoder keeps no KV cache), and the worker's step over whole prompts.

An encoder's tokens attend to their whole sequence, both ways, so the scheduler never
chunks its prompts (SchedulerConfig.enable_chunked_prefill off) and nothing is reused from
the prefix cache; each step's sequences run as one flat batch (bert.py). Segment ids
(token types) are not sent with a request: BERT's pair encoding is `[CLS] a [SEP] b [SEP]`,
so the tokens after the first [SEP] are segment 1, as the tokenizer's token_type_ids say."""

from __future__ import annotations

import json
import os

from actors.config import ModelConfig

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "RobertaModel",
                         "RobertaForSequenceClassification", "XLMRobertaModel", "XLMRobertaForSequenceClassification")


def encoder_model_config(model_dir: str, config: dict, config_path: str) -> ModelConfig:
    """The ModelConfig of a BERT directory (the decoder fields an encoder lacks get neutral values)."""
    from actors.models.bert import BertConfig

    bert = BertConfig.from_dict(config, config_path)  # ValueError for what bert.py cannot run
    return ModelConfig(
        model_path=model_dir, architecture=config["architectures"][0], vocab_size=bert.vocab_size,
        hidden_size=bert.hidden_size, intermediate_size=bert.intermediate_size,
        num_hidden_layers=bert.num_hidden_layers, num_attention_heads=bert.num_attention_heads,
        num_key_value_heads=bert.num_attention_heads, head_dim=bert.head_dim, rms_norm_eps=bert.layer_norm_eps,
        rope_theta=0.0, rope_scaling=None, max_position_embeddings=bert.max_sequence_length,
        tie_word_embeddings=False, attention_bias=True, qk_norm=False, eos_token_ids=(),
        sep_token_id=_sep_token_id(model_dir))


def _sep_token_id(model_dir: str) -> int | None:
    """The [SEP] token's id, from the tokenizer's files (the worker loads no tokenizer)."""
    sep = _read(os.path.join(model_dir, "tokenizer_config.json")).get("sep_token", "[SEP]")
    if isinstance(sep, dict):
        sep = sep.get("content")
    for token in _read(os.path.join(model_dir, "tokenizer.json")).get("added_tokens", []):
        if token.get("content") == sep:
            return token["id"]
    vocab_path = os.path.join(model_dir, "vocab.txt")
    if os.path.isfile(vocab_path):
        with open(vocab_path, encoding="utf-8") as vocab:
            for index, line in enumerate(vocab):
                if line.rstrip("\n") == sep:
                    return index
    return None


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as json_file:
        return json.load(json_file)


class EncoderStep:
    """The worker's forward for an encoder: a step's whole prompts as one flat batch."""

    def __init__(self, model, sep_token_id: int | None) -> None:  # model: bert.BertModel
        self.model = model
        self.sep_token_id = sep_token_id

    def __call__(self, input_ids, cu_seqlens: list[int]):  # [num_tokens] -> [num_tokens, hidden]
        return self.model.forward(input_ids, cu_seqlens, self.token_type_ids(input_ids, cu_seqlens))

    def token_type_ids(self, input_ids, cu_seqlens: list[int]):
        """1 for the tokens after each sequence's first [SEP], else 0; None when all are 0."""
        import torch

        if self.sep_token_id is None or self.model.config.type_vocab_size < 2:
            return None
        is_sep = (input_ids == self.sep_token_id).to(torch.int64)
        seps_before = torch.cumsum(is_sep, 0) - is_sep  # [SEP]s strictly before each token, in the batch
        lengths = torch.tensor([end - start for start, end in zip(cu_seqlens, cu_seqlens[1:])],
                               device=input_ids.device)
        at_start = seps_before[torch.tensor(cu_seqlens[:-1], device=input_ids.device)]
        return (seps_before - torch.repeat_interleave(at_start, lengths) > 0).to(torch.int64)


class BertClassifierHead:
    """BertForSequenceClassification's head over a pooled CLS row: the pooler's dense + tanh,
    then the classifier (a ScoreHead's place in runner.py)."""

    def __init__(self, pooler, classifier) -> None:  # (weight, bias) pairs
        self.pooler, self.classifier = pooler, classifier

    def __call__(self, pooled):  # [n, hidden] -> [n, num_labels] fp32
        import torch.nn.functional as F

        hidden = F.linear(pooled.to(self.pooler[0].dtype), *self.pooler).tanh()
        return F.linear(hidden, *self.classifier).float()


def build_encoder(model_config: ModelConfig, dtype, device, dummy: bool, seed: int, with_classifier: bool,
                  quantization: str | None = None) -> EncoderStep:
    from actors.models.bert import BertModel, read_bert_config
    from actors.models.loader import iter_weights

    model = BertModel(read_bert_config(model_config.model_path), dtype, device, quantization)
    if dummy:
        model.init_dummy_weights(seed, with_classifier=with_classifier)
    else:
        model.load_weights(iter_weights(model_config.model_path), with_classifier=with_classifier)
    return EncoderStep(model, model_config.sep_token_id)
