"""Grammars compiled before their requests are scheduled (the worker's side of CompileGrammar).

A grammar can take seconds to compile (a JSON schema of 1,200 property names: ~3 s on two
cores), and a step that waited for one stalled every request in it. So the scheduler holds
a structured request until the worker that samples says its grammar is ready: the worker
starts the compile on its compile threads (StructuredOutputs.precompile, at the lowest CPU
priority) and answers GrammarCompiled when it is done, with the backend's error when it
failed, or with a timeout error once it has taken longer than --grammar-compile-timeout
(the compile itself runs on to its end, at that priority, and is kept for a request that
repeats the constraint). Until then the actor's loop checks the compiles every few ms."""

from __future__ import annotations

import time
from concurrent.futures import Future

from actors.config.structured_output import compile_timed_out
from messages.errors import InvalidRequestError
from messages.scheduler import GrammarCompiled
from messages.structured_outputs import StructuredOutputsParams

_CHECK_EVERY_S = 0.005  # how often a worker with compiles pending looks at them


class PendingCompiles:
    """The compiles a worker owes the scheduler an answer for."""

    def __init__(self, structured, timeout: float) -> None:
        self.structured = structured  # the sampler's StructuredOutputs processor
        self.timeout = timeout
        # (request_id, constraint, its compile, the time its answer is due)
        self.pending: list[tuple[str, StructuredOutputsParams, Future, float]] = []

    def add(self, request_id: str, constraint: StructuredOutputsParams) -> None:
        future = self.structured.precompile(constraint)
        self.pending.append((request_id, constraint, future, time.monotonic() + self.timeout))

    def has_answers(self) -> bool:
        now = time.monotonic()
        return any(future.done() or now >= deadline for _, _, future, deadline in self.pending)

    def wake_after(self) -> float | None:
        return _CHECK_EVERY_S if self.pending else None

    def take_answers(self) -> list[GrammarCompiled]:
        """The answers due now: done compiles and those past their time."""
        now, answers, still = time.monotonic(), [], []
        for entry in self.pending:
            request_id, constraint, future, deadline = entry
            if future.done():
                answers.append(_answer(request_id, future))
            elif now >= deadline:
                error = compile_timed_out(constraint, self.timeout)
                answers.append(GrammarCompiled(request_id, str(error), error.param))
            else:
                still.append(entry)
        self.pending = still
        return answers


def _answer(request_id: str, future: Future) -> GrammarCompiled:
    error = future.exception()
    if error is None:
        return GrammarCompiled(request_id)
    if isinstance(error, InvalidRequestError):  # the backend found the constraint invalid
        return GrammarCompiled(request_id, str(error), error.param or "structured_outputs")
    return GrammarCompiled(request_id, f"structured_outputs: the grammar backend failed ({type(error).__name__}: "
                                       f"{error})", "structured_outputs")
