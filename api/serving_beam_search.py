"""use_beam_search on /v1/completions and /v1/chat/completions: the searches run through
AsyncClient.beam_search (each step a batch of ordinary engine requests), admitted by the
same back-pressure gate as other requests and given up when the client disconnects. A
beam search has its answer only at the end, so a streaming request gets each finished
beam as one chunk, then the usage (with include_usage) and [DONE]."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.responses import Usage
from api.serving import ServingContext, until_disconnected
from messages.common import RequestOutput


async def run_beam_searches(ctx: ServingContext, request: Request,
                            searches: list[Callable[[], Awaitable[RequestOutput]]], beam_width: int) -> list[RequestOutput]:
    """Each search's finished beams, in order; 503 past the waiting limit, as any request."""
    ctx.check_health()
    num_sequences = ctx.admit(len(searches), beam_width)  # each step of a search runs beam_width requests
    try:
        return await until_disconnected(request, asyncio.gather(*(search() for search in searches)))
    finally:
        ctx.gate.release(num_sequences)


def beam_usage(outputs: list[RequestOutput]) -> Usage:
    usage = Usage()
    for output in outputs:
        usage.add(len(output.prompt_token_ids), sum(len(beam.token_ids) for beam in output.outputs))
    return usage


def beam_response(stream: bool, whole: Any, chunks: list[Any]) -> Response:
    """The whole response as JSON, or the chunks as Server-Sent Events."""
    if not stream:
        return Response(msgspec.json.encode(whole), media_type="application/json")
    body = b"".join(b"data: " + msgspec.json.encode(chunk) + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"
    return Response(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
