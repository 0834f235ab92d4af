"""The model registry: which code runs each architecture (config.json's
`architectures[0]`), as (module, class), imported on first use — vLLM's
model_executor/models/registry.py. Adding a model family is a file in actors/models/ and
a line here; nothing else dispatches on the architecture's name.

Three kinds, which the rest of the engine branches on (never on a name):
- "decoder": a text decoder the worker runs over the paged KV cache. Each family's
  ...ForCausalLM, its bare ...Model body (what sentence-transformers saves of a decoder
  embedder) and its ...ForSequenceClassification (the body, then a score head:
  actors/pooling/classifier.py).
- "encoder": a BERT-family encoder over whole prompts, no KV cache (bert.py; its
  ModelConfig is read by bert_config.py, its step is encoder.py).
- "vision": a vision-language model; the class is its vision side's runner in the worker
  (vision_runner.py for LLaVA with a CLIP or SigLIP tower, qwen2_vl.py), and the text
  decoder it wraps is itself a "decoder" here (config/vision.py splits the two configs).

An architecture that is not here fails at start-up (the loader, in the launching process),
naming it and the supported ones, unless --model-impl lets the Transformers fallback run it
(transformers_config.py)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    kind: str  # "decoder" | "encoder" | "vision"
    module: str  # the module that holds it, imported on first use
    class_name: str


_DECODER_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")  # (sliding windows: hybrid_config.py)
_LLAMA = ModelEntry("decoder", "actors.models.llama", "LlamaModel")
_BERT = ModelEntry("encoder", "actors.models.bert", "BertModel")
_GEMMA = ModelEntry("decoder", "actors.models.gemma", "GemmaModel")  # Gemma 2 and 3 (text)
# mixture-of-experts decoders (actors/models/moe.py; their experts' shape: moe_config.py)
_MOE = ModelEntry("decoder", "actors.models.moe", "MoeModel")

# architecture -> its entry, in the order an error lists them
MODELS: dict[str, ModelEntry] = {
    **{f"{family}{kind}": _LLAMA for kind in ("ForCausalLM", "Model", "ForSequenceClassification")
       for family in _DECODER_FAMILIES},
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "Phi3ForCausalLM": ModelEntry("decoder", "actors.models.phi3", "Phi3Model"),
    **{f"{family}ForCausalLM": _MOE for family in ("Qwen3Moe", "Qwen2Moe", "Mixtral", "Olmoe")},
    # GPT-OSS: experts with biases and a clamped SwiGLU, MXFP4 or float; attention sinks
    "GptOssForCausalLM": ModelEntry("decoder", "actors.models.gpt_oss", "GptOssModel"),
    **{f"{family}{kind}": _BERT for family in ("Bert", "Roberta", "XLMRoberta")
       for kind in ("Model", "ForSequenceClassification")},
    "LlavaForConditionalGeneration": ModelEntry("vision", "actors.models.vision_runner", "VisionRunner"),
    "Qwen2VLForConditionalGeneration": ModelEntry("vision", "actors.models.qwen2_vl", "Qwen2VLRunner"),
    "Qwen2_5_VLForConditionalGeneration": ModelEntry("vision", "actors.models.qwen2_vl", "Qwen2VLRunner"),
}


def model_entry(architecture: str | None, config_path: str = "") -> ModelEntry:
    """The registry's entry of an architecture; ValueError naming it and the supported ones."""
    entry = MODELS.get(architecture) if architecture is not None else None
    if entry is None:
        where = f"{config_path}: " if config_path else ""
        raise ValueError(f"{where}architecture {architecture!r} is not supported (supported: {', '.join(MODELS)})")
    return entry


def architectures(kind: str) -> tuple[str, ...]:
    """The registered architectures of one kind ("decoder", "encoder", "vision")."""
    return tuple(name for name, entry in MODELS.items() if entry.kind == kind)


# --model-impl transformers: Hugging Face's modeling code over the paged KV cache, for any
# causal LM transformers implements (transformers_config.py decides at start-up)
TRANSFORMERS_FALLBACK = ModelEntry("decoder", "actors.models.transformers_fallback", "TransformersModel")


def model_class(architecture: str, model_impl: str = "troupe") -> type:
    """The class that runs an architecture (model_impl: ModelConfig's, resolved), its module
    imported now (torch with it)."""
    entry = TRANSFORMERS_FALLBACK if model_impl == "transformers" else model_entry(architecture)
    return getattr(importlib.import_module(entry.module), entry.class_name)
