"""`--model-impl auto|troupe|transformers` (vLLM's flag) at start-up: which code runs a
decoder, and the ModelConfig and engine checks of the Transformers fallback
(transformers_fallback.py runs it in the worker).

- troupe: the registry's own implementation; an architecture it lacks is the registry's
  error (naming it and the supported ones).
- transformers: Hugging Face's modeling code of any causal LM transformers implements,
  over troupe's paged KV cache.
- auto: troupe's where the registry has the architecture, the fallback otherwise; one log
  line says which.

transformers (and with it torch) is imported only when the fallback is asked about: an
architecture the registry serves starts as before."""

from __future__ import annotations

import logging

from actors.config import ModelConfig
from actors.models.registry import MODELS, model_entry

MODEL_IMPLS = ("auto", "troupe", "transformers")
logger = logging.getLogger(__name__)


def resolve_model_impl(architecture: str | None, model_impl: str, config_path: str) -> str:
    """"troupe" or "transformers" for this architecture; ValueError naming it where neither runs it."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    native = architecture in MODELS
    if model_impl == "troupe" or (model_impl == "auto" and native):
        model_entry(architecture, config_path)  # (the registry's error where it lacks the architecture)
        if model_impl == "auto":
            logger.info("model implementation: troupe's own for %s", architecture)
        return "troupe"
    if architecture not in transformers_causal_lms():
        raise ValueError(f"{config_path}: architecture {architecture!r} is neither one troupe runs (supported: "
                         f"{', '.join(MODELS)}) nor a causal LM that transformers implements "
                         "(--model-impl transformers)")
    logger.info("model implementation: the Transformers fallback for %s (transformers' modeling code over "
                "troupe's paged KV cache)", architecture)
    return "transformers"


def transformers_causal_lms() -> frozenset[str]:
    """The ...ForCausalLM classes transformers' AutoModelForCausalLM builds (no remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return frozenset(names)


def fallback_model_config(model_dir: str, config_path: str, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    """The engine's view of a checkpoint the fallback runs: the shape of its KV cache and its
    vocabulary. transformers' config class reads the file, so each family's own key names
    (n_embd, rotary_pct, ...) are resolved as the modeling code resolves them."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    architecture = hf.architectures[0]
    _check_attention(hf, config_path)
    if getattr(hf, "quantization_config", None):
        raise ValueError(f"{config_path}: quantization_config: a quantized checkpoint does not run on the "
                         "Transformers fallback (--model-impl transformers)")
    num_heads = hf.num_attention_heads
    max_positions = getattr(hf, "max_position_embeddings", None)
    if max_positions is None:
        raise ValueError(f"{config_path}: missing 'max_position_embeddings'")
    return ModelConfig(
        model_path=model_dir, architecture=architecture, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=getattr(hf, "intermediate_size", None) or 4 * hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers, num_attention_heads=num_heads,
        # a family without grouped-query attention has no such key: one KV head a query head
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        # the modeling code holds its own norms and rotary embedding: these two are unused
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", None) or getattr(hf, "layer_norm_eps", None) or 1e-6),
        rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=max_positions, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=False, qk_norm=False, eos_token_ids=eos_token_ids,
        bos_token_id=getattr(hf, "bos_token_id", None), model_impl="transformers")


def _check_attention(hf, config_path: str) -> None:
    """What the fallback's attention cannot honour, refused by name: a family whose modeling
    code computes attention itself (ALiBi's Bloom, MPT; Mamba's none) never calls the
    registered function; a window or a soft cap would be dropped without a word."""
    import importlib

    import transformers

    architecture = hf.architectures[0]
    model_class = getattr(transformers, architecture, None)
    if model_class is None or not hasattr(importlib.import_module(model_class.__module__), "ALL_ATTENTION_FUNCTIONS"):
        raise ValueError(f"{config_path}: transformers' {architecture} does not run its attention through "
                         "transformers' attention interface, where the Transformers fallback plugs in")
    window = getattr(hf, "sliding_window", None)
    if window is not None and getattr(hf, "use_sliding_window", True) \
            and window < (getattr(hf, "max_position_embeddings", None) or 0):
        raise ValueError(f"{config_path}: sliding_window={window}: sliding-window attention does not run on the "
                         "Transformers fallback")
    if getattr(hf, "attn_logit_softcapping", None):
        raise ValueError(f"{config_path}: attn_logit_softcapping={hf.attn_logit_softcapping}: soft-capped attention "
                         "does not run on the Transformers fallback")


def check_fallback_engine(model: ModelConfig, *, tensor_parallel_size: int, pipeline_parallel_size: int,
                          enable_lora: bool, quantization: str | None, pooling: bool,
                          draft_model: bool) -> None:
    """Refuses, by name, what the fallback cannot run (ValueError). CUDA graphs and the CPU's
    one-call C++ step are not refused: the fallback's steps run eagerly through its modules."""
    if model.model_impl != "transformers":
        return
    refused = {"tensor_parallel_size": tensor_parallel_size > 1, "pipeline_parallel_size": pipeline_parallel_size > 1,
               "enable_lora": enable_lora, "quantization": quantization is not None, "runner pooling": pooling,
               "speculative_config (draft_model)": draft_model}
    for name, asked in refused.items():
        if asked:
            raise ValueError(f"{name}: {model.architecture} runs on the Transformers fallback (--model-impl "
                             "transformers), which runs one device, unquantized, without LoRA, pooling or a draft "
                             "model")
