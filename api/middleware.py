"""Pure-ASGI middleware (they see every message, so streamed responses too): the root path
served with and without its prefix, the header limits, the API key check on every
route but the health checks, one log line and one metrics count per request, the
X-Request-Id header, and the count of generation requests in flight (GET /load).

Paths are matched below the root path (--root-path): uvicorn puts the proxy's prefix in
front of scope["path"], and no route may slip past the API key under it."""

from __future__ import annotations

import hmac
import logging
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError
from api.metrics import ServerMetrics
from api.serving import ServingContext

logger = logging.getLogger("api.requests")


def route_path(scope: Scope) -> str:
    """The request's path below the root path, as the router matches it."""
    path, root_path = scope["path"], scope.get("root_path", "")
    if root_path and path.startswith(root_path) and path[len(root_path):len(root_path) + 1] in ("", "/"):
        return path[len(root_path):] or "/"
    return path


class RootPathMiddleware:
    """Serves /llm/v1/... as well as /v1/... under --root-path /llm, as vLLM does: a proxy
    that strips the prefix sends /v1/..., a client that reaches the server directly (or a
    proxy that keeps the prefix) sends /llm/v1/..., which uvicorn turns into /llm/llm/v1/...
    by putting the root path in front; the second prefix is dropped here, before any other
    middleware looks at the path."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path
        self.doubled = root_path + root_path  # what uvicorn makes of a path the client prefixed itself

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(self.doubled) and \
                path[len(self.doubled):len(self.doubled) + 1] in ("", "/"):
            scope = {**scope, "path": path[len(self.root_path):]}
        await self.app(scope, receive, send)


class HeaderLimitsMiddleware:
    """431 for a request with more than max_count headers (vLLM's --h11-max-header-count) or
    more than max_bytes of them (--h11-max-incomplete-event-size). h11 enforces the bytes only
    while a header block is still arriving; one that came whole in a single read is measured
    here, so the limit holds however the client sends it."""

    def __init__(self, app: ASGIApp, max_count: int, max_bytes: int) -> None:
        self.app = app
        self.max_count = max_count
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            problem = None
            if len(headers) > self.max_count:
                problem = f"{len(headers)} headers; at most {self.max_count} are allowed (--h11-max-header-count)"
            elif (size := sum(len(name) + len(value) for name, value in headers)) > self.max_bytes:
                problem = f"{size} bytes of headers; at most {self.max_bytes} are allowed " \
                          "(--h11-max-incomplete-event-size)"
            if problem is not None:
                await APIError(431, f"the request has {problem}", code="headers_too_large").response()(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


# The routes that answer without the API key: the health checks a load balancer or
# SageMaker sends without credentials. They say only whether the engine is up.
OPEN_PATHS = frozenset({"/health", "/ping"})


class APIKeyMiddleware:
    """401 for any request without `Authorization: Bearer <api_key>`, except the health
    checks (OPEN_PATHS), /metrics when open_metrics (--allow-unauthenticated-metrics), and
    CORS preflights, which browsers send without credentials and which run nothing. Unlike
    vLLM, which checks /v1 only, every route is guarded, unknown paths included, so no
    route that runs the model or shows the server's state is open by accident."""

    def __init__(self, app: ASGIApp, api_key: str, open_metrics: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = OPEN_PATHS | {"/metrics"} if open_metrics else OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["method"] != "OPTIONS" and \
            route_path(scope) not in self.open_paths
        if guarded and not self._authorized(scope):
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
    has been sent in full (a stream: when it ends), unless log_requests is off, and
    counts it by route and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, route_paths: set[str], log_requests: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.route_paths = route_paths  # metrics labels only for known routes, so unknown paths cannot flood them
        self.log_requests = log_requests

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
        route = route_path(scope)
        self.metrics.requests.labels(route=route if route in self.route_paths else "other", status=str(status)).inc()
        if not self.log_requests:
            return
        path = scope["path"]  # with the root path: what the client asked the proxy for
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        usage = scope.get("state", {}).get("usage")
        tokens = f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}" if usage else ""
        logger.info('%s "%s %s" %d %.3fs%s', where, scope["method"], path, status, seconds, tokens)


class XRequestIdMiddleware:
    """Every response carries X-Request-Id: the request's own, echoed, or a new one (as
    vLLM's --enable-request-id-headers), so a client can match its logs with the server's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_request_id)


class ServerLoadMiddleware:
    """Counts the requests on the generation routes from their arrival until their
    response is sent in full (a stream: until it ends), in serving.server_load."""

    def __init__(self, app: ASGIApp, serving: ServingContext, paths: set[str]) -> None:
        self.app = app
        self.serving = serving
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        self.serving.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.serving.server_load -= 1
