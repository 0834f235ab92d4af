"""The frontend: AsyncClient, in the caller's process and event loop.

The caller's calls (generate, chat, generate_batch; beam search, LoRA, pooling, engine
operations and request spans from the mixins beside this file) over self.engine, the
connection that make_engine_client (data_parallel.py) chose: one engine's EngineClient
(engine_client.py: the actor processes, the sockets, the request queues), or a
DataParallelClient of several. Each request gets an id and an output stream; giving up on
a stream (breaking out of it, cancelling its task) aborts the request everywhere.

    async with AsyncClient(model=path) as client:
        async for delta in client.generate("Hello", SamplingParams(max_tokens=16)):
            print(delta.outputs[0].text, end="")
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from actors.frontend.beam_search import AsyncBeamSearch
from actors.config import EngineConfig
from actors.detokenizer.merge_outputs import OutputMerger
from actors.engine.args import EngineArgs
from actors.engine.signature import takes_engine_args
from actors.frontend.data_parallel import make_engine_client
from actors.frontend.engine_control import EngineControlMixin
from actors.frontend.lora import LoRAClientMixin
from actors.multimodal.prompt_images import split_prompt_images
from actors.frontend.pooling import PoolingClientMixin
from actors.errors import EngineDeadError, InvalidRequestError
from actors.frontend.prompts import PromptInput, per_prompt, split_prompt
from actors.frontend.request_stream import RequestStream, broadcast_params, check_params
from actors.engine.supervisor import EngineProcesses
from actors.tracing.spans import ClientTracingMixin
from messages.common import RequestOutput, SamplingParams
from messages.frontend import (HistogramSnapshot)
from messages.input_processor import AddRequest, ChatOptions
from messages.lora import LoRARequest, check_lora_request

logger = logging.getLogger(__name__)

Prompt = str | list[int]

class AsyncClient(AsyncBeamSearch, LoRAClientMixin, PoolingClientMixin, EngineControlMixin, ClientTracingMixin):
    """Starts and supervises a troupe engine; generate() streams RequestOutput deltas;
    beam_search() (actors/frontend/beam_search.py) returns a prompt's finished beams; add_lora()
    and the rest (actors/frontend/lora.py) manage LoRA adapters; encode() and embed()
    (actors/frontend/pooling.py) run a pooling model."""

    @takes_engine_args
    def __init__(self, model: str | None = None, *, num_input_processors: int = 1, startup_timeout: float = 600.0,
                 log_level: str = "WARNING", transport: str = "ipc", **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_keywords("AsyncClient", model, engine_args)
        if not isinstance(num_input_processors, int) or num_input_processors < 1:
            raise ValueError(f"num_input_processors must be a positive integer, got {num_input_processors!r}")
        # one engine, or data_parallel_size of them behind one router (data_parallel.py)
        self.engine = make_engine_client(self.engine_args, num_input_processors=num_input_processors,
                                         startup_timeout=startup_timeout, log_level=log_level, transport=transport)
        self._tokenizer = None

    # ---- life cycle ----

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- life cycle and health: the engine's (engine_client.py, data_parallel.py) ----

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        """Stops every actor process and fails whatever is still pending. Idempotent."""
        await self.engine.close()

    @property
    def config(self) -> EngineConfig | None:
        return self.engine.config

    @property
    def processes(self) -> EngineProcesses | None:
        """The actor processes of a single engine (None with data parallelism)."""
        return getattr(self.engine, "processes", None)

    @property
    def is_running(self) -> bool:
        return self.engine.is_running

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.engine.dead_error

    def check_health(self) -> None:
        """Raises EngineDeadError unless the engine's processes are alive."""
        self.engine.check_health()

    async def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time in seconds for every actor to answer a Ping (each answers between
        two of its steps). Raises EngineDeadError when one is dead, TimeoutError when one
        does not answer in time."""
        return await self.engine.ping(timeout)

    async def wait_until_dead(self) -> EngineDeadError:
        """Returns (the error) once the engine has died or been closed."""
        return await self.engine.wait_until_dead()

    async def abort(self, request_id: str) -> None:
        """Ends a request wherever it is; its stream gets a last output with
        finish_reason "abort". Unknown or finished ids are ignored."""
        await self.engine.abort(request_id)

    async def get_stats(self, timeout: float = 10.0) -> dict[str, float | HistogramSnapshot]:
        """The scheduler's counters: running and waiting requests, KV blocks held and free,
        prefix-cache hits, preemptions, and a histogram of tokens per step."""
        return await self.engine.get_stats(timeout)

    stats = get_stats  # the same, under a shorter name

    def actor_pids(self) -> dict[str, int]:
        """Actor name ("worker0", "scheduler", ...) -> process id."""
        return self.engine.actor_pids()

    @property
    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests

    def _run(self, request: AddRequest, prompt_text: str | None) -> AsyncIterator[RequestOutput]:
        return self.engine._run(request, prompt_text)

    async def _control(self, op: str, level: int = 1, tags: list[str] | None = None) -> dict:
        return await self.engine._control(op, level, tags)

    # ---- requests ----

    def generate(self, prompt: PromptInput, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0, add_special_tokens: bool | None = None,
                 lora_request: LoRARequest | None = None) -> RequestStream:
        """Streams the request's RequestOutput deltas: each holds the text and tokens that
        are new since the last one; the last has finished=True. The request starts when
        the stream is first iterated (or awaited, which gives the whole output); leaving
        the stream early aborts it. prompt: text, token ids, or vLLM's dict prompt
        ({"prompt": text} or {"prompt_token_ids": ids}, with an optional "cache_salt", and a vision
        model's "multi_modal_data": {"image": a PIL image or a list}); lora_request: the adapter."""
        # the worker is another process: logits processors travel by name (--logits-processors)
        params = check_params(sampling_params).with_named_processors()
        prompt, images = split_prompt_images(prompt)
        prompt, cache_salt = split_prompt(prompt)
        request = AddRequest(request_id=self._new_id(request_id), prompt=prompt, params=params,
                             arrival_time=time.time(), add_special_tokens=add_special_tokens, priority=priority,
                             cache_salt=cache_salt, lora_request=check_lora_request(lora_request), images=images)
        return RequestStream(self._traced(self._run(request, prompt if isinstance(prompt, str) else None), request))

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
             request_id: str | None = None, add_generation_prompt: bool = True, *,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, documents: list[dict[str, Any]] | None = None,
             add_special_tokens: bool = False, priority: int = 0, cache_salt: str | None = None,
             tools: list[dict[str, Any]] | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """generate() for a conversation, rendered with the chat template (chat_template,
        else the model's) with vLLM's options."""
        # the worker is another process: logits processors travel by name (--logits-processors)
        params = check_params(sampling_params).with_named_processors()
        if not isinstance(messages, list):
            raise InvalidRequestError("messages must be a list of {'role', 'content'} objects", param="messages")
        chat = ChatOptions(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                           documents=documents, tools=tools)
        request = AddRequest(request_id=self._new_id(request_id), messages=messages, chat=chat, params=params,
                             arrival_time=time.time(), add_special_tokens=add_special_tokens, priority=priority,
                             cache_salt=cache_salt, lora_request=check_lora_request(lora_request))
        return RequestStream(self._traced(self._run(request, None), request))

    async def generate_batch(self, prompts: Sequence[PromptInput],
                             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                             use_tqdm: bool = True, priority: Sequence[int] | None = None,
                             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                             ) -> list[RequestOutput]:
        """Every prompt at once; the whole outputs, in prompt order. sampling_params,
        priority and lora_request may be one per prompt."""
        from tqdm import tqdm

        params_list = broadcast_params(sampling_params, len(prompts))
        priorities = per_prompt(priority, len(prompts), "priority", 0)
        loras = per_prompt(lora_request, len(prompts), "lora_request", None)
        progress = tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm)
        start, num_output_tokens = time.perf_counter(), 0

        async def run_one(prompt: PromptInput, params: SamplingParams, priority: int,
                          lora: LoRARequest | None) -> RequestOutput:
            nonlocal num_output_tokens
            merger = OutputMerger()  # (each completion's text joined once, at the end)
            async for delta in self.generate(prompt, params, priority=priority, lora_request=lora):
                merger.add(delta)
                num_output_tokens += sum(len(c.token_ids) for c in delta.outputs)
            progress.update(1)
            progress.set_postfix_str(f"{num_output_tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s out")
            return merger.result()

        tasks = [asyncio.ensure_future(run_one(*args)) for args in zip(prompts, params_list, priorities, loras)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()  # after a failure, the rest are aborted
            await asyncio.gather(*tasks, return_exceptions=True)
            progress.close()

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        return request_id

    # ---- tokenizer, for the HTTP API's /tokenize and /detokenize ----

    async def get_tokenizer(self):
        if self._tokenizer is None:
            from actors.models.loader import load_tokenizer

            assert self.config is not None, "start() the client first"
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer_path)
        return self._tokenizer
