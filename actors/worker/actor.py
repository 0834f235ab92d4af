"""The worker actor: one per device (one on the CPU).

Receives StepPlans, WorkerControls (sleep, wake-up) and CompileGrammars from the scheduler's
executor; rank 0 sends each plan's StepResult, says when a WorkerControl is done and when a
grammar is compiled (GrammarCompiled), straight to the scheduler. Owns the model shard, the
KV cache tensors and each request's state between steps (the ModelRunner). Reports its KV
block count with its ready message: the launcher sizes the scheduler's block pool from it."""

from __future__ import annotations

import logging

from actors.runtime.actor import Actor, ActorSpec
from actors.config.structured_output import DEFAULT_COMPILE_TIMEOUT_S
from messages.control import WorkerControl, WorkerControlDone
from messages.transport import Sockets
from actors.worker.gpu_idle import GpuIdleProfile
from actors.worker.host_profile import HostProfile
from actors.structured_output.grammar_compiles import PendingCompiles
from actors.structured_output.grammar_processor import structured_outputs_of
from actors.worker.host_kv import host_tier_info
from messages.worker import CompileGrammar, StepPlan, WorkerInbox

logger = logging.getLogger(__name__)

# seconds between looks at a launched step's progress while no plan has come
_POLL_S = 0.0002


class WorkerActor(Actor):
    inbox_type = WorkerInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, runner, num_kv_blocks: int,
                 rank: int = 0, output_rank: int = 0,
                 grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        super().__init__(name, addresses, sockets)
        self.inbox.also(addresses[f"plans{rank}"], bind=False)  # the scheduler's executor binds it
        self.rank = rank
        self.runner = runner
        self.num_kv_blocks = num_kv_blocks
        # the rank that answers: 0, or the last pipeline stage's tensor-parallel rank 0
        self.to_scheduler = sockets.outbox(addresses["scheduler"]) if rank == output_rank else None
        self.sleep_mode = None  # a SleepMode once the engine has been asked to sleep
        self.idle_profile = GpuIdleProfile.from_env(str(getattr(runner, "device", "cpu")), rank)  # (a benchmark's)
        self.host_profile = HostProfile.from_env(rank)  # (a benchmark's)
        # asynchronous steps (the engine's async_scheduling): one step launched and not finished
        self.run_ahead = bool(getattr(runner, "engine", None) and runner.engine.scheduler.async_scheduling
                              and getattr(runner, "can_run_ahead", False))
        self.launched = None  # runner_step.LaunchedStep
        structured = structured_outputs_of(runner) if self.to_scheduler is not None else None
        # the rank that samples compiles grammars ahead of their requests (grammar_compiles.py)
        self.compiles = PendingCompiles(structured, grammar_compile_timeout) if structured is not None else None

    @classmethod
    def from_spec(cls, spec: ActorSpec, sockets: Sockets) -> WorkerActor:
        from actors.worker.device_config import resolve_device
        from actors.worker.model_runner import build_model_runner
        from actors.layers.tensor_parallel import TensorParallel

        rank = spec.options.get("rank", 0)
        engine = resolve_device(spec.engine, rank)
        if engine.parallel.pipeline_parallel_size > 1:
            from actors.worker.pipeline import build_stage_runner

            _join_group(engine, rank, engine.parallel.world_size, spec.options["distributed_init_method"])
            runner, num_blocks, output_rank = build_stage_runner(engine, rank)
            return cls(spec.name, spec.addresses, sockets, runner, num_blocks, rank, output_rank,
                       engine.grammar_compile_timeout)
        parallel = TensorParallel(rank, engine.parallel.tensor_parallel_size,
                                  expert_parallel=engine.parallel.enable_expert_parallel)
        if parallel.enabled:
            _join_group(engine, rank, parallel.size, spec.options["distributed_init_method"])
        runner, num_blocks = build_model_runner(engine, parallel)
        return cls(spec.name, spec.addresses, sockets, runner, num_blocks, rank,
                   grammar_compile_timeout=engine.grammar_compile_timeout)

    def close(self) -> None:
        self._finish_launched()
        if hasattr(self.runner, "close"):  # a pipeline stage's (actors/worker/pipeline.py)
            self.runner.close()
        if getattr(self.runner, "host_kv", None) is not None:
            self.runner.host_kv.close()  # the disk tier's writes finish

    def ready_info(self) -> dict:
        return {"num_kv_blocks": self.num_kv_blocks, "rank": self.rank,
                "weight_bytes": self.runner.num_weight_bytes(), **host_tier_info(self.runner)}

    def handle(self, message: StepPlan | WorkerControl | CompileGrammar) -> None:
        if isinstance(message, WorkerControl):
            self._finish_launched()
            self._control(message)
            return
        if isinstance(message, CompileGrammar):
            if self.compiles is not None:  # (the ranks that do not sample have no grammars)
                self.compiles.add(message.request_id, message.constraint)
            return
        started = self.host_profile.begin() if self.host_profile is not None else 0.0
        plan = message
        if not self.run_ahead:
            self._answer(plan, self.runner.execute(plan))
        else:
            # asynchronous steps: this plan is launched before the last one is finished, so the
            # device computes that one while the host prepares this one (runner_step.py); the
            # step left launched is answered when finished: at the next plan, or once it is done
            steps, self.launched = self.runner.step_ahead(plan, self.launched)
            for done, result in steps:
                self._answer(done, result)
        if self.idle_profile is not None and plan.num_scheduled_tokens:
            self.idle_profile.step()
        if self.host_profile is not None and plan.num_scheduled_tokens:
            decodes = all(n == 1 for n in plan.num_scheduled_tokens.values())
            self.host_profile.end(started, "decode only" if decodes else "with a prefill chunk")

    def has_work(self) -> bool:
        """A launched step whose device work is done is finished without waiting for a plan;
        grammars compiled (or past their time) are answered."""
        return ((self.launched is not None and self.launched.done())
                or (self.compiles is not None and self.compiles.has_answers()))

    def step(self) -> None:
        if self.launched is not None and self.launched.done():
            self._finish_launched()
        if self.compiles is not None:
            for answer in self.compiles.take_answers():
                self.to_scheduler.send(answer)

    def wake_after(self) -> float | None:
        """While a launched step runs: look again shortly (the next plan usually comes first;
        the poll is also shorter than the compiles' check); else when compiles are pending."""
        if self.launched is not None:
            return _POLL_S
        return self.compiles.wake_after() if self.compiles is not None else None

    def _finish_launched(self) -> None:
        launched, self.launched = self.launched, None
        if launched is not None:
            self._answer(launched.plan, self.runner.finish(launched))

    def _answer(self, plan: StepPlan, result) -> None:
        # a plan with disk loads is answered even without tokens: the scheduler waits for the loads
        if (plan.num_scheduled_tokens or plan.blocks_to_load) and self.to_scheduler is not None:
            self.to_scheduler.send(result)

    def _control(self, message: WorkerControl) -> None:
        """Sleep or wake (actors/worker/sleep_mode.py); rank 0 answers the scheduler."""
        from actors.worker.sleep_mode import SleepMode

        if self.sleep_mode is None:
            self.sleep_mode = SleepMode(self.runner)
        error = None
        try:
            if message.op == "sleep":
                self.sleep_mode.sleep(message.level)
            else:
                self.sleep_mode.wake_up(message.tags)
        except Exception as failure:  # noqa: BLE001 - reported to the scheduler, which answers the caller
            logger.exception("worker %s: %s failed", self.name, message.op)
            error = f"{type(failure).__name__}: {failure}"
        if self.to_scheduler is not None:
            self.to_scheduler.send(WorkerControlDone(message.op, error))


def _join_group(engine, rank: int, world_size: int, init_method: str) -> None:
    """torch.distributed for the workers (every tensor- and pipeline-parallel rank): NCCL
    between GPUs, gloo on the CPU (where the ranks also share the cores instead of each
    taking them all)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    on_cuda = engine.device.startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(torch.device(engine.device))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # a rank that dies leaves the others blocked in a collective: the launcher notices the
    # death and stops them; the timeout only bounds a rendezvous that never completes
    timeout = timedelta(seconds=600)
    store = _rendezvous_store(init_method, rank, world_size, timeout)
    dist.init_process_group("nccl" if on_cuda else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


def _rendezvous_store(init_method: str, rank: int, world_size: int, timeout):
    """torch.distributed's TCPStore at init_method ("tcp://host:port"), listening there only:
    given a host, TCPStore's server listens on every interface all the same, so rank 0
    binds the listening socket itself, where the user named, and hands it over."""
    import socket
    from urllib.parse import urlsplit

    import torch.distributed as dist

    url = urlsplit(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"distributed_init_method must be tcp://host:port, got {init_method!r}")
    if rank != 0:
        return dist.TCPStore(url.hostname, url.port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in url.hostname else socket.AF_INET
    listener = socket.create_server((url.hostname, url.port), family=family, backlog=max(128, world_size))
    return dist.TCPStore(url.hostname, url.port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())
