"""One request as AsyncClient serves it: the queue its outputs arrive on, the stream its
caller iterates or awaits, and the checks of its parameters and of a rejection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from actors.detokenizer.merge_outputs import OutputMerger
from actors.errors import InvalidRequestError
from messages.common import RequestOutput, SamplingParams
from messages.frontend import RequestRejected
from messages.lora import LoRAAdapterError


class LiveRequest:
    """One live request as the frontend sees it."""

    def __init__(self, prompt: str | None, n: int) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.prompt = prompt
        self.n = n


class RequestStream:
    """What generate() and chat() return: iterate it for the deltas (`async for`), or
    await it for the whole output at once."""

    def __init__(self, deltas: AsyncIterator[RequestOutput]) -> None:
        self._deltas = deltas

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._deltas

    async def __anext__(self) -> RequestOutput:
        return await anext(self._deltas)

    async def aclose(self) -> None:
        await self._deltas.aclose()

    def __await__(self):
        return self._collect().__await__()

    async def _collect(self) -> RequestOutput:
        merger = OutputMerger()  # (each completion's text joined once, at the end)
        async for delta in self._deltas:
            merger.add(delta)
        return merger.result()


def rejection_error(rejection: RequestRejected) -> Exception:
    if rejection.error_type == "invalid_request":
        if rejection.param == "lora_request":  # the adapter's own type, as LLM raises it
            return LoRAAdapterError(rejection.message)
        return InvalidRequestError(rejection.message, param=rejection.param)
    return RuntimeError(rejection.message)


def check_params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}",
                                  param="sampling_params")
    params.validate()
    return params


def broadcast_params(params: SamplingParams | Sequence[SamplingParams] | None,
                      num_prompts: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [check_params(params)] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise InvalidRequestError(f"got {len(params)} sampling_params for {num_prompts} prompts",
                                  param="sampling_params")
    return [check_params(p) for p in params]
