"""A BERT-family encoder's ModelConfig, read from its directory without torch: the sizes
and limits the engine's bookkeeping needs (an encoder keeps no KV cache; the decoder
fields it lacks get neutral values) and its [SEP] token. The loader calls it for the
registry's "encoder" architectures (registry.py)."""

from __future__ import annotations

import json
import os

from actors.config import ModelConfig


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
