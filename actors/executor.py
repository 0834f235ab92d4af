"""The executor actor: the scheduler's one peer for model steps, whatever the number of
workers.

Receives StepPlans from the scheduler and StepResults from rank 0. Broadcasts each plan
to every worker rank and forwards rank 0's result to the scheduler, as the raw bytes it
received: nothing on this hop is decoded twice or re-encoded. Owns the outboxes to the
workers; the worker processes themselves are started and watched by the launcher, which
fails every request when one of them dies."""

from __future__ import annotations

from actors.actor import Actor, ActorSpec
from messages.executor import ExecutorInbox
from messages.scheduler import StepResult
from messages.transport import Sockets
from messages.worker import StepPlan


class ExecutorActor(Actor):
    inbox_type = ExecutorInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, num_workers: int) -> None:
        super().__init__(name, addresses, sockets)
        self.to_workers = [sockets.outbox(addresses[f"worker{rank}"]) for rank in range(num_workers)]
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
