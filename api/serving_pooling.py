"""The pooling routes with an `input`, as vLLM serves them: POST /v1/embeddings (OpenAI's
shape), /pooling (the pooled output as it is) and /classify; /score and /rerank are in
serving_scores.py. Each input is one engine request (AsyncClient.encode); a pooled output
comes back whole, never streamed, so a route answers once every input's has, in input order.

A route the model cannot serve is a 400 naming it before anything runs: vLLM's rule is that
embeddings need an embedding model and /classify a classifier, and a model without a
pooler serves none of them. A pooling request goes through the same back-pressure gate as
a generation one, and is aborted in the engine when its client leaves."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from actors.errors import InvalidRequestError
from actors.frontend.pooling import PoolingStream, gather_or_cancel
from actors.config.pooler import PoolerConfig
from api.errors import bad_request
from api.metrics import ServerMetrics
from api.pooling_protocol import (ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingData,
                                  EmbeddingRequest, EmbeddingResponse, InputRequest, PoolingData, PoolingRequest,
                                  PoolingResponse, PoolingUsage, encode_vector)
from api.responses import Usage
from api.serving import ServingContext, json_response, read_json, until_disconnected
from messages.pooling import PoolingParams, PoolingRequestOutput, ScoringRequestOutput

T = TypeVar("T")

# what each pooling task is called in an error
_TASK_NAMES = {"embed": "an embedding model", "classify": "a classifier"}


def require_pooler(ctx: ServingContext, route: str, tasks: tuple[str, ...] = ("embed", "classify")) -> PoolerConfig:
    """The model's pooler; a 400 naming the route when it has none, or one of another task."""
    pooler = ctx.client.config.pooler
    if pooler is None:
        raise bad_request(f"this model does not support {route}: it generates text and has no pooler; start it "
                          "with --runner pooling (or --convert embed / classify)", param="model")
    if pooler.task not in tasks:
        needs = " or ".join(_TASK_NAMES[task] for task in tasks)
        raise bad_request(f"this model does not support {route}: it is {_TASK_NAMES[pooler.task]}, and {route} "
                          f"needs {needs}", param="model")
    return pooler


async def create_embedding(ctx: ServingContext, request: Request) -> Response:
    require_pooler(ctx, "/v1/embeddings", ("embed",))
    body = await read_json(request, EmbeddingRequest, ctx.settings.max_body_bytes)
    response_id, model, vectors, usage = await _pool_vectors(ctx, request, body, "embed", "embd")
    data = [EmbeddingData(index=index, embedding=vector) for index, vector in enumerate(vectors)]
    return json_response(EmbeddingResponse(id=response_id, model=model, data=data, usage=usage))


async def create_pooling(ctx: ServingContext, request: Request) -> Response:
    """The model's pooled output, whatever its task: an embedding, or a classifier's scores."""
    require_pooler(ctx, "/pooling")
    body = await read_json(request, PoolingRequest, ctx.settings.max_body_bytes)
    response_id, model, vectors, usage = await _pool_vectors(ctx, request, body, "encode", "pool")
    data = [PoolingData(index=index, data=vector) for index, vector in enumerate(vectors)]
    return json_response(PoolingResponse(id=response_id, model=model, data=data, usage=usage))


async def create_classification(ctx: ServingContext, request: Request) -> Response:
    require_pooler(ctx, "/classify", ("classify",))
    body = await read_json(request, ClassificationRequest, ctx.settings.max_body_bytes)
    response_id, model, outputs = await _pool_inputs(ctx, request, body, body.pooling_params(), "classify")
    data = []
    for index, output in enumerate(outputs):
        probs = output.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=index, label=ctx.class_labels[best], probs=probs,
                                       num_classes=len(probs)))
    return json_response(ClassificationResponse(id=response_id, model=model, data=data,
                                                usage=pooling_usage(request, outputs)))


async def run_pooling(ctx: ServingContext, request: Request, work: Callable[[], Awaitable[T]],
                      num_requests: int) -> T:
    """work()'s result, its num_requests engine requests admitted by the gate (503 past the
    waiting limit) and cancelled, so aborted in the engine, if the client leaves first."""
    ctx.check_health()
    ctx.gate.admit(num_requests)
    try:
        return await until_disconnected(request, work())
    finally:
        ctx.gate.release(num_requests)


async def _pool_vectors(ctx: ServingContext, request: Request, body: EmbeddingRequest, task: str,
                        prefix: str) -> tuple[str, str, list[list | str], PoolingUsage]:
    """(the response's id, its model name, each input's vector as the body's encoding_format
    asks, the usage)."""
    response_id, model, outputs = await _pool_inputs(ctx, request, body, body.pooling_params(task), prefix)
    vectors = [encode_vector(output.outputs.data, body.encoding_format) for output in outputs]
    return response_id, model, vectors, pooling_usage(request, outputs)


async def _pool_inputs(ctx: ServingContext, request: Request, body: InputRequest, params: PoolingParams,
                       prefix: str) -> tuple[str, str, list[PoolingRequestOutput]]:
    """(the response's id, the model name it carries, each input's pooled output in input order)."""
    model, lora_request = ctx.resolve_model(body.model)
    prompts = body.prompts()
    response_id, engine_ids = ctx.request_ids(request, body.request_id, prefix, len(prompts))

    def pool_all() -> Awaitable[list[PoolingRequestOutput]]:
        return gather_or_cancel([
            _counted(ctx.metrics, ctx.client.encode(prompt, params, engine_id, lora_request=lora_request,
                                                    priority=body.priority or 0,
                                                    add_special_tokens=body.add_special_tokens))
            for prompt, engine_id in zip(prompts, engine_ids)])

    try:
        return response_id, model, await run_pooling(ctx, request, pool_all, len(prompts))
    except InvalidRequestError as error:
        if error.param == "prompt":  # the engine's name for what this route calls input (a prompt too long)
            raise InvalidRequestError(str(error), param="input") from None
        raise


async def _counted(metrics: ServerMetrics, stream: PoolingStream) -> PoolingRequestOutput:
    start = time.monotonic()
    output = await stream
    metrics.on_pooling_finished(len(output.prompt_token_ids), time.monotonic() - start)
    return output


def pooling_usage(request: Request, outputs: list[PoolingRequestOutput] | list[ScoringRequestOutput]) -> PoolingUsage:
    """The prompt tokens of every output (vLLM's count: a cosine score's are both texts'),
    also noted for the request's log line."""
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    request.state.usage = Usage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
