"""The executor: the scheduler's link to the model workers, a plain object inside the
scheduler's process (as vLLM runs its executor inside the engine core).

Owns one bound socket per tensor-parallel rank ("plans{rank}"), which that rank's worker
connects to, so a worker on another machine needs only this node's address. submit()
encodes a StepPlan once and sends the same bytes to every rank; rank 0 sends each
StepResult straight to the scheduler's inbox, so a step costs two ZeroMQ hops (plan out,
result back) and no process in between. close() passes a Shutdown on to every rank: the
ranks on other nodes have no other way to hear it.

It holds no state beyond its sockets and does not watch the workers: the launchers watch
every process (actors/engine/supervisor.py) and fail every request when one dies."""

from __future__ import annotations

import zmq

from messages.common import Shutdown
from messages.transport import Outbox, Sockets, encode
from messages.control import WorkerControl
from messages.worker import StepPlan


class Executor:
    def __init__(self, sockets: Sockets, addresses: dict[str, str], num_workers: int) -> None:
        # Blocking: a bound PUSH socket has no queue until its worker has connected, and the
        # first plan may be ready before that (the worker retries its connect every 100 ms).
        self.to_workers: list[Outbox] = [sockets.outbox(addresses[f"plans{rank}"], bind=True, blocking=True)
                                         for rank in range(num_workers)]

    def submit(self, plan: StepPlan | WorkerControl) -> None:
        """Sends the plan (or an engine operation) to every rank, encoded once."""
        payload = encode(plan)
        for to_worker in self.to_workers:
            to_worker.send_bytes(payload)

    def close(self) -> None:
        shutdown = encode(Shutdown("the scheduler stopped"))
        for to_worker in self.to_workers:
            try:
                to_worker.socket.send(shutdown, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # that worker is gone already
