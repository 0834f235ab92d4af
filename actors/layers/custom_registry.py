"""Custom logits processors by name: the engine's allow-list (--logits-processors, as
vLLM V1's) and how a name becomes the callable a worker runs.

A request's SamplingParams.logits_processors holds callables only in the caller's own
process (the offline LLM, whose sampler runs there). Across processes a processor is its
qualified name, "package.module:function" (or "package.module.function"), and only a name
the engine was started with is accepted: the input processor refuses any other (400
naming logits_processors) and a worker imports only the allow-list, once, at start-up. So
no request chooses what code a worker imports, and nothing a message carries is
unpickled (messages/common.py refuses bytes when a message is decoded).

A name that resolves to a class is made once per request (a fresh instance, with fresh
state); anything else callable is called as it is. Torch-free: the launcher checks the
allow-list before anything starts."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from messages.common import SamplingParams, processor_name
from messages.errors import InvalidRequestError

_FIELD = "logits_processors"


def canonical_name(name: str) -> str:
    """"a.b:c" as it is, "a.b.c" as "a.b:c": one spelling per processor."""
    if ":" in name:
        return name
    module, _, attribute = name.rpartition(".")
    if not module:
        raise ValueError(f"{_FIELD}: {name!r} is no qualified name; write 'package.module:function'")
    return f"{module}:{attribute}"


def import_processor(name: str) -> Callable[..., Any]:
    """The object a qualified name names (ValueError naming the engine argument when it
    cannot be imported or is not callable)."""
    module_name, _, attribute = canonical_name(name).partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{_FIELD}: cannot import {name!r} ({error})") from None
    if not callable(target):
        raise ValueError(f"{_FIELD}: {name!r} is not callable")
    return target


def allow_list(entries: Iterable[str | Callable] | None) -> tuple[str, ...]:
    """The engine argument as canonical names, each checked importable here (the launcher),
    so a typo stops the start-up instead of every request that names it."""
    if entries is None:
        return ()
    if isinstance(entries, str):
        entries = [entries]
    names = []
    for entry in entries:
        try:
            name = canonical_name(entry) if isinstance(entry, str) else processor_name(entry)
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None
        import_processor(name)
        names.append(name)
    return tuple(dict.fromkeys(names))


def check_allowed(params: SamplingParams, allowed: tuple[str, ...]) -> None:
    """InvalidRequestError naming logits_processors for a named processor the engine does
    not allow (callables are the caller's own, in its process: the offline LLM's)."""
    for entry in params.logits_processors or ():
        if isinstance(entry, str) and canonical_name(entry) not in allowed:
            hint = f"one of {', '.join(allowed)}" if allowed else "none (start it with --logits-processors NAME ...)"
            raise InvalidRequestError(f"{_FIELD}: {entry!r} is not allowed by this engine; it allows {hint}",
                                      param=_FIELD)


class ProcessorRegistry:
    """A worker's allowed processors, imported once at start-up."""

    def __init__(self, allowed: tuple[str, ...]) -> None:
        self.targets = {name: import_processor(name) for name in allowed}

    def resolve(self, entry: str | Callable) -> Callable[..., Any] | None:
        """The callable for one entry of a request's list: a fresh instance of a named
        class, a named function, or a callable of this process; None when not allowed."""
        if not isinstance(entry, str):
            return entry
        target = self.targets.get(canonical_name(entry))
        if target is None:
            return None
        return target() if isinstance(target, type) else target
