"""The executor actor: the scheduler's one peer for model steps, whatever the number of
workers.

Receives StepPlans from the scheduler and StepResults from rank 0. Broadcasts each plan
to every worker rank and forwards rank 0's result to the scheduler, as the raw bytes it
received: nothing on this hop is decoded twice or re-encoded. Owns one bound socket per
rank ("plans{rank}") that the rank's worker connects to, so a worker on another machine
needs only this node's address; on shutdown it passes the Shutdown on to every rank.
The worker processes are started and watched by the launchers, which fail every
request when one of them dies."""

from __future__ import annotations

import zmq

from actors.actor import Actor, ActorSpec
from messages.common import Shutdown
from messages.executor import ExecutorInbox
from messages.scheduler import StepResult
from messages.transport import Sockets, encode
from messages.worker import StepPlan


class ExecutorActor(Actor):
    inbox_type = ExecutorInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, num_workers: int) -> None:
        super().__init__(name, addresses, sockets)
        self.to_workers = [sockets.outbox(addresses[f"plans{rank}"], bind=True, blocking=True)
                           for rank in range(num_workers)]
        self.to_scheduler = sockets.outbox(addresses["scheduler"])

    @classmethod
    def from_spec(cls, spec: ActorSpec, sockets: Sockets) -> ExecutorActor:
        return cls(spec.name, spec.addresses, sockets, spec.options["num_workers"])

    def handle(self, message) -> None:
        payload = self.inbox.last_payload
        match message:
            case StepPlan():
                for to_worker in self.to_workers:
                    to_worker.send_bytes(payload)
            case StepResult():
                self.to_scheduler.send_bytes(payload)

    def close(self) -> None:
        for to_worker in self.to_workers:  # ranks on other nodes have no other way to hear it
            try:
                to_worker.socket.send(encode(Shutdown("the executor stopped")), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # that worker is gone already
