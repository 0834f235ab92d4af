"""The model's shape as the engine keeps it (ModelConfig), read from a Hugging Face config.json
by actors/models/loader.py. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

# a field of ModelConfig, which msgspec decodes in every actor process: imported for real
from actors.config.moe import MoeConfig
from actors.config.vision import VisionConfig


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config.json."""

    model_path: str  # a Hugging Face directory (GGUF files are converted to one first)
    architecture: str  # e.g. "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # Hugging Face's rope_scaling dict (Llama-3 "llama3" type), or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    sep_token_id: int | None = None  # an encoder's [SEP] (where a pair's second segment starts)
    vision: VisionConfig | None = None  # a vision-language model's vision side (LLaVA); None: text only
    # each layer's sliding window (0: full attention); empty: every layer full (issue 39)
    sliding_windows: tuple[int, ...] = ()
    # what a family's own config reader keeps beyond the Llama shape (Gemma's soft caps and
    # scalars, Phi-3's LongRoPE): actors/models/hybrid_config.py, read by that family's model
    family: dict | None = None
    # which code runs it (--model-impl, resolved): "troupe" (the registry's) or "transformers"
    # (Hugging Face's modeling code over the paged KV cache: actors/models/transformers_fallback.py)
    model_impl: str = "troupe"
    moe: MoeConfig | None = None  # a mixture-of-experts decoder's experts (actors/models/moe.py); None: dense

    @property
    def can_generate(self) -> bool:
        """It has a language-model head (a bare ...Model body or a classifier has none)."""
        return self.architecture.endswith("ForCausalLM")

    @property
    def is_encoder(self) -> bool:
        """A BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa): bidirectional attention, whole
        prompts, no KV cache (actors/models/encoder.py)."""
        return self.architecture.startswith(("Bert", "Roberta", "XLMRoberta"))
