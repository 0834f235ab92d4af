"""The exceptions troupe raises to its callers."""

from __future__ import annotations

from messages.common import InvalidRequestError

__all__ = ["EngineDeadError", "EngineRequestError", "EngineStartupError", "InvalidRequestError"]


class EngineDeadError(RuntimeError):
    """An actor process died or the engine was closed: every pending and new call fails
    with this, and the client must be recreated."""


class EngineRequestError(RuntimeError):
    """One request lost by the engine through no fault of its caller (the input processor
    that held it died); the message says why, the engine goes on (HTTP 500)."""


class EngineStartupError(RuntimeError):
    """The engine's processes did not all come up (an actor failed, or the start-up
    timed out); nothing is left running."""
