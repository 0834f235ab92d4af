"""Data parallelism: data_parallel_size engine replicas behind one AsyncClient.

AsyncClient(..., data_parallel_size=D) holds, as its engine, a DataParallelClient
(make_engine_client below chooses it, as vLLM's EngineCoreClient.make_async_mp_client
does): D ordinary EngineClients (engine_client.py; each its own input processors,
scheduler, executor, workers and detokenizer, in its own ZeroMQ namespace), behind one
router. AsyncClient checks requests once (generate, chat, encode, beam search: everything
that ends in its engine's _run), and the router hands each to the live replica
with the fewest unfinished requests it knows of (waiting or running: the frontend's open
streams), the earliest replica on a tie; or, with routing_logic='prefixaware', to the one
that was sent the longest prefix of its prompt (actors/frontend/prefix_routing.py). Each replica
is supervised as a single engine is: when one of its processes dies, its own requests
fail with EngineDeadError and it stops; the others keep serving. The client is dead
(check_health raises, wait_until_dead returns, /health answers 503) only once every
replica is; while some are, /health lists each replica's state.

Engine operations (sleep, wake_up, reset_prefix_cache) go to every live replica;
get_stats sums the replicas' counters. LoRA adapters are refused with data parallelism
(actors/config/parallel_flags.py): an adapter would have to be loaded on every replica."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from actors.errors import EngineDeadError, InvalidRequestError
from actors.config import EngineConfig
from actors.engine.args import EngineArgs
from actors.frontend.engine_client import EngineClient
from actors.frontend.prefix_routing import PrefixRouter, prefix_keys
from messages.common import RequestOutput
from messages.frontend import HistogramSnapshot
from messages.input_processor import AddRequest

logger = logging.getLogger(__name__)


def make_engine_client(engine_args: EngineArgs, **options: Any) -> EngineClient | DataParallelClient:
    """AsyncClient's engine: one EngineClient, or with data_parallel_size > 1 a
    DataParallelClient of that many. options: num_input_processors, startup_timeout,
    log_level, transport (each replica's)."""
    if engine_args.data_parallel_size > 1:
        return DataParallelClient(engine_args, **options)
    return EngineClient(engine_args, **options)


class DataParallelClient:
    """data_parallel_size engines behind one router; answers what EngineClient answers."""

    def __init__(self, engine_args: EngineArgs, **options: Any) -> None:
        self.engine_args = engine_args
        self.config: EngineConfig | None = None
        self._dead: EngineDeadError | None = None
        size = engine_args.data_parallel_size
        replica_args = dataclasses.replace(engine_args, data_parallel_size=1, routing_logic="leastloaded")
        self.replicas = [EngineClient(replica_args, **options) for _ in range(size)]
        self._owners: dict[str, EngineClient] = {}  # request id -> the replica running it
        # --routing-logic prefixaware: where each prompt prefix went (actors/frontend/prefix_routing.py)
        self.prefix_router = PrefixRouter(size) if engine_args.routing_logic == "prefixaware" else None

    # ---- life cycle ----

    async def start(self) -> None:
        self.config = await asyncio.to_thread(self.engine_args.build)
        results = await asyncio.gather(*(replica.start() for replica in self.replicas), return_exceptions=True)
        failure = next((result for result in results if isinstance(result, BaseException)), None)
        if failure is not None:
            await self.close()
            raise failure

    async def close(self) -> None:
        await asyncio.gather(*(replica.close() for replica in self.replicas), return_exceptions=True)
        if self._dead is None:
            self._dead = EngineDeadError("the client was closed")

    # ---- health ----

    def live_replicas(self) -> list[EngineClient]:
        return [replica for replica in self.replicas if replica.is_running]

    def replica_states(self) -> list[str]:
        """Each replica's state for /health: "ok", or why it is dead."""
        return ["ok" if replica.is_running else f"dead: {replica.dead_error or 'its processes are not running'}"
                for replica in self.replicas]

    @property
    def is_running(self) -> bool:
        return self._dead is None and bool(self.live_replicas())

    @property
    def dead_error(self) -> EngineDeadError | None:
        if self._dead is None and self.live_replicas():
            return None
        return self._dead or EngineDeadError("every data-parallel replica is dead: " + "; ".join(self.replica_states()))

    def check_health(self) -> None:
        """Raises EngineDeadError once no replica is alive."""
        error = self.dead_error
        if error is not None:
            raise error

    async def ping(self, timeout: float = 5.0) -> float:
        self.check_health()
        return max(await asyncio.gather(*(replica.ping(timeout) for replica in self.live_replicas())))

    async def wait_until_dead(self) -> EngineDeadError:
        """Returns once every replica has died or the client was closed."""
        await asyncio.gather(*(replica.wait_until_dead() for replica in self.replicas))
        return self.dead_error

    # ---- requests ----

    async def _run(self, request: AddRequest, prompt_text: str | None) -> AsyncIterator[RequestOutput]:
        self.check_health()
        request_id = request.request_id
        if request_id in self._owners:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        if self.prefix_router is None:
            replica = min(self.live_replicas(), key=lambda live: live.num_unfinished_requests)
        else:
            replica = self._route_by_prefix(request)
        self._owners[request_id] = replica
        outputs = replica._run(request, prompt_text)
        try:
            async for output in outputs:
                yield output
        finally:
            self._owners.pop(request_id, None)
            await outputs.aclose()  # a stream left early: the replica aborts the request

    def _route_by_prefix(self, request: AddRequest) -> EngineClient:
        keys = prefix_keys(request, self.config.cache.block_size)
        loads = {index: replica.num_unfinished_requests for index, replica in enumerate(self.replicas)
                 if replica.is_running}
        index = self.prefix_router.choose(keys, loads)
        self.prefix_router.record(index, keys)
        return self.replicas[index]

    async def abort(self, request_id: str) -> None:
        replica = self._owners.get(request_id)
        if replica is not None:
            await replica.abort(request_id)

    @property
    def num_unfinished_requests(self) -> int:
        return sum(replica.num_unfinished_requests for replica in self.replicas)

    async def get_stats(self, timeout: float = 10.0) -> dict:
        """The live replicas' counters and histograms summed, their usage shares averaged."""
        self.check_health()
        replies = await asyncio.gather(*(replica.get_stats(timeout) for replica in self.live_replicas()))
        stats = dict(replies[0])
        for reply in replies[1:]:
            for key, value in reply.items():
                stats[key] = _sum(stats.get(key), value)
        for key in stats:
            if key.endswith("usage"):
                stats[key] /= len(replies)
        return stats

    stats = get_stats

    async def _control(self, op: str, level: int = 1, tags: list[str] | None = None) -> dict:
        self.check_health()
        replies = await asyncio.gather(*(replica._control(op, level, tags) for replica in self.live_replicas()))
        return {key: all(reply[key] for reply in replies) for key in replies[0]}

    def actor_pids(self) -> dict[str, int]:
        return {f"dp{index}.{name}": pid for index, replica in enumerate(self.replicas)
                for name, pid in replica.actor_pids().items()}


def _sum(first: Any, second: Any) -> Any:
    """Two replicas' values of one statistic added up where they add up (else the first)."""
    if isinstance(first, HistogramSnapshot) and isinstance(second, HistogramSnapshot) \
            and first.bounds == second.bounds:
        return HistogramSnapshot(bounds=first.bounds, counts=[a + b for a, b in zip(first.counts, second.counts)],
                                 total=first.total + second.total)
    if isinstance(first, (int, float)) and isinstance(second, (int, float)) and not isinstance(first, bool):
        return first + second
    return first
