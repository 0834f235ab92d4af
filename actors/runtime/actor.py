"""The actor base: one asyncio loop, one inbox, outboxes named after their peers.

The loop lives here once. Idle, it blocks on the inbox (up to wake_after() seconds when
the actor has set a timer); busy (has_work()), it drains
whatever is queued, dispatches each message to handle(), then calls step(). Handlers
and steps are plain synchronous methods: an actor's work is CPU work and sends that
never block, and anything asynchronous would only add latency to the hot path.

Every actor binds its inbox at addresses[name], so the launcher can reach each one and
a signal handler can enqueue a Shutdown to its own inbox: shutdown is an ordinary
message, handled between two steps like any other.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import msgspec

from actors.config import EngineConfig
from messages.common import Ping, Shutdown
from messages.frontend import ActorReady, Pong
from messages.transport import Inbox, Outbox, Sockets

logger = logging.getLogger(__name__)


class ActorSpec(msgspec.Struct, kw_only=True):
    """What the launcher tells a new actor process: who it is and where its peers are."""

    kind: str  # "input_processor" | "scheduler" | "worker" | "detokenizer"
    name: str  # unique in the engine: "scheduler", "worker0", "input_processor1", ...
    addresses: dict[str, str]  # actor name -> the address its inbox binds; "frontend" too
    engine: EngineConfig | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # actor-specific settings
    log_level: str = "WARNING"
    secret: bytes | None = None  # the engine's: its tcp sockets authenticate with it (messages/engine_auth.py)


class Actor:
    """Subclasses set inbox_type, open their outboxes in __init__, and implement handle()
    (and has_work()/step() when they do work beyond answering messages)."""

    inbox_type: Any = Shutdown

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets) -> None:
        self.name = name
        self.addresses = addresses
        self.sockets = sockets
        self.inbox: Inbox = sockets.inbox(addresses[name], self.inbox_type, bind=True)
        if f"{name}@tcp" in addresses:  # also reached from other nodes' Ray workers (actors/engine/ray_executor.py)
            self.inbox.also(addresses[f"{name}@tcp"], bind=True)
        self.to_frontend: Outbox = sockets.outbox(addresses["frontend"])
        self._to_self: Outbox = sockets.outbox(addresses[name])
        self.stopping = False

    # ---- what subclasses implement ----

    def handle(self, message: Any) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Whether step() should run now (without waiting for a message)."""
        return False

    def step(self) -> None:
        """One unit of work, called when has_work() after the inbox is drained."""

    def wake_after(self) -> float | None:
        """Seconds after which has_work() may turn true with no message (a timer), or None."""
        return None

    def ready_info(self) -> dict[str, Any]:
        """Extra facts for the launcher, sent with ActorReady."""
        return {}

    def close(self) -> None:
        """Releases what the actor holds beyond its sockets."""

    # ---- the loop ----

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._enqueue_shutdown, signal.Signals(signum).name)
        self.to_frontend.send(ActorReady(name=self.name, pid=os.getpid(), info=self.ready_info()))
        try:
            while not self.stopping:
                if self.has_work():
                    self._drain()
                    if not self.stopping and self.has_work():
                        self.step()
                        await asyncio.sleep(0)  # let signal handlers and socket events run
                else:
                    timeout = self.wake_after()
                    if timeout is None:
                        self._dispatch(await self.inbox.recv())
                    elif await self.inbox.wait(timeout):
                        self._drain()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
                signal.signal(signum, signal.SIG_IGN)  # stopping already: see it through
            self.stopping = True
            self.close()
            self.sockets.close()

    def _drain(self) -> None:
        while not self.stopping:
            message = self.inbox.recv_nowait()
            if message is None:
                return
            self._dispatch(message)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Shutdown):
            logger.info("shutting down (%s)", message.reason or "asked to")
            self.stopping = True
            return
        if isinstance(message, Ping):
            self.to_frontend.send(Pong(self.name, message.ping_id))
            return
        self.handle(message)

    def _enqueue_shutdown(self, reason: str) -> None:
        if not self.stopping:  # a second signal while stopping changes nothing
            self._to_self.send(Shutdown(reason))
