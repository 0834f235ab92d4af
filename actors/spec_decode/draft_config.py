"""Start-up checks of a speculative `draft_model`: the draft loads as the target does (a
Hugging Face directory or a GGUF file), is a decoder the worker runs, shares the target's
vocabulary and tokenizer (the draft's distribution q and the target's p are compared
token id by token id), holds every position the engine serves, and runs on one device.
Each failure is a ValueError naming the problem, raised before anything is served.
Torch-free: the frontend's process builds the engine config."""

from __future__ import annotations

import os

from actors.config import ModelConfig
from actors.models.loader import load_backend_tokenizer, load_model_config, resolve_model


def load_draft_model_config(draft_path: str, target: ModelConfig, *, max_model_len: int,
                            tensor_parallel_size: int, tokenizer_path: str) -> ModelConfig:
    """The draft's ModelConfig (its model_path the resolved Hugging Face directory), after
    checking it can draft for target; ValueError naming the problem otherwise."""
    if tensor_parallel_size != 1:
        raise ValueError(f"speculative_config: method draft_model runs on one device; tensor_parallel_size is "
                         f"{tensor_parallel_size} (use ngram or suffix with tensor parallelism)")
    try:
        draft_dir = resolve_model(draft_path)
        draft = load_model_config(draft_dir)
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"speculative_config: the draft model {draft_path!r} does not load: {error}") from error
    if not draft.can_generate:
        raise ValueError(f"speculative_config: the draft model {draft_path!r} ({draft.architecture}) has no "
                         "language-model head; a draft must be a ...ForCausalLM decoder")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocab_size ({draft.vocab_size}) differs from the "
                         f"target's ({target.vocab_size}); a draft must share the target's tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config: the draft model's max_position_embeddings "
                         f"({draft.max_position_embeddings}) is below max_model_len ({max_model_len}); lower "
                         "max_model_len or pick a draft with a longer context")
    _check_same_tokenizer(draft, target, draft_path, tokenizer_path)
    return draft


def _check_same_tokenizer(draft: ModelConfig, target: ModelConfig, draft_path: str, tokenizer_path: str) -> None:
    """Equal end-of-sequence ids, and equal token -> id maps where the draft ships a
    tokenizer (a directory of weights alone is taken on its vocab_size and eos ids)."""
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise ValueError(f"speculative_config: the draft model's eos_token_ids {list(draft.eos_token_ids)} differ "
                         f"from the target's {list(target.eos_token_ids)}; a draft must share the target's tokenizer")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(draft.model_path, name)) for name in tokenizer_files):
        return
    if os.path.realpath(draft.model_path) == os.path.realpath(tokenizer_path):
        return
    draft_vocab = load_backend_tokenizer(draft.model_path).get_vocab()
    target_vocab = load_backend_tokenizer(tokenizer_path).get_vocab()
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise ValueError(f"speculative_config: the draft model {draft_path!r} has another tokenizer than the target "
                         f"({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. {differing})")
