"""How a pooling model turns its final hidden states into an output: which rows it pools
(PoolerConfig.pooling_type), whether it L2-normalises an embedding, which activation turns
classification logits into scores, and whether the model was trained for Matryoshka
truncation (a request's `dimensions`).

The configuration comes from, in this order (a later source wins):
1. defaults by architecture, as vLLM's: a BERT-family encoder pools its CLS row, a decoder
   (Llama, Mistral, Qwen2, Qwen3) its last prompt row; embeddings are normalised;
   classification uses sigmoid for one label and softmax otherwise, sigmoid for a
   `problem_type` of "multi_label_classification";
2. sentence-transformers files (modules.json, 1_Pooling/config.json, a Normalize module) for
   an embedding model, and the activation a CrossEncoder saved for a classifier;
3. the `--pooler-config` JSON override (parse_pooler_config_override).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Literal

from actors.config.json_flags import parse_json_object

Task = Literal["embed", "classify"]
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
ACTIVATIONS = ("softmax", "sigmoid", None)

# config.json model_type of the encoder-only families: bidirectional attention, CLS pooling.
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "electra")
# config.json model_type of the decoders whose embedding is the last prompt token's state.
DECODER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# sentence-transformers module classes (the last part of modules.json's "type", old
# `sentence_transformers.models.X` and new `sentence_transformers.base.modules.x.X` alike)
# that change nothing at inference, beyond the Pooling and Normalize this module reads.
_NEUTRAL_MODULES = ("Transformer", "Dropout")
# 1_Pooling/config.json: the pooling_mode values (6.x) and boolean keys (before 6.x) we run.
_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                        "pooling_mode_lasttoken": "LAST"}
_LEGACY_REFUSED_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
# CrossEncoder's saved activation_fn (a torch class path) in our vocabulary.
_TORCH_ACTIVATIONS = {"Sigmoid": "sigmoid", "Softmax": "softmax", "Identity": None}
_OVERRIDE_KEYS = ("pooling_type", "normalize", "activation", "is_matryoshka", "matryoshka_dimensions")


@dataclass(frozen=True)
class PoolerConfig:
    task: Task
    pooling_type: str  # one of POOLING_TYPES: the rows of a prompt that make its output
    normalize: bool  # L2-normalise an embedding (after any Matryoshka truncation)
    activation: str | None  # one of ACTIVATIONS, applied to classification logits; None: raw logits
    num_labels: int | None  # classification outputs; None for an embedding model
    is_matryoshka: bool  # the model was trained so that a prefix of its embedding is one too
    matryoshka_dimensions: tuple[int, ...] | None  # the prefix lengths it was trained for; None: any
    # sentence-transformers (6 on) renders a text as a one-message chat with the tokenizer's
    # template when the model's Transformer module takes "message" input: an embedding
    # request's text then goes through the template too, so the two embed the same tokens
    text_as_chat: bool = False
    # a causal LM made a classifier from its LM head (vLLM's hf_overrides classifier_from_token):
    # these tokens' rows are the labels; two_way: one label, the rows' difference (Qwen3-Reranker)
    classifier_from_token: tuple[str, ...] | None = None
    two_way: bool = False


def read_pooler_config(model_dir: str, task: Task, override: dict[str, object] | None = None) -> PoolerConfig:
    """The PoolerConfig of a Hugging Face (or sentence-transformers) directory for a task,
    with `override` (parse_pooler_config_override's result) merged over it."""
    if task not in ("embed", "classify"):
        raise ValueError(f"task must be 'embed' or 'classify', got {task!r}")
    hf_config = _read_json(os.path.join(model_dir, "config.json"))
    matryoshka_dimensions = hf_config.get("matryoshka_dimensions")
    fields: dict[str, object] = {
        "task": task,
        "normalize": task == "embed",
        "activation": None,
        "num_labels": None,
        # vLLM's rule: a model with listed dimensions is Matryoshka whatever is_matryoshka says.
        "is_matryoshka": bool(hf_config.get("is_matryoshka", False)) or bool(matryoshka_dimensions),
        "matryoshka_dimensions": tuple(matryoshka_dimensions) if matryoshka_dimensions else None,
    }
    if task == "embed":
        fields.update(_read_sentence_transformers_modules(model_dir))
    if "pooling_type" not in fields:
        # the architecture's default only when no Pooling module chose: a sentence-transformers
        # model of a family we have no default for still says how it pools
        fields["pooling_type"] = _default_pooling_type(hf_config, model_dir)
    if task == "classify":
        num_labels = _num_labels(hf_config)
        fields["num_labels"] = num_labels
        fields["activation"] = _classify_activation(hf_config, model_dir, num_labels)
    config = PoolerConfig(**fields)
    return merge_pooler_config(config, override or {})


def parse_pooler_config_override(text: str) -> dict[str, object]:
    """The fields of a `--pooler-config` JSON object, e.g. '{"pooling_type": "MEAN",
    "normalize": false}', checked; ValueError naming any unknown key or bad value."""
    override = parse_json_object(text, "--pooler-config")
    unknown = sorted(set(override) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--pooler-config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(_OVERRIDE_KEYS)})")
    if "pooling_type" in override:
        pooling_type = override["pooling_type"]
        if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {pooling_type!r}")
        override["pooling_type"] = pooling_type.upper()
    for key in ("normalize", "is_matryoshka"):
        if key in override and not isinstance(override[key], bool):
            raise ValueError(f"--pooler-config: {key} must be true or false, got {override[key]!r}")
    if "activation" in override and override["activation"] not in ACTIVATIONS:
        raise ValueError(f"--pooler-config: activation must be \"softmax\", \"sigmoid\" or null, "
                         f"got {override['activation']!r}")
    if "matryoshka_dimensions" in override:
        dimensions = override["matryoshka_dimensions"]
        if dimensions is not None:
            if not isinstance(dimensions, list) or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dimensions):
                raise ValueError("--pooler-config: matryoshka_dimensions must be a list of positive integers "
                                 f"or null, got {dimensions!r}")
            override["matryoshka_dimensions"] = tuple(dimensions)
    return override


def merge_pooler_config(config: PoolerConfig, override: dict[str, object]) -> PoolerConfig:
    """config with the checked fields of an override replacing its own."""
    merged = dataclasses.replace(config, **override)
    if merged.task == "classify" and merged.pooling_type == "ALL":
        raise ValueError("--pooler-config: pooling_type ALL gives one row per token, "
                         "which a classifier head cannot score; use LAST, CLS or MEAN")
    if override.get("matryoshka_dimensions") and "is_matryoshka" not in override:
        merged = dataclasses.replace(merged, is_matryoshka=True)
    return merged


def check_dimensions(config: PoolerConfig, dimensions: int | None, hidden_size: int | None = None) -> None:
    """ValueError naming `dimensions` when a request's embedding size is one this model
    cannot give (vLLM's rules: only a Matryoshka model may truncate, only to a trained size)."""
    if dimensions is None:
        return
    if config.task != "embed":
        raise ValueError("dimensions applies to embeddings only, not to classification")
    if not config.is_matryoshka:
        raise ValueError("dimensions: this model does not support Matryoshka representation; "
                         "truncating its embeddings would give poor results")
    if dimensions < 1:
        raise ValueError(f"dimensions must be at least 1, got {dimensions}")
    if config.matryoshka_dimensions and dimensions not in config.matryoshka_dimensions:
        raise ValueError(f"dimensions must be one of {list(config.matryoshka_dimensions)} for this model, "
                         f"got {dimensions}")
    if hidden_size is not None and dimensions > hidden_size:
        raise ValueError(f"dimensions must be at most the embedding size {hidden_size}, got {dimensions}")


def class_labels(model_dir: str, num_labels: int) -> list[str]:
    """A classifier's label names by class index: config.json's id2label (its keys are the
    indices as strings), else transformers' default "LABEL_<i>"."""
    config_path = os.path.join(model_dir, "config.json")
    id2label = (_read_json(config_path).get("id2label") or {}) if os.path.isfile(config_path) else {}
    return [str(id2label.get(str(index), f"LABEL_{index}")) for index in range(num_labels)]


# -- reading the files ---------------------------------------------------------------------

def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    with open(path) as json_file:
        return json.load(json_file)


def _default_pooling_type(hf_config: dict, model_dir: str) -> str:
    model_type = hf_config.get("model_type")
    if model_type in ENCODER_MODEL_TYPES:
        return "CLS"  # BERT's [CLS] row, which its pretraining and pooler are built around
    if model_type in DECODER_MODEL_TYPES:
        return "LAST"  # causal attention: only the last row has seen the whole prompt
    raise ValueError(f"{model_dir}/config.json: model_type {model_type!r} has no default pooling "
                     f"(encoders: {', '.join(ENCODER_MODEL_TYPES)}; decoders: {', '.join(DECODER_MODEL_TYPES)})")


def _read_sentence_transformers_modules(model_dir: str) -> dict[str, object]:
    """pooling_type and normalize from a sentence-transformers directory; {} for a plain one."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return {}
    fields: dict[str, object] = {"normalize": False}  # sentence-transformers normalises only in a module
    for module in _read_json(modules_path):
        class_name = module["type"].rsplit(".", 1)[-1]
        if class_name == "Pooling":
            fields["pooling_type"] = _pooling_type(os.path.join(model_dir, module["path"], "config.json"))
        elif class_name == "Transformer":
            fields["text_as_chat"] = _takes_messages(os.path.join(model_dir, module["path"]))
        elif class_name == "Normalize":
            fields["normalize"] = True
        elif class_name == "Dense":
            # A Dense module projects the pooled vector through weights of its own; pooling
            # without it would give vectors of another space that still look plausible.
            raise ValueError(f"{modules_path}: module {module['path']!r} is a Dense projection, "
                             "which is not supported (its output would differ from sentence-transformers')")
        elif class_name not in _NEUTRAL_MODULES:
            raise ValueError(f"{modules_path}: module type {module['type']!r} is not supported")
    return fields


def _takes_messages(module_dir: str) -> bool:
    """Whether a saved Transformer module declares the "message" modality (sentence_bert_config.json)."""
    path = os.path.join(module_dir, "sentence_bert_config.json")
    return os.path.isfile(path) and "message" in (_read_json(path).get("modality_config") or {})


def _pooling_type(pooling_config_path: str) -> str:
    pooling_config = _read_json(pooling_config_path)
    if not pooling_config.get("include_prompt", True):
        # we pool every prompt token; excluding an instruction prefix needs its length per request
        raise ValueError(f"{pooling_config_path}: include_prompt false is not supported")
    if "pooling_mode" in pooling_config:
        modes = pooling_config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        refused = [key for key in _LEGACY_REFUSED_KEYS if pooling_config.get(key)]
        modes = refused + [key for key in _LEGACY_POOLING_KEYS if pooling_config.get(key)]
        if not modes:
            modes = ["mean"]  # sentence-transformers' default when no key is set
    if len(modes) != 1 or (modes[0] not in _POOLING_MODES and modes[0] not in _LEGACY_POOLING_KEYS):
        raise ValueError(f"{pooling_config_path}: pooling mode {' + '.join(modes)} is not supported "
                         "(supported: exactly one of cls, mean, lasttoken)")
    return _POOLING_MODES.get(modes[0]) or _LEGACY_POOLING_KEYS[modes[0]]


def _num_labels(hf_config: dict) -> int:
    if "num_labels" in hf_config:
        return int(hf_config["num_labels"])
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return 2  # transformers' PretrainedConfig default


def _classify_activation(hf_config: dict, model_dir: str, num_labels: int) -> str | None:
    saved = _cross_encoder_activation(hf_config, model_dir)
    if saved is not None:
        class_name = saved.rsplit(".", 1)[-1]
        if class_name not in _TORCH_ACTIVATIONS:
            raise ValueError(f"{model_dir}: CrossEncoder activation_fn {saved!r} is not supported "
                             f"(supported: {', '.join(_TORCH_ACTIVATIONS)})")
        return _TORCH_ACTIVATIONS[class_name]
    if hf_config.get("problem_type") == "multi_label_classification":
        return "sigmoid"  # independent labels: each its own probability
    return "sigmoid" if num_labels == 1 else "softmax"


def _cross_encoder_activation(hf_config: dict, model_dir: str) -> str | None:
    """The torch class path a CrossEncoder saved as its activation, wherever its version put
    it: config_sentence_transformers.json (6.x), config.json's sentence_transformers (4.x-5.x),
    config.json's sbert_ce_default_activation_function (before 4.0)."""
    st_config_path = os.path.join(model_dir, "config_sentence_transformers.json")
    if os.path.isfile(st_config_path):
        st_config = _read_json(st_config_path)
        if st_config.get("activation_fn"):
            return st_config["activation_fn"]
    nested = hf_config.get("sentence_transformers") or {}
    return nested.get("activation_fn") or hf_config.get("sbert_ce_default_activation_function")
