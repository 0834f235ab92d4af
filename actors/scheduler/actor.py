"""The scheduler actor: a thin shell around Scheduler.

Receives TokenizedRequest (input processors), AbortRequest and GetStats (frontend),
FinishRequest (detokenizer) and StepResult and GrammarCompiled (worker rank 0). A request
with structured outputs waits here, unscheduled, until the worker that samples has compiled
its grammar (CompileGrammar, actors/structured_output/grammar_compiles.py): no step waits for one. Sends StepPlans to every
worker rank through its Executor (actors/scheduler/executor.py, in this process); TrackRequest,
StepOutputs and AbortRequest to the detokenizer, on one pipe so that a request is always
tracked before its first tokens arrive; Stats, RequestRejected and the pooled outputs of
pooling requests (which have no text, so skip the detokenizer) to the frontend. Owns
every request's scheduling state, the KV block pool and the links to the workers."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque

from actors.config.kv_groups import engine_kv_layout
from actors.runtime.actor import Actor, ActorSpec
from actors.config import SchedulerConfig
from actors.scheduler.executor import Executor
from actors.scheduler.kv_tiers import make_kv_tiers
from actors.scheduler.pipeline_plans import keep_pipeline_full
from actors.scheduler.priority import make_scheduler
from actors.scheduler.control import EngineControlState
from actors.scheduler.scheduler import Scheduler
from actors.scheduler.step_timing import StepTimer
from messages.control import EngineControl, WorkerControlDone
from messages.detokenizer import TrackRequest
from messages.frontend import PoolingOutputs, RequestRejected, Stats
from messages.scheduler import (AbortRequest, FinishRequest, GetStats, GrammarCompiled, SchedulerInbox,
                                StepResult, TokenizedRequest)
from messages.transport import Sockets
from messages.worker import CompileGrammar, StepPlan

logger = logging.getLogger(__name__)

# Aborts of ids the scheduler has not seen are remembered (the request may still be in an
# input processor), up to this many; the oldest are forgotten first.
_MAX_EARLY_ABORTS = 100_000


class SchedulerActor(Actor):
    inbox_type = SchedulerInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, scheduler: Scheduler,
                 scheduler_config: SchedulerConfig, executor: Executor) -> None:
        super().__init__(name, addresses, sockets)
        self.executor = executor
        self.to_detokenizer = sockets.outbox(addresses["detokenizer"])
        self.scheduler = scheduler
        self.plans_in_flight: deque[StepPlan] = deque()
        self.max_plans_in_flight = 2 if scheduler_config.async_scheduling else 1
        self.step_timer = StepTimer()  # when to build the second plan in flight
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        # Set when schedule() found nothing to do; any message may change that.
        self._nothing_to_schedule = False
        self.control = EngineControlState(self)  # sleep, wake-up, prefix-cache reset
        self._compiling: dict[str, TokenizedRequest] = {}  # request_id -> a request whose grammar compiles

    @classmethod
    def from_spec(cls, spec: ActorSpec, sockets: Sockets) -> SchedulerActor:
        engine = spec.engine
        scheduler = make_scheduler(engine.scheduler, engine.cache, spec.options["num_kv_blocks"],
                                   engine.model.eos_token_ids, max_loras=engine.lora.max_loras if engine.lora else 0,
                                   pooling_type=engine.pooler.pooling_type if engine.pooler else None,
                                   generates=engine.model.can_generate, speculative=engine.speculative,
                                   kv_layout=engine_kv_layout(engine),
                                   kv_tiers=make_kv_tiers(engine.cache, spec.options.get("num_host_kv_blocks", 0),
                                                          spec.options.get("swap_is_cheaper", False),
                                                          spec.options.get("disk_block_hashes")))
        executor = Executor(sockets, spec.addresses, engine.parallel.world_size)
        actor = cls(spec.name, spec.addresses, sockets, scheduler, engine.scheduler, executor)
        keep_pipeline_full(actor, engine.parallel.pipeline_parallel_size)
        return actor

    def close(self) -> None:
        self.executor.close()

    def ready_info(self) -> dict:
        return {"num_kv_blocks": self.scheduler.block_pool.num_blocks}

    # ---- messages ----

    def handle(self, message) -> None:
        self._nothing_to_schedule = False
        match message:
            case StepResult():
                self._apply_result(message)
            case TokenizedRequest(params=params) if params.structured_outputs is not None:
                self._compiling[message.request_id] = message
                self.executor.submit(CompileGrammar(message.request_id, params.structured_outputs))
            case TokenizedRequest():
                self._add_request(message)
            case GrammarCompiled():
                self._grammar_compiled(message)
            case AbortRequest(request_id=request_id):
                if self._compiling.pop(request_id, None) is not None:
                    return  # its grammar's answer finds nothing to schedule
                if self.scheduler.has_request(request_id):
                    self.scheduler.abort_request(request_id)
                    self.to_detokenizer.send(message)
                else:
                    self._remember_early_abort(request_id)
            case FinishRequest(request_id=request_id, index=index, stop=stop):
                self.scheduler.finish_sequence(request_id, index, "stop", stop)
            case EngineControl():
                self.control.request(message)
            case WorkerControlDone():
                self.control.worker_done(message)
            case GetStats(query_id=query_id):
                stats = {**self.scheduler.stats(), "num_plans_in_flight": len(self.plans_in_flight)}
                self.to_frontend.send(Stats(query_id=query_id, stats=stats))

    def _add_request(self, request: TokenizedRequest) -> None:
        if request.request_id in self._early_aborts:
            del self._early_aborts[request.request_id]
            return  # aborted while it was being tokenized
        try:
            self.scheduler.add_request(request.request_id, request.prompt_token_ids, request.params,
                                       cache_salt=request.cache_salt, lora_request=request.lora_request,
                                       pooling_params=request.pooling_params, priority=request.priority,
                                       mm_inputs=request.mm_inputs)
        except ValueError as error:
            self.to_frontend.send(RequestRejected(request_id=request.request_id, message=str(error),
                                                  param=getattr(error, "param", None)))
            return
        if request.pooling_params is not None:
            return  # no text: its output goes straight to the frontend
        self.to_detokenizer.send(TrackRequest(request_id=request.request_id,
                                              prompt_token_ids=request.prompt_token_ids, params=request.params))

    def _grammar_compiled(self, answer: GrammarCompiled) -> None:
        request = self._compiling.pop(answer.request_id, None)
        if request is None:
            return  # aborted while its grammar compiled
        if answer.error is not None:
            self.to_frontend.send(RequestRejected(request_id=request.request_id, message=answer.error,
                                                  param=answer.param))
        else:
            self._add_request(request)

    def _apply_result(self, result: StepResult) -> None:
        if not self.plans_in_flight or self.plans_in_flight[0].step_id != result.step_id:
            expected = self.plans_in_flight[0].step_id if self.plans_in_flight else None
            raise RuntimeError(f"StepResult for step {result.step_id}, expected step {expected}")
        plan = self.plans_in_flight.popleft()
        self.step_timer.finished(plan.step_id, time.monotonic())
        outputs = self.scheduler.update(plan, result)
        if not outputs.is_empty():
            self.to_detokenizer.send(outputs)
        pooled = self.scheduler.take_pooling_results()
        if pooled:
            self.to_frontend.send(PoolingOutputs(pooled))
        self.control.progress()  # a sleep may have waited for this plan

    def _remember_early_abort(self, request_id: str) -> None:
        self._early_aborts[request_id] = None
        while len(self._early_aborts) > _MAX_EARLY_ABORTS:
            self._early_aborts.popitem(last=False)

    # ---- steps ----

    def has_work(self) -> bool:
        if len(self.plans_in_flight) >= self.max_plans_in_flight or self._nothing_to_schedule \
                or self.control.holds_steps:
            return False
        tiers = self.scheduler.kv_tiers  # the disk tier's saves of the last result's blocks
        if not (self.scheduler.has_unfinished() or self.scheduler.has_pending_drops()
                or (tiers is not None and tiers.has_orders())):
            return False
        return not self.plans_in_flight or self.step_timer.dispatch_delay(time.monotonic()) <= 0

    def wake_after(self) -> float | None:
        """While one plan runs and the next waits for its time (StepTimer)."""
        if (len(self.plans_in_flight) != 1 or self.max_plans_in_flight < 2 or self._nothing_to_schedule
                or not self.scheduler.has_unfinished()):
            return None
        delay = self.step_timer.dispatch_delay(time.monotonic())
        return delay if delay > 0 else None

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.num_scheduled_tokens or plan.blocks_to_load:  # (disk loads are answered too)
            self.plans_in_flight.append(plan)
            # a speculated decode computes its drafts too
            num_tokens = sum(plan.num_scheduled_tokens.values()) + sum(plan.num_lookahead_tokens.values())
            self.step_timer.sent(plan.step_id, num_tokens, time.monotonic())
            self.executor.submit(plan)
        elif plan.finished_request_ids or plan.blocks_to_save:
            self.executor.submit(plan)  # only drops worker state or saves blocks: no result comes back
        else:
            self._nothing_to_schedule = True
