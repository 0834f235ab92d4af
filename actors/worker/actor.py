"""The worker actor: one per device (one on the CPU).

Receives StepPlans (from the executor); rank 0 sends each plan's StepResult back to the
executor. Owns the model shard, the KV cache tensors and each request's state between
steps (the ModelRunner). Reports its KV block count with its ready message: the launcher
sizes the scheduler's block pool from it."""

from __future__ import annotations

from actors.actor import Actor, ActorSpec
from messages.transport import Sockets
from messages.worker import StepPlan, WorkerInbox


class WorkerActor(Actor):
    inbox_type = WorkerInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, runner, num_kv_blocks: int,
                 rank: int = 0) -> None:
        super().__init__(name, addresses, sockets)
        self.rank = rank
        self.runner = runner
        self.num_kv_blocks = num_kv_blocks
        self.to_executor = sockets.outbox(addresses["executor"]) if rank == 0 else None

    @classmethod
    def from_spec(cls, spec: ActorSpec, sockets: Sockets) -> WorkerActor:
        from actors.engine_core import num_kv_blocks
        from actors.worker.model_runner import ModelRunner

        engine = spec.engine
        num_blocks = num_kv_blocks(engine)
        runner = ModelRunner(engine, num_blocks, engine.attention_backend, engine.load_format)
        return cls(spec.name, spec.addresses, sockets, runner, num_blocks, spec.options.get("rank", 0))

    def ready_info(self) -> dict:
        return {"num_kv_blocks": self.num_kv_blocks, "rank": self.rank}

    def handle(self, message: StepPlan) -> None:
        result = self.runner.execute(message)
        if message.num_scheduled_tokens and self.to_executor is not None:
            self.to_executor.send(result)
