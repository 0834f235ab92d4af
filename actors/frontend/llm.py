"""The offline entry point: LLM(model).generate(prompts, params) -> list[RequestOutput]."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from actors.frontend.beam_search import BeamPrompt, BeamSearchBatch, BeamSearchOutput, BeamSearchParams
from actors.engine.args import EngineArgs
from actors.engine.signature import takes_engine_args
from actors.config.parallel_flags import runs_in_process
from actors.engine.core import EngineCore
from actors.input_processor.processor import InputProcessor, check_reasoning_markers, image_inputs
from actors.lora.checker import LoRAChecker
from actors.frontend.llm_pooling import LLMPoolingMixin
from actors.frontend.prompts import PromptInput, per_prompt, prompt_list, split_media, split_prompt
from actors.frontend.request_stream import broadcast_params
from actors.models.loader import load_tokenizer
from messages.common import InvalidRequestError, RequestOutput, SamplingParams
from messages.control import check_wake_tags
from messages.input_processor import ChatOptions
from messages.lora import LoRARequest
from messages.pooling import PoolingParams, PoolingRequestOutput


class LLM(LLMPoolingMixin):
    """Generates for a batch of prompts at once, scheduling them all together (or, for a
    pooling model, embeds or classifies them: encode, embed, classify, score).

    With one device the engine core runs in this process, one step at a time. With
    tensor_parallel_size > 1 it needs a worker process per device, so the whole actor
    engine runs behind an AsyncClient on a background thread: the same scheduler, workers
    and detokenizer code either way."""

    @takes_engine_args
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """engine_args: EngineArgs's fields (actors/engine/args.py), the launcher's engine
        flags as keywords: max_num_seqs=..., kv_cache_memory="1GiB", device="cuda", ..."""
        args = EngineArgs.from_keywords("LLM", model, engine_args)
        self.config = args.build()
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)
        self.engine = EngineCore(self.config, self.tokenizer) if runs_in_process(self.config.parallel) \
            else None
        self._remote = ThreadedClient(args) if self.engine is None else None
        check_reasoning_markers(self.tokenizer, self.config.reasoning_parser)
        self.inputs = InputProcessor(self.tokenizer, self.config.model.vocab_size,
                                     self.config.scheduler.max_model_len, self.config.max_logprobs,
                                     self.config.structured_outputs_backend,
                                     LoRAChecker(self.config.model, self.config.lora), self.config.pooler,
                                     self.config.model.hidden_size, self.config.model.can_generate,
                                     self.config.scheduler.scheduling_policy == "priority",
                                     image_inputs(self.config, self.tokenizer),
                                     self.config.inputs.chat_template_timeout)
        self.inputs.allowed_processors = self.config.logits_processors
        self.inputs.max_grammar_bytes = self.config.max_grammar_bytes
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer (a transformers tokenizer), as vLLM's LLM.get_tokenizer()."""
        return self.tokenizer

    @property
    def scheduler(self):
        if self.engine is None:
            raise AttributeError("the scheduler runs in its own process with several workers or replicas")
        return self.engine.scheduler

    def sleep(self, level: int = 1) -> None:
        """Frees the engine's memory until wake_up() (vLLM's sleep mode): level 1 drops the KV
        cache and moves the weights to host memory, level 2 drops both (wake_up reloads
        them). Requests cannot run meanwhile; greedy output after waking is unchanged."""
        self._engine_call("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Brings back what sleep() freed: "weights" and/or "kv_cache" (None: both)."""
        self._engine_call("wake_up", check_wake_tags(tags))

    def is_sleeping(self) -> bool:
        return self._engine_call("is_sleeping")

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache; False (nothing changed) while requests hold KV blocks."""
        return self._engine_call("reset_prefix_cache")

    def _engine_call(self, name: str, *args):
        if self.engine is not None:
            return getattr(self.engine, name)(*args)
        return self._remote._call(getattr(self._remote.client, name)(*args))

    def close(self) -> None:
        """Stops the engine's processes (tensor_parallel_size > 1); idempotent."""
        if self._remote is not None:
            self._remote.close()
        elif self.engine is not None:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 logits_processors: Sequence[Callable] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a vLLM prompt dict ({"prompt": ...} or
        {"prompt_token_ids": ...}, optionally with "cache_salt"), or a list of these.
        sampling_params, priority and lora_request (the adapter each prompt runs with;
        None: the base model) may be one per prompt; logits_processors (see
        SamplingParams.logits_processors) apply to every prompt, after each one's own.
        Outputs come back in prompt order. Any invalid prompt or parameter raises
        InvalidRequestError (a ValueError) before any request is added, so the engine
        keeps its other work."""
        inputs = [split_media(prompt) for prompt in prompt_list(prompts)]  # (prompt, its images)
        split = [split_prompt(prompt) for prompt, _ in inputs]
        params_list = broadcast_params(sampling_params, len(split))
        if logits_processors:
            params_list = [msgspec.structs.replace(p, logits_processors=[*(p.logits_processors or []),
                                                                         *logits_processors]) for p in params_list]
        priorities = per_prompt(priority, len(split), "priority", 0)
        loras = per_prompt(lora_request, len(split), "lora_request", None)
        processed = [self.inputs.process_media(prompt, params, priority=prio, cache_salt=salt, lora_request=lora,
                                               multi_modal_data=media)
                     for (prompt, salt), params, prio, lora, (_, media)
                     in zip(split, params_list, priorities, loras, inputs)]
        if self._remote is not None:
            if any(mm for _, _, mm in processed):
                raise InvalidRequestError("images with several devices (LLM over AsyncClient) are not supported yet",
                                          param="multi_modal_data")
            params_list = [p.with_named_processors() for p in params_list]
            tokens_prompts = [{"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
                              for (_, ids, _), (_, salt) in zip(processed, split)]
            outputs = self._remote.generate_batch(tokens_prompts, params_list, use_tqdm, loras, priorities)
            for output, (text, _, _) in zip(outputs, processed):
                output.prompt = text
            return outputs
        return self._run(self._add_requests((text, token_ids, params, salt, lora, None, prio, mm)
                                            for (text, token_ids, mm), params, (_, salt), lora, prio
                                            in zip(processed, params_list, split, loras, priorities)), use_tqdm)

    def _add_requests(self, requests: Iterable[tuple]) -> list[str]:
        """Adds every (text, token ids, sampling params, cache salt, LoRA, pooling params[,
        priority]) to the engine core, or none: one the scheduler refuses aborts those added
        before it."""
        request_ids: list[str] = []
        try:
            for text, token_ids, params, salt, lora, pooling, *extra in requests:  # extra: [priority[, images]]
                request_id = str(next(self._request_counter))
                self.engine.add_request(request_id, text, token_ids, params, cache_salt=salt, lora_request=lora,
                                        pooling_params=pooling, priority=extra[0] if extra else 0,
                                        mm_inputs=extra[1] if len(extra) > 1 else None)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             documents: list[dict] | None = None, tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations, rendered with
        chat_template (else the model's) and vLLM's chat options."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = ChatOptions(add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, chat_template=chat_template,
                              chat_template_kwargs=chat_template_kwargs, documents=documents, tools=tools)
        prompts = [self.inputs.render_chat_prompt(c, options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: BeamPrompt | Sequence[BeamPrompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: prompts are strings, token id lists or vLLM's dict prompts
        ({"prompt": ...} / {"prompt_token_ids": [...]}), one or a list. Each step runs every
        live beam of every prompt as one batch; see actors/frontend/beam_search.py. Returns one
        BeamSearchOutput per prompt, in prompt order, its sequences best first. lora_request:
        the adapter of each prompt's beams (one for all, or one per prompt), as vLLM's."""
        batch = BeamSearchBatch.from_prompts(prompt_list(prompts), params, self.inputs, self.config.model.eos_token_ids)
        loras = per_prompt(lora_request, len(batch.searches), "lora_request", None)
        with tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm) as progress:
            while not batch.done:
                requests = batch.requests()
                batch.advance(self.generate(requests, batch.step_params, use_tqdm=False,
                                            lora_request=batch.per_request(loras)))
                progress.update(1)
        return [search.output(self.tokenizer) for search in batch.searches]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        results: dict[str, RequestOutput | PoolingRequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        start, num_output_tokens = time.perf_counter(), 0
        try:
            while len(results) < len(request_ids):
                for output in self.engine.step():
                    results[output.request_id] = output
                    if isinstance(output, RequestOutput):
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    progress.update(1)
                    elapsed = time.perf_counter() - start
                    progress.set_postfix_str(f"{num_output_tokens / max(elapsed, 1e-9):.1f} tok/s out")
        except BaseException:
            for request_id in request_ids:  # leave no half-run request behind
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        finally:
            progress.close()
        return [results[request_id] for request_id in request_ids]


class ThreadedClient:
    """An AsyncClient on its own event loop in a daemon thread, for synchronous callers."""

    def __init__(self, args: EngineArgs) -> None:
        import asyncio
        import threading

        from actors.frontend.client import AsyncClient

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="troupe-engine", daemon=True)
        self._thread.start()
        self.client = AsyncClient(**vars(args))
        self._call(self.client.start())

    def _call(self, coroutine):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams], use_tqdm: bool,
                       loras: list[LoRARequest | None], priorities: list[int]) -> list[RequestOutput]:
        return self._call(self.client.generate_batch(prompts, params, use_tqdm=use_tqdm, lora_request=loras,
                                                     priority=priorities))

    def encode_batch(self, prompts: list[list[int]], params: list[PoolingParams],
                     loras: list[LoRARequest | None]) -> list[PoolingRequestOutput]:
        import asyncio

        async def encode_all() -> list[PoolingRequestOutput]:
            return list(await asyncio.gather(*(self.client.encode(prompt, p, lora_request=lora)
                                               for prompt, p, lora in zip(prompts, params, loras))))

        return self._call(encode_all())

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
