"""The engine core in one process: scheduler, model runner and output processor, one
step at a time. The offline LLM drives it directly; the actors split the same objects
across processes."""

from __future__ import annotations

import logging

from actors.config import EngineConfig
from actors.detokenizer import OutputProcessor, merge_delta
from actors.scheduler.scheduler import Scheduler
from actors.worker.model_runner import build_model_runner, resolve_device
from messages.common import RequestOutput, SamplingParams
from messages.lora import LoRARequest

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, engine: EngineConfig, tokenizer) -> None:
        engine = resolve_device(engine)
        self.config = engine
        self.runner, self.num_blocks = build_model_runner(engine)
        self.scheduler = Scheduler(engine.scheduler, engine.cache, self.num_blocks, engine.model.eos_token_ids,
                                   max_loras=engine.lora.max_loras if engine.lora else 0)
        self.outputs = OutputProcessor(tokenizer)
        self._accumulated: dict[str, RequestOutput] = {}  # request_id -> its output so far
        logger.info("KV cache: %d blocks of %d tokens", self.num_blocks, engine.cache.block_size)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, params, cache_salt=cache_salt,
                                   lora_request=lora_request)
        self.outputs.add_request(request_id, prompt, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.scheduler.abort_request(request_id)
        delta = self.outputs.abort_request(request_id)
        accumulated = self._accumulated.pop(request_id, None)
        return merge_delta(accumulated, delta) if delta is not None else accumulated

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One model step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        updates = self.scheduler.update(plan, result)
        deltas, stops = self.outputs.process(updates)
        for stop in stops:
            self.scheduler.finish_sequence(stop.request_id, stop.index, "stop", stop.stop)
        finished = []
        for delta in deltas:
            whole = merge_delta(self._accumulated.get(delta.request_id), delta)
            if delta.finished:
                self._accumulated.pop(delta.request_id, None)
                finished.append(whole)
            else:
                self._accumulated[delta.request_id] = whole
        return finished
