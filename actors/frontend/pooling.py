"""AsyncClient's pooling calls, as vLLM's engine clients name them: encode() runs one
prompt through a pooling model and gives its PoolingRequestOutput (iterate it for the one
output, as vLLM's async generator, or await it); embed() and classify() give the typed
views; score() scores text pairs (actors/pooling/scoring.py). The pooled data comes straight
from the scheduler (PoolingOutputs), not through the detokenizer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from actors.pooling.engine import POOLING_SAMPLING_PARAMS
from actors.pooling.outputs import classification_output, embedding_output
from actors.pooling.scoring import (cosine_scores, cross_encoder_scores, distinct_texts, pair_token_ids,
                                    score_pairs, scoring_mode)
from actors.frontend.prompts import PromptInput, split_prompt
from messages.input_processor import AddRequest
from messages.lora import LoRARequest, check_lora_request
from messages.pooling import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams,
                              PoolingRequestOutput, ScoringRequestOutput, pooling_params_for)

T = TypeVar("T")


class PoolingStream:
    """One pooling request: `async for` gives its one output, `await` returns it."""

    def __init__(self, outputs: AsyncIterator[PoolingRequestOutput]) -> None:
        self._outputs = outputs

    def __aiter__(self) -> AsyncIterator[PoolingRequestOutput]:
        return self._outputs

    def __await__(self):
        return self._last().__await__()

    async def _last(self) -> PoolingRequestOutput:
        output = None
        async for output in self._outputs:
            pass
        return output


class PoolingClientMixin:
    config = None  # the client's EngineConfig, once started

    def encode(self, prompt: PromptInput, pooling_params: PoolingParams | None = None, request_id: str | None = None,
               *, lora_request: LoRARequest | None = None, priority: int = 0,
               truncate_prompt_tokens: int | None = None, add_special_tokens: bool | None = None) -> PoolingStream:
        """The prompt's pooled output (outputs.data, a float32 tensor): an embedding or a
        classifier's scores, as the model pools. prompt: text, token ids or vLLM's dict prompt;
        add_special_tokens: False tokenizes a text without the tokenizer's BOS/EOS."""
        pooler = self.config.pooler if self.config is not None else None
        params = pooling_params_for(pooling_params, None, pooler.task if pooler else "encode", truncate_prompt_tokens)
        prompt, cache_salt = split_prompt(prompt)
        request = AddRequest(request_id=self._new_id(request_id), prompt=prompt, params=POOLING_SAMPLING_PARAMS,
                             arrival_time=time.time(), priority=priority, cache_salt=cache_salt,
                             add_special_tokens=add_special_tokens, lora_request=check_lora_request(lora_request),
                             pooling_params=params)
        return PoolingStream(self._run(request, None))

    async def embed(self, prompt: PromptInput, pooling_params: PoolingParams | None = None,
                    request_id: str | None = None, *, lora_request: LoRARequest | None = None
                    ) -> EmbeddingRequestOutput:
        params = pooling_params_for(pooling_params, "embed", "embed")
        return embedding_output(await self.encode(prompt, params, request_id, lora_request=lora_request))

    async def classify(self, prompt: PromptInput, pooling_params: PoolingParams | None = None,
                       request_id: str | None = None, *, lora_request: LoRARequest | None = None
                       ) -> ClassificationRequestOutput:
        params = pooling_params_for(pooling_params, "classify", "classify")
        return classification_output(await self.encode(prompt, params, request_id, lora_request=lora_request))

    async def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
                    truncate_prompt_tokens: int | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> list[ScoringRequestOutput]:
        """The score of each pair, as LLM.score: data_1[i] with data_2[i], or one data_1 with
        every data_2; the cosine of two embeddings, or a cross-encoder's output over the pair."""
        firsts, seconds = score_pairs(data_1, data_2)
        params = PoolingParams(task="score")

        def pool(prompt: str | list[int]) -> PoolingStream:
            return self.encode(prompt, params, lora_request=lora_request, truncate_prompt_tokens=truncate_prompt_tokens,
                               priority=priority)

        if scoring_mode(self.config.pooler) == "cosine":
            texts = distinct_texts(firsts, seconds)
            outputs = await gather_or_cancel([pool(text) for text in texts])
            return cosine_scores(firsts, seconds, dict(zip(texts, outputs)))
        tokenizer = await self.get_tokenizer()
        pairs = await asyncio.to_thread(pair_token_ids, tokenizer, firsts, seconds)  # off the event loop
        return cross_encoder_scores(await gather_or_cancel([pool(pair) for pair in pairs]))


async def gather_or_cancel(works: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, in order. When one fails, or the caller is cancelled (its client left),
    the others are cancelled too, which aborts their requests in the engine: asyncio.gather
    alone would leave them running for nobody."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a finished one ignores it
        await asyncio.gather(*tasks, return_exceptions=True)
