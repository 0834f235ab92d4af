"""LLM's and AsyncClient's signatures: EngineArgs's fields as their keyword arguments."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from actors.engine.args import EngineArgs


def takes_engine_args(init: Callable) -> Callable:
    """Decorates an __init__(self, model=None, ..., **engine_args): help() and inspect show
    EngineArgs's fields in place of **engine_args, keyword-only, with their defaults."""
    signature = inspect.signature(init)
    kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    engine = [inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default,
                                annotation=spec.type)
              for spec in dataclasses.fields(EngineArgs) if spec.name not in signature.parameters]
    init.__signature__ = signature.replace(parameters=kept + engine)
    return init
