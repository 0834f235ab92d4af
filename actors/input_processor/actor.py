"""The input processor actor: receives AddRequest from the frontend and sends
TokenizedRequest to the scheduler, or RequestRejected back to the frontend, around the
plain InputProcessor (processor.py). Owns a tokenizer and nothing else, so several can run
side by side (the frontend picks one per request: actors/frontend/input_routing.py)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import msgspec

from actors.input_processor.processor import InputProcessor, check_reasoning_markers, image_inputs
from actors.lora.checker import LoRAChecker
from actors.multimodal.fetch import fetch_message_images, has_http_images
from actors.multimodal.inputs import ImageInputs, split_image_parts
from actors.multimodal.prompt_images import fetch_prompt_images, has_http_prompt_images, multi_modal_data_of
from actors.runtime.actor import Actor, ActorSpec
from messages.common import InvalidRequestError
from messages.frontend import RequestRejected, RequestTokenized
from messages.input_processor import AddRequest, InputProcessorInbox
from messages.multimodal import MultiModalInput
from messages.scheduler import TokenizedRequest
from messages.transport import Sockets

logger = logging.getLogger(__name__)


class InputProcessorActor(Actor):
    """Receives AddRequest; sends TokenizedRequest to the scheduler or RequestRejected to
    the frontend. Owns a tokenizer.

    The work of a request (its chat template, tokenization, image decoding) runs on one
    thread beside the actor's loop, so the loop keeps answering pings and taking messages
    while a template renders (within --chat-template-timeout) or an image decodes (within
    the pixel limits); one thread keeps the requests in their order to the scheduler."""

    inbox_type = InputProcessorInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, processor: InputProcessor) -> None:
        super().__init__(name, addresses, sockets)
        self.to_scheduler = sockets.outbox(addresses["scheduler"])
        self.processor = processor
        self._work = ThreadPoolExecutor(max_workers=1, thread_name_prefix="troupe-input-processing")
        self._tasks: set[asyncio.Task] = set()  # requests being fetched or processed

    @classmethod
    def from_spec(cls, spec: ActorSpec, sockets: Sockets) -> InputProcessorActor:
        from actors.models.loader import load_tokenizer

        engine = spec.engine
        tokenizer = load_tokenizer(engine.tokenizer_path)
        check_reasoning_markers(tokenizer, engine.reasoning_parser)
        processor = InputProcessor(tokenizer, engine.model.vocab_size, engine.scheduler.max_model_len,
                                   engine.max_logprobs, engine.structured_outputs_backend,
                                   LoRAChecker(engine.model, engine.lora), engine.pooler, engine.model.hidden_size,
                                   engine.model.can_generate, engine.scheduler.scheduling_policy == "priority",
                                   image_inputs(engine, tokenizer), engine.inputs.chat_template_timeout)
        processor.allowed_processors, processor.max_grammar_bytes = engine.logits_processors, engine.max_grammar_bytes
        return cls(spec.name, spec.addresses, sockets, processor)

    def handle(self, message: AddRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._process(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        self._work.shutdown(wait=False, cancel_futures=True)

    async def _process(self, message: AddRequest) -> None:
        images = self.processor.images
        if images is not None and (has_http_images(message.messages) or has_http_prompt_images(message.images)):
            # downloads run on threads of their own; the request is processed when they are done
            try:
                message = await self._fetch(message, images)
            except Exception as error:  # noqa: BLE001 - one bad request must not end the actor
                self._reject_error(message.request_id, error, "fetching images")
                return
        try:
            _, token_ids, mm_inputs = await asyncio.get_running_loop().run_in_executor(
                self._work, self._tokenize, message)
        except Exception as error:  # noqa: BLE001 - one bad request must not end the actor
            self._reject_error(message.request_id, error, "input processing")
            return
        self.to_scheduler.send(TokenizedRequest(request_id=message.request_id, prompt_token_ids=token_ids,
                                                params=message.params, arrival_time=message.arrival_time,
                                                cache_salt=message.cache_salt, priority=message.priority,
                                                lora_request=message.lora_request,
                                                pooling_params=message.pooling_params, mm_inputs=mm_inputs or None))
        self.to_frontend.send(RequestTokenized(message.request_id))  # the frontend need not fail it if we die

    @staticmethod
    async def _fetch(message: AddRequest, images: ImageInputs) -> AddRequest:
        """The request with its http(s) images downloaded (as bytes), after their count is checked."""
        if message.images:  # a prompt dict's
            images.check_count(len(message.images), "multi_modal_data")
            return msgspec.structs.replace(message, images=await fetch_prompt_images(message.images,
                                                                                     images.fetch_policy))
        _, parts = split_image_parts(message.messages, images.placeholder)
        images.check_count(len(parts), "messages")  # before anything is downloaded
        return msgspec.structs.replace(message, messages=await fetch_message_images(message.messages,
                                                                                   images.fetch_policy))

    def _tokenize(self, message: AddRequest) -> tuple[str | None, list[int], list[MultiModalInput]]:
        if message.prompt is None and message.messages is None:
            raise InvalidRequestError("a request needs a prompt or messages", param="prompt")
        return self.processor.process_media(message.prompt, message.params, messages=message.messages,
                                            chat=message.chat, add_special_tokens=message.add_special_tokens,
                                            priority=message.priority, cache_salt=message.cache_salt,
                                            lora_request=message.lora_request, pooling_params=message.pooling_params,
                                            multi_modal_data=multi_modal_data_of(message.images))

    def _reject_error(self, request_id: str, error: Exception, what: str) -> None:
        """A request's error to the frontend: the caller's (HTTP 400), or ours (logged)."""
        if isinstance(error, InvalidRequestError):
            self._reject(request_id, str(error), "invalid_request", error.param)
        else:
            logger.error("request %s: %s failed", request_id, what, exc_info=error)
            # the reason is in the log: an exception's text may hold a repr, a path, a memory address
            self._reject(request_id, f"{what} failed (the server log has the details)", "internal_error", None)

    def _reject(self, request_id: str, text: str, error_type: str, param: str | None) -> None:
        self.to_frontend.send(RequestRejected(request_id=request_id, message=text, error_type=error_type,
                                              param=param))
