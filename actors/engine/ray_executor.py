"""Workers as Ray actors (--distributed-executor-backend ray).

The engine joins the Ray cluster at RAY_ADDRESS (`ray start --head` beforehand), or starts
a local one with this machine's CPUs; reserves a placement group with one bundle per rank
(a GPU each on CUDA, a CPU each otherwise), STRICT_PACK when one node has room for every
rank, PACK otherwise; and starts each rank's worker as a Ray actor in its bundle. Inside,
the actor runs exactly what a worker process runs (actors/runtime/process.py's run_spec): the
ranks still meet through torch.distributed, plans still come over ZeroMQ from the
scheduler's executor and results go back over ZeroMQ, so no Ray object store is on the
per-step path: Ray only places and starts the processes.

Supervision is the same as for worker processes (supervisor.py): RayWorkerProcess has
ActorProcess's interface; an actor on this node is watched through a pidfd on its
process, so its death fails every request at once; one on another node is polled
(its run() call ends when it dies).

Ray places ranks on other nodes only when one node lacks the room. The transport is then
chosen per rank (spawn_workers): a rank on the driver's node keeps the engine's ipc
addresses; a rank on another node gets tcp addresses, on the driver node's IP for the
sockets it connects to (the frontend's and the scheduler's inboxes, its plan socket:
each bound on tcp as well) and on its own node's IP for its inbox; and torch.distributed
meets at rank 0's node. Every tcp socket authenticates with the engine's secret, made at
start-up and handed to each rank in its spec through Ray (messages/engine_auth.py). A
cluster that can never hold the placement group is refused at once, naming what it lacks;
one that is busy gets a bounded wait."""

from __future__ import annotations

import os
import signal
import time

import logging

import msgspec

from actors.runtime.actor import ActorSpec
from actors.config import ParallelConfig
from actors.config.parallel_flags import RAY_EXTRA_HINT
from actors.errors import EngineStartupError
from actors.runtime.process import open_pidfd
from actors.engine.addresses import distributed_init_method
from messages.transport import Inbox, free_tcp_port_range
from actors.config.env import ray_address, ray_placement_timeout

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 120.0
# A local Ray started here runs only this engine's workers: no idle Python workers started
# ahead (one a CPU by default), which sit idle beside the workers' actors and took half
# of the Ray processes' CPU time on an idle 2-core machine (1.3% of a core of 2.9%),
# taken from the steps (benchmarks/ray_overhead.py).
_LOCAL_RAY_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
# how long the placement group may wait for a busy cluster to free its bundles
_PLACEMENT_TIMEOUT_S = ray_placement_timeout()


def _import_ray():
    try:
        import ray
    except ImportError as error:
        raise ValueError(f"distributed_executor_backend='ray' needs the ray package: {RAY_EXTRA_HINT}") from error
    return ray


class RayPlacement:
    """One engine's placement group on the Ray cluster, and the worker actors in it."""

    def __init__(self, parallel: ParallelConfig, on_cuda: bool) -> None:
        ray = _import_ray()
        world_size = parallel.world_size
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # the actors import this checkout; Ray must not narrow CUDA_VISIBLE_DEVICES (rank r
        # takes cuda:r as a worker process does)
        env = {"PYTHONPATH": os.pathsep.join([package_root] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                   .split(os.pathsep) if p]),
               "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "10000"),
               # the threads a worker process takes (Ray would give an actor one, its CPU bundle's)
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size))),
               "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
        self.env = env
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if ray_address():
                ray.init(runtime_env={"env_vars": env}, log_to_driver=True)
            else:  # a new local cluster, never one a stale /tmp/ray/ray_current_cluster names:
                # a CPU a rank at least, so every bundle fits
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False,
                         runtime_env={"env_vars": env}, _system_config=_LOCAL_RAY_CONFIG)
        resource = "GPU" if on_cuda else "CPU"
        self.resource = resource
        self.group = _reserve(ray, resource, world_size)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self._ports_given: set[int] = set()  # tcp ports _tcp_address handed out

    def _actor(self, rank: int):
        ray = _import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=rank)
        resources = {"num_gpus": 1, "num_cpus": 0} if self.resource == "GPU" else {"num_cpus": 1}
        # the environment per actor too: a cluster this engine joined was started without it
        return ray.remote(_RayWorker).options(scheduling_strategy=strategy, name=None,
                                              runtime_env={"env_vars": self.env}, **resources).remote()

    def spawn_workers(self, processes, control: Inbox) -> None:
        """Starts every rank's actor and its worker in processes (an EngineProcesses),
        each with the addresses of its node's transport; control is the frontend's inbox."""
        ray = _import_ray()
        handles = [self._actor(rank) for rank in range(self.group.bundle_count)]
        places = ray.get([handle.where.remote() for handle in handles], timeout=_READY_TIMEOUT_S)
        remote = [rank for rank, (_, node_id, *_) in enumerate(places) if node_id != self.node_id]
        _, _, rank0_ip, _, rank0_port = places[0]
        init_method = f"tcp://{rank0_ip}:{rank0_port}" if remote else distributed_init_method(processes.engine.parallel)
        addresses = processes.addresses
        if remote:
            addresses["frontend@tcp"] = control_address = self._tcp_address()
            control.also(control_address, bind=True)
            addresses["scheduler@tcp"] = self._tcp_address()  # the scheduler binds it too (actor.py)
            logger.info("ranks %s are on other Ray nodes: they talk over tcp to %s", remote, self.node_ip)
        for rank, handle in enumerate(handles):
            name = f"worker{rank}"
            rank_addresses = dict(addresses)
            if rank in remote:
                addresses[f"plans{rank}"] = self._tcp_address()  # the executor binds it
                addresses[name] = f"tcp://{places[rank][2]}:{places[rank][3]}"  # the frontend's pings
                rank_addresses.update({"frontend": addresses["frontend@tcp"], "scheduler": addresses["scheduler@tcp"],
                                       f"plans{rank}": addresses[f"plans{rank}"], name: addresses[name]})
            spec = ActorSpec(kind="worker", name=name, addresses=rank_addresses, engine=processes.engine,
                             options={"rank": rank, "distributed_init_method": init_method},
                             log_level=processes.log_level, secret=processes.secret)
            processes.processes[name] = RayWorkerProcess(spec, handle, local_node_id=self.node_id,
                                                         place=places[rank])

    def _tcp_address(self) -> str:
        """A port for a socket bound later (by the scheduler, its executor): below the kernel's
        ephemeral range, where Ray's own outgoing connections could take it meanwhile, and
        never one handed out before (a port probed free and closed may come back)."""
        for _ in range(100):
            port = free_tcp_port_range(1, self.node_ip)
            if port not in self._ports_given:
                self._ports_given.add(port)
                return f"tcp://{self.node_ip}:{port}"
        raise RuntimeError(f"no free tcp port on {self.node_ip}")

    def shutdown(self) -> None:
        ray = _import_ray()
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            remove_placement_group(self.group)
            if self.owns_ray:
                ray.shutdown()


class _RayWorker:
    """The Ray actor of one rank (made remote in RayPlacement.spawn)."""

    def where(self) -> tuple[int, str, str, int, int]:
        """This actor's pid, node id, node IP and two ports free there now (for its inbox
        and, on rank 0, torch.distributed's rendezvous): below the ephemeral range, where an
        outgoing connection (Ray makes many) could take one before it is bound."""
        import ray

        ip = ray.util.get_node_ip_address()
        first = free_tcp_port_range(2, ip)
        return os.getpid(), ray.get_runtime_context().get_node_id(), ip, first, first + 1

    def run(self, spec_bytes: bytes) -> None:
        from actors.runtime.process import run_spec

        def leave(code: int) -> None:
            import ray

            if code == 0:
                ray.actor.exit_actor()  # the way out Ray expects (no "worker died" report)
            os._exit(code)

        run_spec(msgspec.msgpack.decode(spec_bytes, type=ActorSpec), leave)  # ends the process when the worker stops


class RayWorkerProcess:
    """ActorProcess's interface (supervisor.py) over one rank's Ray actor."""

    def __init__(self, spec: ActorSpec, handle, local_node_id: str, place: tuple | None = None) -> None:
        ray = _import_ray()
        self.name = spec.name
        self.handle = handle
        self.pid, node_id, *_ = place or ray.get(handle.where.remote(), timeout=_READY_TIMEOUT_S)
        self.local = node_id == local_node_id
        self.run_ref = handle.run.remote(msgspec.msgpack.encode(spec))
        self.pidfd = open_pidfd(self.pid) if self.local else None  # the supervisor's watch, as a process's

    @property
    def returncode(self) -> int | None:
        return None if self.is_alive() else 1  # a Ray actor's exit code is not known here

    def is_alive(self) -> bool:
        if self.local:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return not _is_zombie(self.pid)
        ray = _import_ray()
        ready, _ = ray.wait([self.run_ref], timeout=0)
        return not ready

    def terminate(self) -> None:
        """SIGTERM on this node (the worker stops as a process does); ray.kill elsewhere."""
        if not self.is_alive():
            return
        if self.local:
            os.kill(self.pid, signal.SIGTERM)
        else:
            self.kill()

    def kill(self) -> None:
        _import_ray().kill(self.handle, no_restart=True)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.returncode

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _reserve(ray, resource: str, world_size: int):
    """The placement group of world_size one-resource bundles: STRICT_PACK when one live
    node has room for all, PACK (spread over the fewest nodes) otherwise. ValueError at
    once when the cluster has too few of the resource in all; EngineStartupError when the
    bundles are not free within _PLACEMENT_TIMEOUT_S (other jobs hold them)."""

    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = [node for node in ray.nodes() if node["Alive"]]
    total = sum(node["Resources"].get(resource, 0) for node in nodes)
    if total < world_size:
        raise ValueError(f"the Ray cluster has {total:g} {resource} in all ({len(nodes)} live nodes), fewer than the "
                         f"{world_size} ranks (one {resource} each) this engine needs")
    fits_one_node = any(node["Resources"].get(resource, 0) >= world_size for node in nodes)
    group = placement_group([{resource: 1}] * world_size, strategy="STRICT_PACK" if fits_one_node else "PACK")
    ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise EngineStartupError(f"the Ray cluster did not free {world_size} {resource} bundles for the workers in "
                                 f"{_PLACEMENT_TIMEOUT_S:.0f} s (TROUPE_RAY_PLACEMENT_TIMEOUT_S); see `ray status`")
    return group


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
