"""Pure-ASGI middleware (they see every message, so streamed responses too): the API key
check on /v1 routes, and one log line and one metrics count per request."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError
from api.metrics import ServerMetrics

logger = logging.getLogger("api.requests")


class APIKeyMiddleware:
    """401 for a /v1 request without `Authorization: Bearer <api_key>` (as vLLM, the
    health, metrics, version and tokenizer routes stay open)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            error = APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)  # constant time: no timing oracle
        return False


class RequestLogMiddleware:
    """Logs `client "METHOD path" status seconds [tokens]` at info level once a response
    has been sent in full (a stream: when it ends), and counts it by route and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, route_paths: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.route_paths = route_paths  # metrics labels only for known routes, so unknown paths cannot flood them

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500  # what the client gets when the app raises before responding

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self._record(scope, status, time.monotonic() - start)

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        path = scope["path"]
        self.metrics.requests.labels(route=path if path in self.route_paths else "other", status=str(status)).inc()
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        usage = scope.get("state", {}).get("usage")
        tokens = f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}" if usage else ""
        logger.info('%s "%s %s" %d %.3fs%s', where, scope["method"], path, status, seconds, tokens)
