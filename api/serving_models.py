"""The model routes, as vLLM's: GET /v1/models (the served names, then the LoRA adapters),
GET /v1/models/{model}, and, when runtime LoRA updating is allowed (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING, or --allow-runtime-lora-updating), POST
/v1/load_lora_adapter and /v1/unload_lora_adapter. api/lora_models.py keeps the adapters."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.lora_models import model_not_found
from api.responses import ModelCard, ModelList
from api.serving import ServingContext, json_response, read_json
from messages.lora import LoRARequest


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's body; a field left out is answered by the route (400), not by the decoder, so
    the message is vLLM's."""

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_int_id: int | None = None  # when given, the adapter's id must match it too


async def list_models(ctx: ServingContext, request: Request) -> Response:
    models = ctx.models
    cards = [_base_card(ctx, name) for name in models.base_model_names]
    cards += [_adapter_card(ctx, lora_request) for lora_request in models.adapters.values()]
    return json_response(ModelList(data=cards))


async def retrieve_model(ctx: ServingContext, request: Request) -> Response:
    """GET /v1/models/{model}: OpenAI's retrieve, for a served name or an adapter; 404 otherwise."""
    name = request.path_params["model"]
    if name in ctx.models.base_model_names:
        return json_response(_base_card(ctx, name))
    lora_request = ctx.models.adapters.get(name)
    if lora_request is None:
        raise model_not_found(name)
    return json_response(_adapter_card(ctx, lora_request))


# `root` is the served name, not the directory vLLM shows: a client has no use for the
# server's paths, and they tell an attacker where the server keeps its files
def _base_card(ctx: ServingContext, name: str) -> ModelCard:
    return ModelCard(id=name, root=name, max_model_len=ctx.max_model_len)


def _adapter_card(ctx: ServingContext, lora_request: LoRARequest) -> ModelCard:
    # an adapter runs in the base model's engine, so it has the same context
    return ModelCard(id=lora_request.lora_name, root=lora_request.lora_name, max_model_len=ctx.max_model_len,
                     parent=ctx.models.parent_of(lora_request))


async def load_lora_adapter(ctx: ServingContext, request: Request) -> Response:
    """200 with vLLM's text once the adapter is checked and served; 400 naming the problem."""
    body = await read_json(request, LoadLoRAAdapterRequest, ctx.settings.max_body_bytes)
    await ctx.models.load_adapter(body.lora_name, body.lora_path, from_request=True)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(ctx: ServingContext, request: Request) -> Response:
    body = await read_json(request, UnloadLoRAAdapterRequest, ctx.settings.max_body_bytes)
    await ctx.models.unload_adapter(body.lora_name, body.lora_int_id)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")
