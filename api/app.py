"""The Starlette app: routes, error handlers and middleware over one started AsyncClient.

    app = build_app(client, ServerSettings(served_model_names=["smollm2"]))

The generation routes live in serving_completions.py and serving_chat.py; the small
routes (models, health, metrics, tokenizer, version) are here."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.errors import EngineDeadError, InvalidRequestError
from actors.frontend import AsyncClient
from actors.input_processor import InputProcessor
from api.errors import APIError, bad_request, handle_api_error, handle_http_exception, internal_error
from api.metrics import CONTENT_TYPE
from api.middleware import APIKeyMiddleware, RequestLogMiddleware
from api.protocol import DetokenizeRequest, TokenizeRequest
from api.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse, VersionResponse
from api.serving import ClientGone, ServerSettings, ServingContext, json_response, read_json
from api.serving_chat import create_chat_completion
from api.serving_completions import create_completion

# How long /metrics waits for the scheduler's counters before answering without them.
_STATS_TIMEOUT_S = 2.0

Endpoint = Callable[[ServingContext, Request], Awaitable[Response]]


def _with_context(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    @functools.wraps(endpoint)
    async def handle(request: Request) -> Response:
        return await endpoint(request.app.state.serving, request)

    return handle


async def list_models(ctx: ServingContext, request: Request) -> Response:
    cards = [ModelCard(id=name, root=ctx.settings.model_root, max_model_len=ctx.max_model_len)
             for name in ctx.settings.served_model_names]
    return json_response(ModelList(data=cards))


async def health(ctx: ServingContext, request: Request) -> Response:
    """200 while every actor process is alive, 503 otherwise."""
    ctx.check_health()
    return Response(status_code=200)


async def metrics(ctx: ServingContext, request: Request) -> Response:
    try:
        stats = await ctx.client.get_stats(timeout=_STATS_TIMEOUT_S)
    except (EngineDeadError, asyncio.TimeoutError):
        stats = None  # the server's own counters are still worth reporting
    return Response(ctx.metrics.render(stats), media_type=CONTENT_TYPE)


async def tokenize(ctx: ServingContext, request: Request) -> Response:
    """A prompt's token ids, or a conversation's as the chat template renders it."""
    body = await read_json(request, TokenizeRequest, ctx.settings.max_body_bytes)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    tokenizer = await ctx.client.get_tokenizer()
    if body.prompt is not None:
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=add_special_tokens)
    else:
        config = ctx.client.config
        processor = InputProcessor(tokenizer, config.model.vocab_size, ctx.max_model_len)
        messages = [message.to_dict() for message in body.messages]
        tokens = await asyncio.to_thread(processor.apply_chat_template, messages, body.add_generation_prompt)
    return json_response(TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens))


async def detokenize(ctx: ServingContext, request: Request) -> Response:
    body = await read_json(request, DetokenizeRequest, ctx.settings.max_body_bytes)
    ctx.check_model(body.model)
    vocab_size = ctx.client.config.model.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range [0, {vocab_size})", param="tokens")
    tokenizer = await ctx.client.get_tokenizer()
    return json_response(DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens)))


async def server_version(ctx: ServingContext, request: Request) -> Response:
    try:
        troupe_version = version("troupe")
    except PackageNotFoundError:  # run from a checkout that pip never installed
        troupe_version = "unknown (not installed)"
    return json_response(VersionResponse(version=troupe_version))


ROUTES = [
    Route("/v1/completions", _with_context(create_completion), methods=["POST"]),
    Route("/v1/chat/completions", _with_context(create_chat_completion), methods=["POST"]),
    Route("/v1/models", _with_context(list_models), methods=["GET"]),
    Route("/health", _with_context(health), methods=["GET"]),
    Route("/metrics", _with_context(metrics), methods=["GET"]),
    Route("/tokenize", _with_context(tokenize), methods=["POST"]),
    Route("/detokenize", _with_context(detokenize), methods=["POST"]),
    Route("/version", _with_context(server_version), methods=["GET"]),
]


async def _client_gone(request: Request, error: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it, the log does


async def _unexpected(request: Request, error: Exception) -> Response:
    return internal_error().response()  # uvicorn logs the traceback; the client gets no trace


def build_app(client: AsyncClient, settings: ServerSettings) -> Starlette:
    """The OpenAI-compatible app serving a started client."""
    serving = ServingContext(client, settings)
    middleware = [Middleware(RequestLogMiddleware, metrics=serving.metrics,
                             route_paths={route.path for route in ROUTES})]
    if settings.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=settings.api_key))
    exception_handlers = {
        APIError: handle_api_error, InvalidRequestError: handle_api_error, EngineDeadError: handle_api_error,
        HTTPException: handle_http_exception, ClientGone: _client_gone, Exception: _unexpected,
    }
    app = Starlette(routes=ROUTES, middleware=middleware, exception_handlers=exception_handlers)
    app.state.serving = serving
    return app
