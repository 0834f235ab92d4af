"""Engine arguments given as a JSON object (--pooler-config, --hf-overrides,
--speculative-config): the text, or a dict from Python, parsed and checked to be an
object. Each caller checks its own keys. Torch-free."""

from __future__ import annotations

import json
from typing import Any


def parse_json_object(value: str | dict[str, Any], name: str) -> dict[str, Any]:
    """value as a dict; ValueError naming the argument for bad JSON or a non-object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value
