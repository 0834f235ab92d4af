"""The engine core in one process: scheduler, model runner and output processor, one
step at a time. The offline LLM drives it directly; the actors split the same objects
across processes."""

from __future__ import annotations

import logging

import torch

from actors.config.kv_groups import engine_kv_layout
from actors.config import EngineConfig
from actors.detokenizer.output_processor import OutputProcessor, RequestState
from actors.pooling.outputs import pooling_request_output
from actors.scheduler.kv_tiers import make_kv_tiers
from actors.scheduler.priority import make_scheduler
from actors.worker.host_kv import host_tier_info
from actors.worker.device_config import resolve_device
from actors.worker.model_runner import build_model_runner
from messages.common import RequestOutput, SamplingParams
from messages.lora import LoRARequest
from messages.pooling import PoolingParams, PoolingRequestOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, engine: EngineConfig, tokenizer) -> None:
        engine = resolve_device(engine)
        self.config = engine
        self.runner, self.num_blocks = build_model_runner(engine)
        self.scheduler = make_scheduler(engine.scheduler, engine.cache, self.num_blocks, engine.model.eos_token_ids,
                                        max_loras=engine.lora.max_loras if engine.lora else 0,
                                        pooling_type=engine.pooler.pooling_type if engine.pooler else None,
                                        generates=engine.model.can_generate, speculative=engine.speculative,
                                        kv_layout=engine_kv_layout(engine),
                                        kv_tiers=make_kv_tiers(engine.cache, **host_tier_info(self.runner)))
        # asynchronous scheduling: the next step launched before the last one is finished
        self.run_ahead = engine.scheduler.async_scheduling and self.runner.can_run_ahead
        self._launched = None  # the step launched last and not yet finished (runner_step.LaunchedStep)
        self.traces = None  # request spans, with otlp_traces_endpoint
        if engine.otlp_traces_endpoint:
            from actors.tracing.spans import EngineRequestTraces, RequestTracer

            self.traces = EngineRequestTraces(RequestTracer(engine.otlp_traces_endpoint,
                                                            engine.collect_detailed_traces is not None),
                                              engine.model.model_path)
        # each request's whole output comes from its state when it ends (RequestState.whole_output):
        # the step-by-step deltas are made only for the traces, which count their tokens
        self.outputs = OutputProcessor(tokenizer, makes_deltas=self.traces is not None)
        self._states: dict[str, RequestState] = {}  # request_id -> its output processor state, till it ends
        self.sleep_mode = None  # a SleepMode once asked to sleep (actors/worker/sleep_mode.py)
        self._pooling_ids: set[str] = set()  # live pooling requests (the output processor never sees them)
        logger.info("KV cache: %d blocks of %d tokens", self.num_blocks, engine.cache.block_size)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, pooling_params: PoolingParams | None = None,
                    priority: int = 0, mm_inputs: list | None = None) -> None:
        """A generation request, or with pooling_params a pooling one (no text: the
        detokenizer never sees it)."""
        if self.is_sleeping():
            raise RuntimeError("the engine is asleep: call wake_up() before sending requests")
        self.scheduler.add_request(request_id, prompt_token_ids, params, cache_salt=cache_salt,
                                   lora_request=lora_request, pooling_params=pooling_params, priority=priority,
                                   mm_inputs=mm_inputs or None)
        if pooling_params is not None:
            self._pooling_ids.add(request_id)
        else:
            self.outputs.add_request(request_id, prompt, prompt_token_ids, params)
            self._states[request_id] = self.outputs.requests[request_id]
            if self.traces is not None:
                self.traces.added(request_id, params, len(prompt_token_ids))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.scheduler.abort_request(request_id)
        if self.traces is not None:
            self.traces.finished(request_id)
        if request_id in self._pooling_ids:
            self._pooling_ids.discard(request_id)
            return None
        self.outputs.abort_request(request_id)
        state = self._states.pop(request_id, None)
        return state.whole_output() if state is not None else None

    def sleep(self, level: int = 1) -> None:
        """Preempts every request (each resumes after wake_up, recomputed), forgets the
        prefix cache and frees the runner's memory (actors/worker/sleep_mode.py)."""
        from actors.scheduler.control import preempt_all
        from actors.worker.sleep_mode import SleepMode

        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.finish_launched()  # (a step run ahead of the last output: nothing left to return)
        preempt_all(self.scheduler)
        self.scheduler.block_pool.reset_prefix_cache()
        self.sleep_mode = self.sleep_mode or SleepMode(self.runner)
        self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode is not None:
            self.sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and bool(self.sleep_mode.asleep)

    def reset_prefix_cache(self) -> bool:
        from actors.scheduler.control import reset_prefix_cache

        self.finish_launched()
        return reset_prefix_cache(self.scheduler)

    def close(self) -> None:
        """Sends the disk tier's last saves (the last result's blocks), lets the writes finish
        and lets the weights and KV cache go (the engine takes no more steps)."""
        self.finish_launched()
        tiers = self.scheduler.kv_tiers
        if tiers is not None and tiers.has_orders():
            self.step()
            self.finish_launched()
        if self.runner.host_kv is not None:
            self.runner.host_kv.close()
        # the device's memory goes now, not when the garbage collector finds the engine's
        # reference cycles (another engine in this process, or another process, wants it)
        self.runner.graphs.drop()
        self.runner.kv_caches = []
        self.runner.drop_weights()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One model step; returns the requests that finished in it. With asynchronous
        scheduling the step is launched before the one launched last is finished (the model
        runner's runs_ahead): on a GPU the host plans and prepares a step while the device
        computes the one before it; the outputs are the same."""
        plan = self.scheduler.schedule()
        if not self.run_ahead:
            return self._apply(plan, self.runner.execute(plan))
        steps, self._launched = self.runner.step_ahead(plan, self._launched)  # (the new one: finished next step)
        return [output for done, result in steps for output in self._apply(done, result)]

    def finish_launched(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Finishes the step launched last, if any (before the engine changes state)."""
        launched, self._launched = self._launched, None
        return self._apply(launched.plan, self.runner.finish(launched)) if launched is not None else []

    def _apply(self, plan, result) -> list[RequestOutput | PoolingRequestOutput]:
        """A step's result into the scheduler and the outputs: the requests that finished."""
        step_outputs = self.scheduler.update(plan, result)
        finished: list[RequestOutput | PoolingRequestOutput] = []
        for pooled in self.scheduler.take_pooling_results():
            self._pooling_ids.discard(pooled.request_id)
            finished.append(pooling_request_output(pooled))
        deltas, stops = self.outputs.process(step_outputs)
        for stop in stops:
            self.scheduler.finish_sequence(stop.request_id, stop.index, "stop", stop.stop)
        for delta in deltas:
            if self.traces is not None:
                self.traces.delta(delta)
            if delta.finished:
                finished.append(self._states.pop(delta.request_id).whole_output())
        return finished
