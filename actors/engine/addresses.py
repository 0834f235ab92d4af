"""Where an engine's actors meet: each actor's inbox address (ipc on one machine, tcp
across nodes), the secret their tcp sockets authenticate with, and the workers'
torch.distributed rendezvous. Shared by the supervisor (actor processes), the Ray executor
and the frontend, which binds its own inbox before it starts the rest."""

from __future__ import annotations

import os

from actors.config import ParallelConfig, engine_key
from messages.engine_auth import secret_from_passphrase
from messages.transport import Namespace, free_tcp_port


def engine_addresses(namespace: Namespace, num_input_processors: int, parallel: ParallelConfig) -> dict[str, str]:
    """Actor name -> inbox address, for the actors of this node. "plans{rank}" are bound
    sockets that peers connect to (the scheduler's executor's, one per rank). With several
    nodes, what other nodes reach (the frontend's inbox, the plan sockets) is on tcp at
    master_addr, on the ports above master_port (and, with pipeline stages, the scheduler's
    inbox for the last stage: world size + 3 ports in all, with the rendezvous)."""
    names = ["frontend", "scheduler", "detokenizer"]
    names += [f"input_processor{i}" for i in range(num_input_processors)]
    names += [f"worker{rank}" for rank in parallel.local_ranks]
    addresses = {name: namespace.address(name) for name in names}
    for rank in range(parallel.world_size):
        addresses[f"plans{rank}"] = namespace.address(f"plans{rank}")
    if parallel.nnodes > 1:
        host, port = parallel.master_addr, parallel.master_port
        addresses["frontend"] = f"tcp://{host}:{port + 1}"
        for rank in range(parallel.world_size):
            addresses[f"plans{rank}"] = f"tcp://{host}:{port + 2 + rank}"
        if parallel.pipeline_parallel_size > 1:
            # the last stage's output rank is on another node: node 0's scheduler binds this
            # too (actor.py), and other nodes' ranks send their results there
            addresses["scheduler@tcp"] = f"tcp://{host}:{port + 2 + parallel.world_size}"
            if parallel.node_rank > 0:
                addresses["scheduler"] = addresses["scheduler@tcp"]
    return addresses


def engine_secret(parallel: ParallelConfig) -> bytes:
    """The secret every tcp socket of the engine authenticates with (messages/engine_auth.py):
    on several nodes the one all were started with (TROUPE_ENGINE_KEY), else made now and
    handed to the actors (and Ray's workers) in their specs."""
    if parallel.nnodes > 1:
        return secret_from_passphrase(engine_key())
    return os.urandom(32)


def distributed_init_method(parallel: ParallelConfig) -> str:
    """Where the workers' torch.distributed rendezvous: as configured, master_addr:master_port
    across nodes, else a free port on this machine."""
    if parallel.distributed_init_method:
        return parallel.distributed_init_method
    if parallel.nnodes > 1:
        return f"tcp://{parallel.master_addr}:{parallel.master_port}"
    return f"tcp://127.0.0.1:{free_tcp_port()}"
