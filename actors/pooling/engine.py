"""Which runner an engine is, from its arguments and its model: vLLM's --runner, --convert
and older --task select pooling, and a checkpoint that cannot generate (a
...ForSequenceClassification, or a bare ...Model body as sentence-transformers saves a
decoder embedder) pools by itself. Torch-free: EngineArgs.build() and the launcher's flag
checks run it."""

from __future__ import annotations

import dataclasses
import json

from actors.config import ModelConfig
from actors.config.json_flags import parse_json_object
from actors.config.pooler import PoolerConfig, parse_pooler_config_override, read_pooler_config
from messages.common import SamplingParams

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's older --task: the pooling tasks select the pooling runner with that conversion
TASKS = ("auto", "generate", "embed", "classify", "score")
_TASK_CONVERSIONS = {"embed": "embed", "classify": "classify", "score": "classify"}
# what a pooling request carries where a generation request has its sampling parameters
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)


def check_pooling_args(runner: str, convert: str, task: str, pooler_config: str | dict | None) -> None:
    """ValueError naming the field, for what needs no model."""
    for name, value, allowed in (("runner", runner, RUNNERS), ("convert", convert, CONVERTS), ("task", task, TASKS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    pooling_task = _pooling_task(convert, task)
    if pooling_task is not None and (runner == "generate" or task == "generate"):
        raise ValueError(f"convert/task {pooling_task!r} makes a pooling model; it conflicts with runner 'generate'")
    if pooler_config is not None:
        pooler_override(pooler_config)


def pooler_override(pooler_config: str | dict) -> dict[str, object]:
    """The checked fields of pooler_config (a JSON text, or a dict from Python)."""
    if isinstance(pooler_config, dict):
        pooler_config = json.dumps(pooler_config)
    if not isinstance(pooler_config, str):
        raise ValueError(f"pooler_config must be a JSON object or a dict, got {type(pooler_config).__name__}")
    return parse_pooler_config_override(pooler_config)


# the hf_overrides keys troupe runs: vLLM's way to serve a causal LM as a classifier from its
# LM head's rows of some tokens (e.g. Qwen3-Reranker: ["no", "yes"], a 2-way softmax)
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "method", "is_original_qwen3_reranker")


def parse_hf_overrides(hf_overrides: str | dict | None) -> dict[str, object]:
    """The checked hf_overrides (JSON text or a dict); ValueError naming what troupe does not run."""
    if hf_overrides is None:
        return {}
    overrides = parse_json_object(hf_overrides, "hf_overrides")
    unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"hf_overrides: {', '.join(unknown)} not supported (supported: {', '.join(HF_OVERRIDE_KEYS)})")
    architectures = overrides.get("architectures")
    if architectures is not None and (not isinstance(architectures, list) or len(architectures) != 1):
        raise ValueError("hf_overrides: architectures must be a list of one architecture name")
    tokens = overrides.get("classifier_from_token")
    if tokens is not None and (not isinstance(tokens, list) or not tokens or
                               not all(isinstance(token, str) and token for token in tokens)):
        raise ValueError("hf_overrides: classifier_from_token must be a list of token strings")
    method = overrides.get("method")
    if method not in (None, "from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"hf_overrides: method must be from_2_way_softmax or no_post_processing, got {method!r}")
    two_way = method == "from_2_way_softmax" or bool(overrides.get("is_original_qwen3_reranker"))
    if two_way and (tokens is None or len(tokens) != 2):
        raise ValueError("hf_overrides: a 2-way softmax needs classifier_from_token of two tokens (false, true)")
    return overrides


def override_architecture(model: ModelConfig, architecture: str) -> ModelConfig:
    """The model read as another architecture of its family (hf_overrides' architectures)."""
    from actors.models.loader import SUPPORTED_ARCHITECTURES

    family = model.architecture.split("For")[0].removesuffix("Model")
    if architecture not in SUPPORTED_ARCHITECTURES or not architecture.startswith(family):
        raise ValueError(f"hf_overrides: architectures {architecture!r} is not a supported architecture of the "
                         f"{model.architecture} family")
    return dataclasses.replace(model, architecture=architecture)


def pooler_for(model: ModelConfig, runner: str, convert: str, task: str,
               pooler_config: str | dict | None, hf_overrides: dict[str, object] | None = None) -> PoolerConfig | None:
    """The model's PoolerConfig when the engine runs pooling requests, None when it generates."""
    architecture = model.architecture
    tokens = (hf_overrides or {}).get("classifier_from_token")
    is_classifier = architecture.endswith("ForSequenceClassification") or tokens is not None
    cannot_generate = architecture.endswith(("ForSequenceClassification", "Model"))
    pooling_task = _pooling_task(convert, task) or ("classify" if tokens is not None else None)
    generate = runner == "generate" or task == "generate"
    if generate and cannot_generate:
        raise ValueError(f"runner: {architecture} has no language-model head, so it cannot generate text; "
                         "run it with runner 'pooling'")
    if generate or (runner == "auto" and pooling_task is None and not cannot_generate):
        if pooler_config is not None:
            raise ValueError("pooler_config applies to pooling models; add runner 'pooling'")
        return None
    if pooling_task is None:
        pooling_task = "classify" if is_classifier else "embed"
    if pooling_task == "classify" and not is_classifier:
        raise ValueError(f"convert: classification needs a score head, and a {architecture} checkpoint has none "
                         "(a ...ForSequenceClassification checkpoint has; or hf_overrides classifier_from_token)")
    override = pooler_override(pooler_config) if pooler_config is not None else None
    try:
        config = read_pooler_config(model.model_path, pooling_task, override)
    except ValueError as error:
        raise ValueError(f"pooler_config: {error}") from None
    if tokens is None:
        return config
    two_way = hf_overrides.get("method") == "from_2_way_softmax" or bool(hf_overrides.get("is_original_qwen3_reranker"))
    num_labels = 1 if two_way else len(tokens)
    activation = None if hf_overrides.get("method") == "no_post_processing" else \
        ("sigmoid" if num_labels == 1 else "softmax")
    return dataclasses.replace(config, task="classify", num_labels=num_labels, activation=activation,
                               classifier_from_token=tuple(tokens), two_way=two_way)


def _pooling_task(convert: str, task: str) -> str | None:
    by_convert = convert if convert in ("embed", "classify") else None
    by_task = _TASK_CONVERSIONS.get(task)
    if by_convert and by_task and by_convert != by_task:
        raise ValueError(f"convert {convert!r} and task {task!r} disagree")
    return by_convert or by_task
