"""The frontend's link to its input processors, and what happens when one dies.

An input processor parses what clients send (chat templates, images), so it is the actor
most exposed to hostile input; its death must cost only the requests it held. The frontend
sends each request to one input processor's own inbox (the one holding the fewest), and
that processor acknowledges it (RequestTokenized) once the request has left it, for the
scheduler, or was refused. So when one dies the frontend knows exactly which requests died
with it: those fail with EngineRequestError (HTTP 500) naming the cause; the others, queued
in the scheduler or held by another processor, go on. The supervisor starts a new process
under the same name and address, and requests sent meanwhile wait in the frontend's queue
to it. A processor that keeps dying (MAX_RESTARTS within RESTART_WINDOW_S) ends the engine,
as the death of any other actor does (a worker's death stays fatal: the KV cache dies with it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from actors.errors import EngineDeadError, EngineRequestError
from messages.input_processor import AddRequest
from messages.transport import Outbox, Sockets

logger = logging.getLogger(__name__)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class InputRouter:
    """Which input processor holds which request, until it acknowledges it."""

    def __init__(self, sockets: Sockets, addresses: dict[str, str], names: list[str]) -> None:
        # connected to each processor's inbox: messages sent while it restarts wait here
        self.outboxes: dict[str, Outbox] = {name: sockets.outbox(addresses[name]) for name in names}
        self.held: dict[str, set[str]] = {name: set() for name in names}  # processor -> request ids it holds
        self.holder: dict[str, str] = {}  # request_id -> its processor
        self.last_error: dict[str, str] = {}  # processor -> what it said before it died (ActorFailed)
        self._restarts: dict[str, deque[float]] = {name: deque() for name in names}
        self._turn = 0  # ties go round the processors

    def owns(self, name: str) -> bool:
        return name in self.outboxes

    def send(self, request: AddRequest) -> None:
        names = list(self.outboxes)
        self._turn = (self._turn + 1) % len(names)
        name = min(names[self._turn:] + names[:self._turn], key=lambda n: len(self.held[n]))
        self.outboxes[name].send(request)
        self.held[name].add(request.request_id)
        self.holder[request.request_id] = name

    def forget(self, request_id: str) -> None:
        """The request has left its processor (acknowledged, refused, or abandoned)."""
        name = self.holder.pop(request_id, None)
        if name is not None:
            self.held[name].discard(request_id)

    def died(self, name: str, returncode: int | None) -> tuple[list[str], str]:
        """The requests that died with processor `name`, and why, for their errors."""
        lost = sorted(self.held[name])
        for request_id in lost:
            del self.holder[request_id]
        self.held[name] = set()
        said = self.last_error.pop(name, None)
        cause = f"the input processor {name} exited with code {returncode}" + (f" ({said})" if said else "")
        return lost, cause

    def may_restart(self, name: str) -> bool:
        """Whether a new one may start now: fewer than MAX_RESTARTS in RESTART_WINDOW_S."""
        now = time.monotonic()
        restarts = self._restarts[name]
        while restarts and now - restarts[0] > RESTART_WINDOW_S:
            restarts.popleft()
        if len(restarts) >= MAX_RESTARTS:
            return False
        restarts.append(now)
        return True


class ActorExits:
    """AsyncClient's answer to an actor process's exit: a new input processor (above), or,
    for any other actor, the end of the engine (every pending call fails)."""

    def _on_actor_exit(self, name: str, returncode: int | None) -> None:
        inputs = self._inputs
        if returncode != 0 and self._dead is None and inputs is not None and inputs.owns(name) \
                and inputs.may_restart(name):
            self._restart_input_processor(name, returncode)
            return
        if returncode == 0:  # it was told to stop (a signal to every process, as a service manager sends)
            logger.info("actor %s stopped (exit code 0); the engine stops with it", name)
        else:
            logger.error("actor %s exited with code %s; failing every request", name, returncode)
        self._fail_all(EngineDeadError(f"actor {name} exited with code {returncode}"))
        if self.processes is not None:
            asyncio.ensure_future(self.processes.stop())

    def _restart_input_processor(self, name: str, returncode: int | None) -> None:
        lost, cause = self._inputs.died(name, returncode)
        logger.error("%s; failing the %d requests it held, starting a new one", cause, len(lost))
        for request_id in lost:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.queue.put_nowait(EngineRequestError(f"{cause} while it held this request"))
            self._send_abort(request_id)  # (it may have passed the request on just before)
        self.processes.restart(name, self._on_actor_exit)
