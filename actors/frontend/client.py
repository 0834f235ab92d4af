"""The frontend: AsyncClient, in the caller's process and event loop.

It starts the other actors as child processes (supervisor.py) and talks to them over ZeroMQ: AddRequest to
the input processors, AbortRequest, GetStats and EngineControl (sleep, wake, cache reset: engine_control.py)
to the scheduler; it receives RequestOutputs deltas from the detokenizer, RequestRejected from the input
processors or the scheduler, and Stats. Each request gets an id and an output stream; giving up on a stream
(breaking out of it, cancelling its task) aborts the request everywhere. When an input processor dies, the
requests it held fail (EngineRequestError) and a new one starts (input_routing.py); when any other actor
process dies, every pending call raises EngineDeadError and new calls fail at once.

    async with AsyncClient(model=path) as client:
        async for delta in client.generate("Hello", SamplingParams(max_tokens=16)):
            print(delta.outputs[0].text, end="")
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from actors.frontend.beam_search import AsyncBeamSearch
from actors.config import EngineConfig
from actors.detokenizer.merge_outputs import OutputMerger
from actors.engine.args import EngineArgs
from actors.engine.signature import takes_engine_args
from actors.frontend.engine_control import EngineControlMixin
from actors.frontend.lora import LoRAClientMixin
from actors.multimodal.prompt_images import split_prompt_images
from actors.frontend.pooling import PoolingClientMixin
from actors.errors import EngineDeadError, InvalidRequestError
from actors.frontend.input_routing import ActorExits, InputRouter
from actors.frontend.prompts import PromptInput, per_prompt, split_prompt
from actors.frontend.request_stream import LiveRequest, RequestStream, broadcast_params, check_params, rejection_error
from actors.engine.supervisor import EngineProcesses, engine_addresses, engine_secret
from actors.tracing.spans import ClientTracingMixin
from messages.common import CompletionOutput, Ping, RequestOutput, SamplingParams
from messages.frontend import (ActorFailed, FrontendInbox, HistogramSnapshot, PoolingOutputs, Pong, RequestOutputs,
                               RequestRejected, RequestTokenized, Stats)
from messages.input_processor import AddRequest, ChatOptions
from messages.lora import LoRARequest, check_lora_request
from messages.scheduler import AbortRequest, GetStats
from messages.transport import Namespace, Sockets

logger = logging.getLogger(__name__)

Prompt = str | list[int]

class ReplicasWhenAsked:
    """AsyncClient's first base: AsyncClient(..., data_parallel_size=D > 1) makes a
    DataParallelClient (actors/frontend/data_parallel.py), D engines behind one client. (A base
    class's __new__, so that inspect still shows AsyncClient.__init__'s keywords.)"""

    def __new__(cls, *args: Any, **engine_args: Any):
        size = engine_args.get("data_parallel_size", 1)
        if isinstance(size, int) and size > 1:
            from actors.frontend.data_parallel import DataParallelClient

            if issubclass(DataParallelClient, cls):
                cls = DataParallelClient
        return super().__new__(cls)


class AsyncClient(ReplicasWhenAsked, AsyncBeamSearch, LoRAClientMixin, PoolingClientMixin, EngineControlMixin,
                  ClientTracingMixin, ActorExits):
    """Starts and supervises a troupe engine; generate() streams RequestOutput deltas;
    beam_search() (actors/frontend/beam_search.py) returns a prompt's finished beams; add_lora()
    and the rest (actors/frontend/lora.py) manage LoRA adapters; encode() and embed()
    (actors/frontend/pooling.py) run a pooling model."""

    @takes_engine_args
    def __init__(self, model: str | None = None, *, num_input_processors: int = 1, startup_timeout: float = 600.0,
                 log_level: str = "WARNING", transport: str = "ipc", **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_keywords("AsyncClient", model, engine_args)
        if not isinstance(num_input_processors, int) or num_input_processors < 1:
            raise ValueError(f"num_input_processors must be a positive integer, got {num_input_processors!r}")
        self.num_input_processors = num_input_processors
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.transport = transport
        self.config: EngineConfig | None = None
        self.processes: EngineProcesses | None = None
        self._streams: dict[str, LiveRequest] = {}
        self._stats_queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._pings: dict[int, tuple[set[str], asyncio.Future]] = {}  # ping_id -> (names to answer, done)
        self._dead: EngineDeadError | None = None
        self._death_listeners: list[asyncio.Event] = []
        self._reader: asyncio.Task | None = None
        self._tokenizer = None
        self._namespace: Namespace | None = None
        self._sockets: Sockets | None = None
        self._inputs: InputRouter | None = None  # the input processors, which request each holds

    # ---- life cycle ----

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        self.config = await asyncio.to_thread(self.engine_args.build)
        self._namespace = Namespace(self.transport)
        addresses = engine_addresses(self._namespace, self.num_input_processors, self.config.parallel)
        secret = engine_secret(self.config.parallel)
        self._sockets = Sockets(secret=secret)
        self._inbox = self._sockets.inbox(addresses["frontend"], FrontendInbox)
        self._inputs = InputRouter(self._sockets, addresses, [f"input_processor{index}"
                                                              for index in range(self.num_input_processors)])
        self._to_scheduler = self._sockets.outbox(addresses["scheduler"])
        self._outboxes = {"scheduler": self._to_scheduler}
        self.processes = EngineProcesses(self.config, addresses, num_input_processors=self.num_input_processors,
                                         log_level=self.log_level, secret=secret)
        try:
            await self.processes.start(self._inbox, self.startup_timeout)
        except BaseException:
            self._close_sockets()
            raise
        self.processes.watch(self._on_actor_exit)
        self._reader = asyncio.create_task(self._read_inbox(), name="troupe-frontend-reader")

    async def close(self) -> None:
        """Stops every actor process and fails whatever is still pending. Idempotent."""
        if self._dead is None:
            self._fail_all(EngineDeadError("the client was closed"))
        if self.processes is not None:
            await self.processes.stop()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._sockets is not None:
            self._sockets.close()
            self._sockets = None
        if self._namespace is not None:
            self._namespace.cleanup()
            self._namespace = None

    # ---- health ----

    @property
    def is_running(self) -> bool:
        return self._dead is None and self.processes is not None and self.processes.all_alive()

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def check_health(self) -> None:
        """Raises EngineDeadError unless every actor process is alive."""
        if self._dead is not None:
            raise self._dead
        if self.processes is None:
            raise EngineDeadError("the client is not started")
        if not self.processes.all_alive():
            raise EngineDeadError("an actor process has exited")

    async def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time in seconds for every actor to answer a Ping (each answers between
        two of its steps). Raises EngineDeadError when one is dead, TimeoutError when one
        does not answer in time."""
        self.check_health()
        names = {name for name in self.processes.processes}
        ping_id = next(self._query_ids)
        done = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = (set(names), done)
        start = time.perf_counter()
        try:
            for name in names:
                self._actor_outbox(name).send(Ping(ping_id))
            await asyncio.wait_for(done, timeout)
        finally:
            self._pings.pop(ping_id, None)
        return time.perf_counter() - start

    def _actor_outbox(self, name: str):
        outbox = self._outboxes.get(name)
        if outbox is None:
            outbox = self._outboxes[name] = self._sockets.outbox(self.processes.addresses[name])
        return outbox

    async def wait_until_dead(self) -> EngineDeadError:
        """Returns (the error) once the engine has died or been closed."""
        if self._dead is None:
            event = asyncio.Event()
            self._death_listeners.append(event)
            await event.wait()
        assert self._dead is not None
        return self._dead

    def _fail_all(self, error: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = error
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error)
        for future in [*self._stats_queries.values(), *(done for _, done in self._pings.values())]:
            if not future.done():
                future.set_exception(error)
        for event in self._death_listeners:
            event.set()

    # ---- requests ----

    def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0, add_special_tokens: bool | None = None,
                 lora_request: LoRARequest | None = None) -> RequestStream:
        """Streams the request's RequestOutput deltas: each holds the text and tokens that
        are new since the last one; the last has finished=True. The request starts when
        the stream is first iterated (or awaited, which gives the whole output); leaving
        the stream early aborts it. prompt: text, token ids, or vLLM's dict prompt
        ({"prompt": text} or {"prompt_token_ids": ids}, with an optional "cache_salt", and a vision
        model's "multi_modal_data": {"image": a PIL image or a list}); lora_request: the adapter."""
        # the worker is another process: logits processors travel by name (--logits-processors)
        params = check_params(sampling_params).with_named_processors()
        prompt, images = split_prompt_images(prompt)
        prompt, cache_salt = split_prompt(prompt)
        request = AddRequest(request_id=self._new_id(request_id), prompt=prompt, params=params,
                             arrival_time=time.time(), add_special_tokens=add_special_tokens, priority=priority,
                             cache_salt=cache_salt, lora_request=check_lora_request(lora_request), images=images)
        return RequestStream(self._traced(self._run(request, prompt if isinstance(prompt, str) else None), request))

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
             request_id: str | None = None, add_generation_prompt: bool = True, *,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, documents: list[dict[str, Any]] | None = None,
             add_special_tokens: bool = False, priority: int = 0, cache_salt: str | None = None,
             tools: list[dict[str, Any]] | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """generate() for a conversation, rendered with the chat template (chat_template,
        else the model's) with vLLM's options."""
        # the worker is another process: logits processors travel by name (--logits-processors)
        params = check_params(sampling_params).with_named_processors()
        if not isinstance(messages, list):
            raise InvalidRequestError("messages must be a list of {'role', 'content'} objects", param="messages")
        chat = ChatOptions(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                           documents=documents, tools=tools)
        request = AddRequest(request_id=self._new_id(request_id), messages=messages, chat=chat, params=params,
                             arrival_time=time.time(), add_special_tokens=add_special_tokens, priority=priority,
                             cache_salt=cache_salt, lora_request=check_lora_request(lora_request))
        return RequestStream(self._traced(self._run(request, None), request))

    async def generate_batch(self, prompts: Sequence[PromptInput],
                             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                             use_tqdm: bool = True, priority: Sequence[int] | None = None,
                             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                             ) -> list[RequestOutput]:
        """Every prompt at once; the whole outputs, in prompt order. sampling_params,
        priority and lora_request may be one per prompt."""
        from tqdm import tqdm

        params_list = broadcast_params(sampling_params, len(prompts))
        priorities = per_prompt(priority, len(prompts), "priority", 0)
        loras = per_prompt(lora_request, len(prompts), "lora_request", None)
        progress = tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm)
        start, num_output_tokens = time.perf_counter(), 0

        async def run_one(prompt: PromptInput, params: SamplingParams, priority: int,
                          lora: LoRARequest | None) -> RequestOutput:
            nonlocal num_output_tokens
            merger = OutputMerger()  # (each completion's text joined once, at the end)
            async for delta in self.generate(prompt, params, priority=priority, lora_request=lora):
                merger.add(delta)
                num_output_tokens += sum(len(c.token_ids) for c in delta.outputs)
            progress.update(1)
            progress.set_postfix_str(f"{num_output_tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s out")
            return merger.result()

        tasks = [asyncio.ensure_future(run_one(*args)) for args in zip(prompts, params_list, priorities, loras)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()  # after a failure, the rest are aborted
            await asyncio.gather(*tasks, return_exceptions=True)
            progress.close()

    async def abort(self, request_id: str) -> None:
        """Ends a request wherever it is; its stream gets a last output with
        finish_reason "abort". Unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        outputs = [CompletionOutput(index=i, finish_reason="abort") for i in range(stream.n)]
        stream.queue.put_nowait(RequestOutput(request_id=request_id, prompt=stream.prompt, outputs=outputs,
                                              finished=True))
        self._send_abort(request_id)

    async def get_stats(self, timeout: float = 10.0) -> dict[str, float | HistogramSnapshot]:
        """The scheduler's counters: running and waiting requests, KV blocks held and free,
        prefix-cache hits, preemptions, and a histogram of tokens per step."""
        return await self._query(GetStats, timeout)

    stats = get_stats  # the same, under a shorter name

    def actor_pids(self) -> dict[str, int]:
        """Actor name ("worker0", "scheduler", ...) -> process id."""
        return {name: process.pid for name, process in (self.processes.processes if self.processes else {}).items()}

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    async def _run(self, request: AddRequest, prompt_text: str | None) -> AsyncIterator[RequestOutput]:
        self.check_health()
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        stream = self._streams[request_id] = LiveRequest(prompt_text, request.params.n)
        finished = False
        try:
            self._inputs.send(request)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._inputs.forget(request_id)
            if not finished:
                self._streams.pop(request_id, None)
                self._send_abort(request_id)

    def _send_abort(self, request_id: str) -> None:
        if self._dead is None and self._sockets is not None:
            self._to_scheduler.send(AbortRequest(request_id))

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        return request_id

    # ---- the inbox ----

    async def _read_inbox(self) -> None:
        try:
            while True:
                self._dispatch(await self._inbox.recv())
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a dead reader would hang every stream
            logger.exception("the frontend's inbox reader failed")
            self._fail_all(EngineDeadError(f"the frontend's inbox reader failed: {error}"))

    def _dispatch(self, message: Any) -> None:
        match message:
            case RequestOutputs(outputs=outputs):
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue  # aborted: the scheduler will drop it
                    output.prompt = stream.prompt
                    if output.finished:
                        del self._streams[output.request_id]
                    stream.queue.put_nowait(output)
            case PoolingOutputs(outputs=outputs):
                self._deliver_pooled(outputs)
            case RequestTokenized(request_id=request_id):
                self._inputs.forget(request_id)
            case RequestRejected(request_id=request_id):
                self._inputs.forget(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.queue.put_nowait(rejection_error(message))
            case Stats(query_id=query_id, stats=stats):
                future = self._stats_queries.get(query_id)
                if future is not None and not future.done():
                    future.set_result(stats)
            case Pong(name=name, ping_id=ping_id):
                waiting = self._pings.get(ping_id)
                if waiting is not None:
                    waiting[0].discard(name)
                    if not waiting[0] and not waiting[1].done():
                        waiting[1].set_result(None)
            case ActorFailed(name=name, error=error) if self._inputs.owns(name):
                self._inputs.last_error[name] = error  # its exit decides (ActorExits)
            case ActorFailed(name=name, error=error):
                self._fail_all(EngineDeadError(f"actor {name} failed: {error}"))

    # ---- tokenizer, for the HTTP API's /tokenize and /detokenize ----

    async def get_tokenizer(self):
        if self._tokenizer is None:
            from actors.models.loader import load_tokenizer

            assert self.config is not None, "start() the client first"
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer_path)
        return self._tokenizer
