"""The launcher's side of the actor processes: start them in order, wait until each says
it is ready (bounded), watch them, and stop them all.

Start-up order: the workers, input processors and detokenizer start at once; the
scheduler (with the executor, the object in its process that sends plans to the workers)
starts when every worker has reported its KV block count, since its block pool is the
smallest of them. Every actor binds its inbox at an address of the engine's
own Namespace, so two engines never collide.

Watching uses a pidfd per process (readable when the process ends), so a death is
noticed at once, not at the next poll."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from actors.runtime.actor import ActorSpec
from actors.config import EngineConfig
from actors.engine.addresses import distributed_init_method, engine_addresses, engine_secret
from actors.errors import EngineStartupError
from actors.runtime.process import ActorProcess
from messages.frontend import ActorFailed, ActorReady
from messages.transport import Inbox, Namespace

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.2


class EngineProcesses:
    """The actor processes of one engine."""

    def __init__(self, engine: EngineConfig, addresses: dict[str, str], *, num_input_processors: int = 1,
                 log_level: str = "WARNING", secret: bytes | None = None) -> None:
        self.engine = engine
        self.secret = secret  # the engine's (engine_secret()), handed to every actor in its spec
        self.addresses = addresses
        self.num_input_processors = num_input_processors
        self.num_workers = engine.parallel.world_size
        self.log_level = log_level
        self.processes: dict[str, ActorProcess] = {}
        self.ready: dict[str, ActorReady] = {}
        self._stopping = False
        self.ray = None  # the workers' RayPlacement (actors/engine/ray_executor.py) with the 'ray' backend

    def _spawn(self, kind: str, name: str, **options) -> None:
        spec = ActorSpec(kind=kind, name=name, addresses=self.addresses, engine=self.engine, options=options,
                         log_level=self.log_level, secret=self.secret)
        self.processes[name] = ActorProcess(spec)

    def _ray_placement(self):
        if self.ray is None:
            from actors.config.cuda_flags import on_cuda
            from actors.engine.ray_executor import RayPlacement

            self.ray = RayPlacement(self.engine.parallel, on_cuda(self.engine.device))
        return self.ray

    async def start(self, control: Inbox, timeout: float) -> None:
        """Starts every actor and returns once all are ready. On a failure or timeout,
        stops whatever started and raises EngineStartupError."""
        deadline = time.monotonic() + timeout
        try:
            if self.engine.parallel.distributed_executor_backend == "ray":
                self._ray_placement().spawn_workers(self, control)  # each rank on its node's transport
            else:
                self.spawn_local_workers()
            for index in range(self.num_input_processors):
                self._spawn("input_processor", f"input_processor{index}")
            self._spawn("detokenizer", "detokenizer")
            workers = [f"worker{rank}" for rank in range(self.num_workers)]  # other nodes' too
            await self._wait_ready(control, workers, deadline)
            infos = [self.ready[name].info for name in workers]
            self._spawn("scheduler", "scheduler", num_kv_blocks=min(info["num_kv_blocks"] for info in infos),
                        num_host_kv_blocks=min(info.get("num_host_kv_blocks", 0) for info in infos),
                        swap_is_cheaper=all(info.get("swap_is_cheaper", False) for info in infos),
                        disk_block_hashes=infos[0].get("disk_block_hashes"))  # (one rank with a disk tier)
            await self._wait_ready(control, list(self.processes), deadline)
        except BaseException:
            await self.stop()
            raise

    def spawn_local_workers(self) -> None:
        init_method = distributed_init_method(self.engine.parallel)
        for rank in self.engine.parallel.local_ranks:
            self._spawn("worker", f"worker{rank}", rank=rank, distributed_init_method=init_method)

    async def _wait_ready(self, control: Inbox, names: list[str], deadline: float) -> None:
        while any(name not in self.ready for name in names):
            for name, process in self.processes.items():
                if not process.is_alive() and name not in self.ready:
                    raise EngineStartupError(f"actor {name} exited with code {process.returncode} while starting "
                                             "(its log above says why)")
            if time.monotonic() > deadline:
                missing = ", ".join(name for name in names if name not in self.ready)
                raise EngineStartupError(f"timed out waiting for {missing} to start")
            if not await control.socket.poll(int(_POLL_INTERVAL_S * 1000)):
                continue
            while (message := control.recv_nowait()) is not None:
                match message:
                    case ActorReady(name=name):
                        self.ready[name] = message
                        logger.debug("%s ready (pid %d)", name, message.pid)
                    case ActorFailed(name=name, error=error):
                        raise EngineStartupError(f"actor {name} failed to start: {error}")

    def restart(self, name: str, on_death: Callable[[str, int | None], None]) -> None:
        """A new process for a dead actor (an input processor: actors/frontend/input_routing.py), under
        its name and inbox address, watched as the first was; it says it is ready to the
        frontend, which sends it requests meanwhile (they wait in the socket's queue)."""
        old = self.processes.pop(name)
        old.close()
        spec = old.spec
        self.processes[name] = process = ActorProcess(spec)
        if process.pidfd is not None:
            asyncio.get_running_loop().add_reader(process.pidfd, self._on_exit, name, on_death)
        else:
            asyncio.ensure_future(self._poll_exits(on_death))

    def watch(self, on_death: Callable[[str, int | None], None]) -> None:
        """Calls on_death(name, returncode) from the running loop when a process ends
        while the engine is not being stopped."""
        loop = asyncio.get_running_loop()
        for name, process in self.processes.items():
            if process.pidfd is not None:
                loop.add_reader(process.pidfd, self._on_exit, name, on_death)
        if any(process.pidfd is None for process in self.processes.values()):
            asyncio.ensure_future(self._poll_exits(on_death))

    def _on_exit(self, name: str, on_death: Callable[[str, int | None], None]) -> None:
        process = self.processes[name]
        asyncio.get_running_loop().remove_reader(process.pidfd)
        process.wait(1.0)  # reap it: the pidfd is readable once it has exited
        if not self._stopping:
            on_death(name, process.returncode)

    async def _poll_exits(self, on_death: Callable[[str, int | None], None]) -> None:
        while not self._stopping:
            for name, process in self.processes.items():
                if process.pidfd is None and not process.is_alive():
                    on_death(name, process.returncode)
                    return
            await asyncio.sleep(_POLL_INTERVAL_S)

    def all_alive(self) -> bool:
        return bool(self.processes) and all(process.is_alive() for process in self.processes.values())

    async def stop(self, timeout: float = 5.0) -> None:
        """Asks every actor to shut down (SIGTERM, which each turns into a Shutdown
        message), waits up to timeout, then kills what is left. Idempotent."""
        self._stopping = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        for process in self.processes.values():
            if loop is not None and process.pidfd is not None:
                loop.remove_reader(process.pidfd)
            process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            while process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if process.is_alive():
                logger.warning("actor %s did not stop in %.0f s; killing it", process.name, timeout)
                process.kill()
                process.wait(5.0)
            process.close()
        self._release_ray()

    def kill_all(self) -> None:
        """Last resort, from any context (atexit, a finaliser): SIGKILL every process."""
        self._stopping = True
        for process in self.processes.values():
            process.kill()
            process.wait(5.0)
        self._release_ray()

    def _release_ray(self) -> None:
        if self.ray is not None:
            self.ray.shutdown()
            self.ray = None


async def run_worker_node(engine: EngineConfig, stop: asyncio.Event, log_level: str = "WARNING") -> int:
    """Node i > 0 of a multi-node engine: runs this node's ranks until the engine shuts them
    down (the scheduler's executor sends every rank a Shutdown; returns 0) or `stop` is set
    (returns 0), or one of them dies: then node 0's frontend is told, so every request
    fails at once, the other local ranks are stopped, and this returns 1."""
    from messages.transport import Sockets

    namespace = Namespace("ipc")
    addresses = engine_addresses(namespace, 0, engine.parallel)
    secret = engine_secret(engine.parallel)
    processes = EngineProcesses(engine, addresses, num_input_processors=0, log_level=log_level, secret=secret)
    deaths: asyncio.Queue[tuple[str, int | None]] = asyncio.Queue()
    try:
        processes.spawn_local_workers()
        processes.watch(lambda name, returncode: deaths.put_nowait((name, returncode)))
        stopped = asyncio.ensure_future(stop.wait())
        died = asyncio.ensure_future(deaths.get())
        await asyncio.wait([stopped, died], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not died.done():
            died.cancel()
            return 0
        name, returncode = died.result()
        if returncode == 0:
            return 0  # shut down by the scheduler's executor: the others follow
        sockets = Sockets(secret=secret)
        sockets.outbox(addresses["frontend"]).send(
            ActorFailed(name=name, error=f"exited with code {returncode} on node {engine.parallel.node_rank}"))
        sockets.close()
        return 1
    finally:
        await processes.stop()
        namespace.cleanup()
