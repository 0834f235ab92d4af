"""vLLM's development-mode routes (only with VLLM_SERVER_DEV_MODE=1, as vLLM: they let any
client free the engine's memory or drop its cache): POST /sleep?level=1|2, POST
/wake_up?tags=weights&tags=kv_cache, GET /is_sleeping, POST /reset_prefix_cache.

While the engine sleeps, requests wait in its queue and run once it is awake (the
scheduler's control state, actors/scheduler/control.py); nothing is lost."""

from __future__ import annotations


from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError, bad_request
from api.serving import ServingContext, json_response
from messages.control import check_wake_tags
from actors.config.env import server_dev_mode


def dev_mode() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE: "1" or "true" turns the routes on."""
    return server_dev_mode()


async def sleep(ctx: ServingContext, request: Request) -> Response:
    text = request.query_params.get("level", "1")
    if text not in ("1", "2"):
        raise bad_request(f"level must be 1 or 2, got {text!r}", param="level")
    ctx.check_health()
    await ctx.client.sleep(int(text))
    return Response(status_code=200)


async def wake_up(ctx: ServingContext, request: Request) -> Response:
    tags = request.query_params.getlist("tags") or None
    try:
        tags = check_wake_tags(tags)
    except ValueError as error:
        raise bad_request(str(error), param="tags") from None
    ctx.check_health()
    await ctx.client.wake_up(tags)
    return Response(status_code=200)


async def is_sleeping(ctx: ServingContext, request: Request) -> Response:
    ctx.check_health()
    return json_response({"is_sleeping": await ctx.client.is_sleeping()})


async def reset_prefix_cache(ctx: ServingContext, request: Request) -> Response:
    ctx.check_health()
    if not await ctx.client.reset_prefix_cache():
        raise APIError(409, "the prefix cache cannot be reset while requests hold KV blocks; retry once they finish",
                       code="requests_running")
    return Response(status_code=200)
