"""The Starlette app: routes, error handlers and middleware over one started AsyncClient.

    app = build_app(client, ServerSettings(served_model_names=["smollm2"]))

The generation routes live in serving_completions.py and serving_chat.py, the tokenizer's
in serving_tokens.py, the models' (LoRA adapters too) in serving_models.py, the pooling
models' in serving_pooling.py (embeddings, /pooling, /classify) and serving_scores.py (/score,
/rerank); the small routes (health, metrics, version, load) and
SageMaker's (/ping, /invocations) are here."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version

from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive

from actors.errors import EngineDeadError, EngineRequestError, InvalidRequestError
from actors.frontend.client import AsyncClient
from api.errors import APIError, bad_request, handle_api_error, handle_http_exception, internal_error
from api.lora_models import ServedModels
from api.metrics import CONTENT_TYPE
from api.middleware import (APIKeyMiddleware, HeaderLimitsMiddleware, RequestLogMiddleware, RootPathMiddleware,
                            ServerLoadMiddleware, XRequestIdMiddleware)
from api.responses import VersionResponse
from api.request_limits import max_schema_bytes
from api.serving import ClientGone, ServerSettings, ServingContext, decode_json, json_response, read_body
from api.serving_chat import create_chat_completion
from api.serving_responses import create_response, retrieve_response
from api.serving_completions import create_completion
from api import serving_ops
from api.serving_models import list_models, load_lora_adapter, retrieve_model, unload_lora_adapter
from api.serving_pooling import create_classification, create_embedding, create_pooling
from api.serving_scores import create_rerank, create_score
from api.serving_tokens import detokenize, tokenize, tokenizer_info

# How long /metrics waits for the scheduler's counters before answering without them.
_STATS_TIMEOUT_S = 2.0

Endpoint = Callable[[ServingContext, Request], Awaitable[Response]]


def _with_context(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    @functools.wraps(endpoint)
    async def handle(request: Request) -> Response:
        serving = request.app.state.serving
        max_schema_bytes.set(serving.client.config.max_grammar_bytes)  # (this request's context only)
        return await endpoint(serving, request)

    return handle


async def health(ctx: ServingContext, request: Request) -> Response:
    """200 while every actor process is alive, 503 otherwise; with data parallelism, 200
    while a replica serves, with each replica's state ("ok" or why it died)."""
    ctx.check_health()
    states = getattr(getattr(ctx.client, "engine", None), "replica_states", None)  # actors/frontend/data_parallel.py
    return json_response({"replicas": states()}) if states is not None else Response(status_code=200)


async def server_load(ctx: ServingContext, request: Request) -> Response:
    """vLLM's GET /load: the generation requests in flight (0 without --enable-server-load-tracking)."""
    return json_response({"server_load": ctx.server_load})


class _InvocationKind(msgspec.Struct):
    """What /invocations looks at to pick an endpoint; the endpoint decodes the rest."""

    prompt: Any = None
    messages: Any = None
    input: Any = None
    query: Any = None
    documents: Any = None
    text_1: Any = None
    queries: Any = None


def _invocation_endpoint(ctx: ServingContext, kind: _InvocationKind) -> Callable[..., Awaitable[Response]]:
    """The endpoint a body's fields ask for, as vLLM's /invocations tries its request types:
    chat and completion bodies, then the pooling ones (input: embeddings, classification or
    pooling by the model's task), rerank (query and documents) and score."""
    if kind.messages is not None:
        return create_chat_completion
    if kind.prompt is not None:
        return create_completion
    if kind.input is not None:
        pooler = ctx.client.config.pooler
        if pooler is None:
            raise bad_request("/invocations: 'input' is for a pooling model; this model generates: send "
                              "'messages' (a chat completion) or 'prompt' (a completion)", param="input")
        return {"embed": create_embedding, "classify": create_classification}.get(pooler.task, create_pooling)
    if kind.query is not None and kind.documents is not None:
        return create_rerank
    if kind.text_1 is not None or kind.queries is not None:
        return create_score
    raise bad_request("/invocations needs 'messages' (a chat completion), 'prompt' (a completion), 'input' "
                      "(embeddings or classification), 'query' and 'documents' (rerank), or 'text_1' / 'queries' "
                      "(score)")


async def invocations(ctx: ServingContext, request: Request) -> Response:
    """SageMaker's POST /invocations: the endpoint the body's fields ask for."""
    body = await read_body(request, ctx.settings.max_body_bytes)
    # decoded for its kind only: the endpoint decodes (and checks, and logs unknown fields of) the
    # whole body as its own request type, so the fields this one leaves out are no "unknown" fields
    endpoint = _invocation_endpoint(ctx, decode_json(body, _InvocationKind, check_extra=False))
    return await endpoint(ctx, Request(request.scope, _replay(body, request.receive)))


def _replay(body: bytes, receive: Receive) -> Receive:
    """receive() that gives body, already read, first, then what the client sends next (its
    disconnect), so the endpoint reads the body once more and still sees the client leave."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def metrics(ctx: ServingContext, request: Request) -> Response:
    try:
        stats = await ctx.client.get_stats(timeout=_STATS_TIMEOUT_S)
    except (EngineDeadError, asyncio.TimeoutError):
        stats = None  # the server's own counters are still worth reporting
    return Response(ctx.metrics.render(stats), media_type=CONTENT_TYPE)


async def server_version(ctx: ServingContext, request: Request) -> Response:
    try:
        troupe_version = version("troupe")
    except PackageNotFoundError:  # run from a checkout that pip never installed
        troupe_version = "unknown (not installed)"
    return json_response(VersionResponse(version=troupe_version))


ROUTES = [
    Route("/v1/completions", _with_context(create_completion), methods=["POST"]),
    Route("/v1/chat/completions", _with_context(create_chat_completion), methods=["POST"]),
    Route("/v1/responses", _with_context(create_response), methods=["POST"]),
    Route("/v1/responses/{response_id}", _with_context(retrieve_response), methods=["GET"]),
    Route("/v1/embeddings", _with_context(create_embedding), methods=["POST"]),
    Route("/pooling", _with_context(create_pooling), methods=["POST"]),
    Route("/classify", _with_context(create_classification), methods=["POST"]),
    *(Route(path, _with_context(create_score), methods=["POST"]) for path in ("/score", "/v1/score")),
    *(Route(path, _with_context(create_rerank), methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    Route("/v1/models", _with_context(list_models), methods=["GET"]),
    Route("/v1/models/{model:path}", _with_context(retrieve_model), methods=["GET"]),
    Route("/health", _with_context(health), methods=["GET"]),
    Route("/ping", _with_context(health), methods=["GET", "POST"]),  # SageMaker's health check
    Route("/invocations", _with_context(invocations), methods=["POST"]),
    Route("/load", _with_context(server_load), methods=["GET"]),
    Route("/metrics", _with_context(metrics), methods=["GET"]),
    Route("/tokenize", _with_context(tokenize), methods=["POST"]),
    Route("/detokenize", _with_context(detokenize), methods=["POST"]),
    Route("/version", _with_context(server_version), methods=["GET"]),
]


async def _client_gone(request: Request, error: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it, the log does


async def _unexpected(request: Request, error: Exception) -> Response:
    return internal_error().response()  # uvicorn logs the traceback; the client gets no trace


# vLLM counts these in /load: the routes whose requests take the engine's time
_GENERATION_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"}


def build_app(client: AsyncClient, settings: ServerSettings, models: ServedModels | None = None) -> Starlette:
    """The OpenAI-compatible app serving a started client (and the LoRA adapters in models)."""
    serving = ServingContext(client, settings, models)
    routes = list(ROUTES)
    if settings.enable_tokenizer_info_endpoint:  # off by default, as vLLM: it shows the server's tokenizer files
        routes.append(Route("/tokenizer_info", _with_context(tokenizer_info), methods=["GET"]))
    if serving_ops.dev_mode():  # vLLM's development-mode routes: they free the engine's memory or drop its cache
        routes += [Route("/sleep", _with_context(serving_ops.sleep), methods=["POST"]),
                   Route("/wake_up", _with_context(serving_ops.wake_up), methods=["POST"]),
                   Route("/is_sleeping", _with_context(serving_ops.is_sleeping), methods=["GET"]),
                   Route("/reset_prefix_cache", _with_context(serving_ops.reset_prefix_cache), methods=["POST"])]
    if settings.allow_runtime_lora_updating and client.config.lora is not None:
        # as vLLM: the routes exist only when allowed, so an open server cannot be given new weights
        routes.append(Route("/v1/load_lora_adapter", _with_context(load_lora_adapter), methods=["POST"]))
        routes.append(Route("/v1/unload_lora_adapter", _with_context(unload_lora_adapter), methods=["POST"]))
    # outermost first: the path as the routes see it, then CORS, which answers preflights and adds
    # its headers to every response, errors too
    middleware = [Middleware(RootPathMiddleware, root_path=settings.root_path)] if settings.root_path else []
    middleware += [Middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                              allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers,
                              allow_credentials=settings.allow_credentials),
                   Middleware(HeaderLimitsMiddleware, max_count=settings.max_header_count,
                              max_bytes=settings.max_header_bytes)]
    if settings.enable_request_id_headers:
        middleware.append(Middleware(XRequestIdMiddleware))
    middleware.append(Middleware(RequestLogMiddleware, metrics=serving.metrics, log_requests=settings.log_requests,
                                 route_paths={route.path for route in routes}))
    if settings.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=settings.api_key,
                                     open_metrics=settings.allow_unauthenticated_metrics))
    if settings.enable_server_load_tracking:  # inside the API key check: a refused request is no load
        middleware.append(Middleware(ServerLoadMiddleware, serving=serving, paths=_GENERATION_PATHS))
    exception_handlers = {
        APIError: handle_api_error, InvalidRequestError: handle_api_error, EngineDeadError: handle_api_error,
        EngineRequestError: handle_api_error,
        HTTPException: handle_http_exception, ClientGone: _client_gone, Exception: _unexpected,
    }
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=exception_handlers)
    app.state.serving = serving
    return app
