"""Which runner an engine is, from its arguments and its model: vLLM's --runner, --convert
and older --task select pooling, and a checkpoint that cannot generate (a
...ForSequenceClassification, or a bare ...Model body as sentence-transformers saves a
decoder embedder) pools by itself. Torch-free: EngineArgs.build() and the launcher's flag
checks run it."""

from __future__ import annotations

import json

from actors.config import ModelConfig
from actors.pooling.config import PoolerConfig, parse_pooler_config_override, read_pooler_config
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


def pooler_for(model: ModelConfig, runner: str, convert: str, task: str,
               pooler_config: str | dict | None) -> PoolerConfig | None:
    """The model's PoolerConfig when the engine runs pooling requests, None when it generates."""
    architecture = model.architecture
    is_classifier = architecture.endswith("ForSequenceClassification")
    cannot_generate = is_classifier or architecture.endswith("Model")
    pooling_task = _pooling_task(convert, task)
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
                         "(a ...ForSequenceClassification checkpoint has)")
    override = pooler_override(pooler_config) if pooler_config is not None else None
    try:
        return read_pooler_config(model.model_path, pooling_task, override)
    except ValueError as error:
        raise ValueError(f"pooler_config: {error}") from None


def _pooling_task(convert: str, task: str) -> str | None:
    by_convert = convert if convert in ("embed", "classify") else None
    by_task = _TASK_CONVERSIONS.get(task)
    if by_convert and by_task and by_convert != by_task:
        raise ValueError(f"convert {convert!r} and task {task!r} disagree")
    return by_convert or by_task
