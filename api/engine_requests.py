"""The engine requests behind one HTTP request, and the gate that bounds how many there are.

A completions request with several prompts is one engine request per prompt; a chat
request is one. EngineRequests runs each AsyncClient stream in its own task and merges
their deltas into one stream of (prompt index, delta), in the order they come, while it
counts usage and feeds the metrics. close() cancels whatever still runs, and cancelling
an AsyncClient stream aborts its request in the engine (its KV blocks are freed)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from actors.errors import InvalidRequestError
from actors.tracing.spans import RequestTracer
from api.errors import server_busy
from api.metrics import RequestSpanInfo, RequestStats, ServerMetrics
from api.responses import Usage
from messages.common import RequestOutput, SamplingParams

# How long a client turned away by back-pressure is told to wait.
RETRY_AFTER_S = 1


class RequestGate:
    """Back-pressure: at most max_num_seqs running plus max_waiting_requests waiting
    engine requests are admitted at once; past that a request is turned away (503 with
    Retry-After) instead of queueing without bound."""

    def __init__(self, max_num_seqs: int, max_waiting_requests: int) -> None:
        self.limit = max_num_seqs + max_waiting_requests
        self.num_admitted = 0

    def admit(self, num_requests: int) -> None:
        if self.num_admitted + num_requests > self.limit:
            raise server_busy(RETRY_AFTER_S)
        self.num_admitted += num_requests

    def release(self, num_requests: int) -> None:
        self.num_admitted -= num_requests
        assert self.num_admitted >= 0, "released more requests than were admitted"


class EngineRequests:
    """Merges the delta streams of one HTTP request's engine requests."""

    def __init__(self, request_ids: list[str], streams: list[AsyncIterator[RequestOutput]], *, max_model_len: int,
                 max_tokens: int | None, metrics: ServerMetrics,
                 on_close: Callable[[EngineRequests], None], n: int = 1,
                 tracing: tuple[RequestTracer, str, SamplingParams, dict[str, str] | None] | None = None) -> None:
        self.request_ids = request_ids  # the engine's ids, in prompt order
        self.num_requests = len(streams)
        self.usage = Usage()
        self._num_cached_tokens: dict[int, int] = {}  # prompt index -> prompt tokens from the prefix cache
        self._max_model_len = max_model_len
        self._max_tokens = max_tokens
        self.n = n  # completions per engine request (sequences, as admission counts them)
        self._metrics = metrics
        self._on_close = on_close
        self._tracing = tracing  # (tracer, model name, params, trace headers): a span per engine request
        # (prompt index, a delta | the error that ended the stream | None once it finished)
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._ready: deque[tuple[int, RequestOutput]] = deque()  # taken from the queue by start()
        self._num_open = len(streams)
        self._closed = False
        self._tasks = [asyncio.create_task(self._pump(index, stream), name=f"troupe-api-stream-{index}")
                       for index, stream in enumerate(streams)]

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, over all engine requests."""
        return sum(self._num_cached_tokens.values())

    async def start(self) -> None:
        """Returns once every engine request has produced its first delta, so that an
        error the engine finds (a prompt too long) becomes an error status before a
        streaming response has sent its headers. Raises that error."""
        started: set[int] = set()
        while len(started) < self.num_requests and self._num_open:
            item = await self._next()
            if item is None:
                break
            self._ready.append(item)
            started.add(item[0])

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) until every engine request has finished."""
        while self._ready:
            yield self._ready.popleft()
        while (item := await self._next()) is not None:
            yield item

    async def _next(self) -> tuple[int, RequestOutput] | None:
        while self._num_open:
            index, item = await self._queue.get()
            if item is None:
                self._num_open -= 1
            elif isinstance(item, BaseException):
                self.close()
                raise item
            else:
                return index, item
        return None

    def close(self) -> None:
        """Aborts whatever still runs. Synchronous, so that it also works inside a
        cancelled task; idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        self._on_close(self)

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        trace = None
        if self._tracing is not None:
            tracer, model, params, headers = self._tracing
            trace = RequestSpanInfo(tracer, self.request_ids[index], model, params, headers)
        stats = RequestStats(self._metrics, self.n, self._max_tokens, trace)
        try:
            async with aclosing(stream):
                async for delta in stream:
                    if delta.num_cached_tokens:
                        self._num_cached_tokens[index] = delta.num_cached_tokens
                    if delta.prompt_token_ids:
                        self._on_prompt(delta)
                    self.usage.add(0, stats.on_delta(delta))
                    self._queue.put_nowait((index, delta))
            self._queue.put_nowait((index, None))
        except asyncio.CancelledError:
            stats.on_cancelled()  # the client left: closing the stream aborts the request
            raise
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which decides what the client sees
            self._queue.put_nowait((index, error))

    def _on_prompt(self, delta: RequestOutput) -> None:
        num_prompt_tokens = len(delta.prompt_token_ids)
        # OpenAI's rule: prompt plus max_tokens must fit the context. The prompt's length
        # is only known once the input processor has tokenized it, hence the check here.
        if self._max_tokens is not None and num_prompt_tokens + self._max_tokens > self._max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self._max_model_len} tokens; the request asks for "
                f"{num_prompt_tokens + self._max_tokens} ({num_prompt_tokens} in the prompt, {self._max_tokens} "
                "for the completion)", param="max_tokens")
        self.usage.add(num_prompt_tokens, 0)
