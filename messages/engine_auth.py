"""Who may talk to an engine's tcp sockets: ZeroMQ CURVE, keyed by one secret per engine.

Sockets on one machine are ipc:// files in a 0700 directory, which only the engine's user
can open. Across machines (--nnodes, Ray ranks on other nodes) they are tcp://, which
anyone who reaches the port could otherwise connect to: forge a message to the frontend,
pull the step plans, or feed a worker a plan. So every tcp socket runs CURVE: each end
proves it holds a key derived from the engine's secret, and traffic is encrypted.

One 32-byte secret per engine, from which two key pairs follow: the server pair (every
socket that binds) and the client pair (every socket that connects). A socket that binds
also has a ZAP handler in its process that accepts only the client pair's public key.
The secret reaches each process in its ActorSpec (on the child's stdin, or through Ray
for a Ray worker); other nodes of a --nnodes engine derive it from TROUPE_ENGINE_KEY,
which every node is started with (actors/config.py).

A peer that fails the handshake (no CURVE, a wrong key) never gets a message through nor
one out; its attempts are logged, at most once per address every few seconds, and the
engine carries on."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import zmq
import zmq.utils.z85 as z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_LOG_EVERY_S = 10.0  # a peer that keeps retrying is logged once per address in this long


def secret_from_passphrase(passphrase: str) -> bytes:
    """The engine secret of a passphrase every node was given (TROUPE_ENGINE_KEY)."""
    return hashlib.sha256(b"troupe-engine-key\0" + passphrase.encode()).digest()


def _key_pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys, Z85-encoded, for one role of the engine."""
    secret_key = z85.encode(hashlib.sha256(b"troupe-curve\0" + role + b"\0" + secret).digest())
    return zmq.curve_public(secret_key), secret_key


class _Monitor(threading.Thread):
    """Logs the failed handshakes on one bound tcp socket."""

    def __init__(self, context: zmq.Context, socket: zmq.Socket, address: str) -> None:
        super().__init__(name="troupe-tcp-monitor", daemon=True)
        endpoint = f"inproc://troupe-monitor-{os.urandom(6).hex()}"
        socket.monitor(endpoint, _FAILURES)
        self.events = context.socket(zmq.PAIR)
        self.events.connect(endpoint)
        self.address = address
        self.stopping = False
        self.num_refused = 0
        self._last_log = 0.0
        self.start()

    def run(self) -> None:
        while not self.stopping:
            if not self.events.poll(200):
                continue
            try:
                event = recv_monitor_message(self.events)
            except zmq.ZMQError:
                return
            self.num_refused += 1
            now = time.monotonic()
            if now - self._last_log >= _LOG_EVERY_S:
                self._last_log = now
                logger.warning("refused a connection on %s that failed the engine's authentication (%s; %d so far)",
                               self.address, zmq.Event(event["event"]).name, self.num_refused)

    def stop(self) -> None:
        self.stopping = True
        self.join(2.0)
        self.events.close(0)


class _ClientKeys:
    """The ZAP handler's credentials: only the engine's own client key."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public_key


class TcpGuard:
    """One process's CURVE setup: options for each tcp socket, and (from its first bound
    one) the ZAP handler and the failed-handshake log."""

    def __init__(self, context: zmq.Context, secret: bytes) -> None:
        self.context = context
        self.server_public, self.server_secret = _key_pair(secret, b"server")
        self.client_public, self.client_secret = _key_pair(secret, b"client")
        self._authenticator = None
        self._monitors: list[_Monitor] = []

    def bind(self, socket: zmq.Socket, address: str) -> None:
        if self._authenticator is None:
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(self.context, log=logger)
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", credentials_provider=_ClientKeys(self.client_public))
        socket.curve_server = True
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        self._monitors.append(_Monitor(self.context, socket, address))
        socket.bind(address)

    def connect(self, socket: zmq.Socket, address: str) -> None:
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.client_public
        socket.curve_secretkey = self.client_secret
        socket.connect(address)

    @property
    def num_refused(self) -> int:
        """Handshakes refused so far on this process's bound tcp sockets."""
        return sum(monitor.num_refused for monitor in self._monitors)

    def close(self) -> None:
        """Before the sockets close: the monitors and the ZAP thread end."""
        for monitor in self._monitors:
            monitor.stop()
        self._monitors.clear()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
