"""One engine's connection, below AsyncClient: EngineClient starts the engine's actors as
child processes (actors/engine/supervisor.py) and talks to them over ZeroMQ: AddRequest to
the input processors, AbortRequest, GetStats and EngineControl (sleep, wake, cache reset)
to the scheduler; it receives RequestOutputs deltas from the detokenizer, PoolingOutputs
and Stats from the scheduler, RequestRejected from the input processors or the scheduler.
Each request gets an output queue; giving up on a stream aborts the request everywhere.
When an input processor dies, the requests it held fail (EngineRequestError) and a new one
starts (input_routing.py); when any other actor process dies, every pending call raises
EngineDeadError and new calls fail at once.

AsyncClient (client.py) holds one, or a DataParallelClient of several
(data_parallel.py), as make_engine_client chooses; the two answer the same calls."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from actors.config import EngineConfig
from actors.engine.addresses import engine_addresses, engine_secret
from actors.engine.args import EngineArgs
from actors.engine.supervisor import EngineProcesses
from actors.errors import EngineDeadError, InvalidRequestError
from actors.frontend.input_routing import ActorExits, InputRouter
from actors.frontend.request_stream import LiveRequest, rejection_error
from actors.pooling.outputs import pooling_request_output
from messages.common import CompletionOutput, Ping, RequestOutput
from messages.control import EngineControl
from messages.frontend import (ActorFailed, FrontendInbox, HistogramSnapshot, PoolingOutputs, PoolingResult, Pong,
                               RequestOutputs, RequestRejected, RequestTokenized, Stats)
from messages.input_processor import AddRequest
from messages.scheduler import AbortRequest, GetStats
from messages.transport import Namespace, Sockets

logger = logging.getLogger(__name__)

# sleeping waits for the plans in flight and for every worker to free its memory
_CONTROL_TIMEOUT_S = 300.0


class EngineClient(ActorExits):
    """One engine's actor processes, started, supervised and spoken to."""

    def __init__(self, engine_args: EngineArgs, *, num_input_processors: int = 1, startup_timeout: float = 600.0,
                 log_level: str = "WARNING", transport: str = "ipc") -> None:
        self.engine_args = engine_args
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
        self._namespace: Namespace | None = None
        self._sockets: Sockets | None = None
        self._inputs: InputRouter | None = None  # the input processors, which request each holds

    # ---- life cycle ----

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

    async def _query(self, build: Callable[[int], Any], timeout: float) -> dict:
        """Sends the scheduler build(query_id) and waits (bounded) for the Stats answering it;
        get_stats() and the operations below share this."""
        self.check_health()
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._stats_queries[query_id] = future
        try:
            self._to_scheduler.send(build(query_id))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._stats_queries.pop(query_id, None)

    async def _control(self, op: str, level: int = 1, tags: list[str] | None = None) -> dict:
        return await self._query(lambda query_id: EngineControl(query_id, op, level, tags), _CONTROL_TIMEOUT_S)

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

    def _deliver_pooled(self, results: list[PoolingResult]) -> None:
        for result in results:
            stream = self._streams.pop(result.request_id, None)
            if stream is not None:  # else aborted: nothing waits for it
                stream.queue.put_nowait(pooling_request_output(result))
