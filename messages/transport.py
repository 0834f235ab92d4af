"""How messages travel: msgpack (msgspec) over ZeroMQ PUSH/PULL sockets. No pickle.

Every actor binds one PULL socket, its inbox, and connects a PUSH socket to each peer
it sends to (an "outbox", named after the peer).

Every message an inbox takes is array_like (msgspec requires one layout per union; it
is also the compact one), tagged, and appended to, never reordered.

Addresses: ipc:// files in a private temporary directory (mode 0700) by default;
inproc:// when actors share a process (tests); tcp:// only when asked for, and then
always authenticated and encrypted with the engine's secret (messages/engine_auth.py):
Sockets refuses a tcp address when it has no secret."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from messages.engine_auth import TcpGuard

logger = logging.getLogger(__name__)

class Namespace:
    """Where one engine's sockets live, so two engines never share an address."""

    def __init__(self, scheme: str = "ipc", host: str = "127.0.0.1") -> None:
        if scheme not in ("ipc", "inproc", "tcp"):
            raise ValueError(f"transport scheme must be ipc, inproc or tcp, got {scheme!r}")
        self.scheme = scheme
        self.host = host
        self.directory: str | None = None
        if scheme == "ipc":
            # mkdtemp creates the directory with mode 0700: other users cannot connect
            self.directory = tempfile.mkdtemp(prefix="troupe-")
        self._prefix = os.urandom(6).hex()

    def address(self, name: str) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.directory}/{name}"
        if self.scheme == "inproc":
            return f"inproc://troupe-{self._prefix}-{name}"
        return f"tcp://{self.host}:{free_tcp_port(self.host)}"

    def cleanup(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def free_tcp_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def free_tcp_port_range(count: int, host: str = "127.0.0.1", first: int = 20000, last: int = 32000) -> int:
    """The first of `count` consecutive ports that are free now, below the kernel's usual
    ephemeral range (where outgoing connections could take one meanwhile)."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(first, last - count)
        probes = []
        try:
            for port in range(start, start + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind((host, port))
            return start
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports in [{first}, {last})")


_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


Attach = Callable[[zmq.Socket, str, bool], None]  # (socket, address, bind): binds or connects it


def _plain(socket: zmq.Socket, address: str, bind: bool) -> None:
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)


class Outbox:
    """A PUSH socket to one peer. send() never blocks: the queue is unbounded (a step's
    messages are small, and blocking an actor's loop on a slow peer would stall it)."""

    def __init__(self, context: zmq.Context, address: str, bind: bool = False, blocking: bool = False,
                 attach: Attach = _plain) -> None:
        # A bound PUSH socket has no queue until a peer connects: a blocking one waits for
        # that peer instead of raising zmq.Again.
        self._flags = 0 if blocking else zmq.NOBLOCK
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 1000)  # on close, give queued messages 1 s to leave
        attach(self.socket, address, bind)

    def send(self, message: msgspec.Struct) -> None:
        """Raises zmq.Again only on a bound socket with no peer connected."""
        self.socket.send(encode(message), flags=self._flags, copy=False)

    def send_bytes(self, payload: bytes | memoryview) -> None:
        self.socket.send(payload, flags=self._flags, copy=False)

    async def wait_for_peer(self, timeout: float) -> bool:
        """Whether a peer connected within timeout seconds. A bound socket's peer may say
        it is ready (on another socket) before its connection here has finished its
        handshake: a non-blocking send in that gap raises zmq.Again."""
        deadline = time.monotonic() + timeout
        while not self.socket.poll(0, zmq.POLLOUT):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def close(self) -> None:
        self.socket.close()


class Inbox:
    """A PULL socket decoding one tagged union of message types."""

    def __init__(self, context: zmq.asyncio.Context, address: str, message_type: Any,
                 bind: bool = True, attach: Attach = _plain) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._attach = attach
        attach(self.socket, address, bind)
        # the same socket, used synchronously: draining a queue needs no future per message
        self._sync_socket = zmq.Socket.shadow(self.socket.underlying)
        self.decoder = msgspec.msgpack.Decoder(message_type)
        self.last_payload: memoryview | None = None  # the raw bytes of the last message

    async def recv(self) -> Any:
        while True:
            frame = await self.socket.recv(copy=False)
            message = self._decode(frame)
            if message is not None:
                return message

    async def wait(self, timeout: float) -> bool:
        """Whether a message arrived within timeout seconds (it stays queued)."""
        return bool(await self.socket.poll(max(1, round(timeout * 1000)), zmq.POLLIN))

    def recv_nowait(self) -> Any | None:
        """The next queued message, or None when there is none."""
        while True:
            try:
                frame = self._sync_socket.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            message = self._decode(frame)
            if message is not None:
                return message

    def _decode(self, frame: zmq.Frame) -> Any | None:
        """The frame's message, or None for one that is not a message of this inbox (a
        peer's bug, or bytes forged by whoever reached a tcp port): dropped and logged, so
        no sender can end the actor that reads it (the SamplingParams of a message
        carrying a pickled logits processor fail here too: messages/common.py)."""
        self.last_payload = frame.buffer
        try:
            return self.decoder.decode(frame.buffer)
        except msgspec.DecodeError as error:  # (ValidationError is one)
            logger.warning("dropped a message that is not one of this inbox's (%d bytes): %s",
                           len(frame.buffer), error)
            return None

    def also(self, address: str, bind: bool) -> None:
        """Binds (or connects) the inbox at a second address too: the one other nodes reach."""
        self._attach(self.socket, address, bind)

    def close(self) -> None:
        self.socket.close()


class Sockets:
    """One process's ZeroMQ context: sync for outboxes, an asyncio shadow for inboxes
    (the same underlying context, so inproc:// addresses work between them). secret: the
    engine's, which every tcp socket authenticates with; None: tcp addresses are refused."""

    def __init__(self, context: zmq.Context | None = None, secret: bytes | None = None) -> None:
        self.context = context or zmq.Context()
        self.async_context = zmq.asyncio.Context.shadow(self.context)
        self._opened: list[Outbox | Inbox] = []
        self.tcp_guard = None if secret is None else TcpGuard(self.context, secret)

    def attach(self, socket: zmq.Socket, address: str, bind: bool) -> None:
        """Binds or connects a socket; on tcp, with the engine's CURVE keys."""
        if not address.startswith("tcp://"):
            _plain(socket, address, bind)
        elif self.tcp_guard is None:
            raise ValueError(f"{address}: tcp sockets need the engine's secret (messages/engine_auth.py)")
        elif bind:
            self.tcp_guard.bind(socket, address)
        else:
            self.tcp_guard.connect(socket, address)

    def outbox(self, address: str, bind: bool = False, blocking: bool = False) -> Outbox:
        outbox = Outbox(self.context, address, bind, blocking, self.attach)
        self._opened.append(outbox)
        return outbox

    def inbox(self, address: str, message_type: Any, bind: bool = True) -> Inbox:
        inbox = Inbox(self.async_context, address, message_type, bind, self.attach)
        self._opened.append(inbox)
        return inbox

    def close(self) -> None:
        for opened in self._opened:
            opened.close()
        self._opened.clear()
        if self.tcp_guard is not None:  # after the sockets: no connection is ever taken without it
            self.tcp_guard.close()
