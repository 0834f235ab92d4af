"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank), as vLLM serves them, through
AsyncClient.score: an embedding model scores a pair by the cosine of its two embeddings, a
classifier with one label (a cross-encoder) by its output over the pair as one input; any
other model is a 400 naming the route. /rerank scores its query against every document
and answers with the best first, cut to top_n."""

from __future__ import annotations

import time

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from actors.errors import InvalidRequestError
from actors.input_processor.processor import check_request_options
from actors.config.pooler import PoolerConfig
from actors.pooling.scoring import distinct_texts, score_pairs, scoring_mode
from api.errors import bad_request
from api.middleware import route_path
from api.pooling_protocol import (RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage,
                                  ScoreData, ScoreRequest, ScoreResponse)
from api.serving import ServingContext, json_response, read_json
from api.serving_pooling import pooling_usage, require_pooler, run_pooling
from messages.lora import LoRARequest
from messages.pooling import ScoringRequestOutput


async def create_score(ctx: ServingContext, request: Request) -> Response:
    route = route_path(request.scope)
    pooler = require_pooler(ctx, route)
    body = await read_json(request, ScoreRequest, ctx.settings.max_body_bytes)
    model, lora_request = ctx.resolve_model(body.model)
    first, second, names = body.sides()
    firsts, seconds = score_pairs(first, second, names)
    check_request_options(body.priority or 0, None, ctx.client.config.scheduler.scheduling_policy == "priority")
    outputs = await _score(ctx, request, route, pooler, firsts, seconds, body.truncate_prompt_tokens, lora_request,
                           body.priority or 0)
    response_id, _ = ctx.request_ids(request, body.request_id, "score", 0)
    data = [ScoreData(index=index, score=output.outputs.score) for index, output in enumerate(outputs)]
    return json_response(ScoreResponse(id=response_id, model=model, data=data, usage=pooling_usage(request, outputs)))


async def create_rerank(ctx: ServingContext, request: Request) -> Response:
    route = route_path(request.scope)
    pooler = require_pooler(ctx, route)
    body = await read_json(request, RerankRequest, ctx.settings.max_body_bytes)
    model, lora_request = ctx.resolve_model(body.model)
    num_results = body.num_results()
    firsts, seconds = score_pairs(body.query, body.documents, ("query", "documents"))
    check_request_options(body.priority or 0, None, ctx.client.config.scheduler.scheduling_policy == "priority")
    outputs = await _score(ctx, request, route, pooler, firsts, seconds, body.truncate_prompt_tokens, lora_request,
                           body.priority or 0)
    response_id, _ = ctx.request_ids(request, body.request_id, "rerank", 0)
    # sorted() is stable: documents of equal score keep their order
    ranked = sorted(range(len(outputs)), key=lambda index: outputs[index].outputs.score, reverse=True)
    results = [RerankResult(index=index, relevance_score=outputs[index].outputs.score,
                            document=RerankDocument(text=body.documents[index])
                            if body.return_documents is not False else UNSET)
               for index in ranked[:num_results]]
    usage = RerankUsage(total_tokens=pooling_usage(request, outputs).total_tokens)
    return json_response(RerankResponse(id=response_id, model=model, results=results, usage=usage))


async def _score(ctx: ServingContext, request: Request, route: str, pooler: PoolerConfig, firsts: list[str],
                 seconds: list[str], truncate_prompt_tokens: int | None,
                 lora_request: LoRARequest | None, priority: int) -> list[ScoringRequestOutput]:
    try:
        mode = scoring_mode(pooler)
    except InvalidRequestError as error:  # a classifier of several labels: no one score per pair
        raise bad_request(f"this model does not support {route}: {error}", param="model") from None
    # the engine requests the gate admits: each distinct text's embedding, or each pair
    num_requests = len(distinct_texts(firsts, seconds)) if mode == "cosine" else len(firsts)
    start = time.monotonic()
    outputs = await run_pooling(ctx, request, lambda: ctx.client.score(
        firsts, seconds, truncate_prompt_tokens=truncate_prompt_tokens, lora_request=lora_request, priority=priority),
        num_requests)
    elapsed = time.monotonic() - start
    # a score counts as one pooling request in /metrics, with its usage's tokens (a cosine's: both texts')
    for output in outputs:
        ctx.metrics.on_pooling_finished(len(output.prompt_token_ids), elapsed)
    return outputs

