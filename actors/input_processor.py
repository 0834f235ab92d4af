"""Input processing: chat template, tokenization and validation of a request before it
reaches the scheduler.

InputProcessor is the plain logic (the offline LLM calls it in-process); the actor
receives AddRequest from the frontend and sends TokenizedRequest to the scheduler, or
RequestRejected back to the frontend. It owns a tokenizer and nothing else, so several
can run side by side (the frontend's PUSH socket balances requests across them)."""

from __future__ import annotations

import logging
from typing import Any

from jinja2 import TemplateError

from actors.actor import Actor, ActorSpec
from messages.common import InvalidRequestError, SamplingParams
from messages.frontend import RequestRejected
from messages.input_processor import AddRequest, InputProcessorInbox
from messages.scheduler import TokenizedRequest
from messages.transport import Sockets

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                                      "objects", param="messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("this model's tokenizer has no chat template", param="messages")
        conversation = [_text_message(message) for message in messages]
        try:
            rendered = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
        except TemplateError as error:  # e.g. a template that insists roles alternate
            raise InvalidRequestError(f"the chat template rejected the messages: {error}",
                                      param="messages") from error
        # the template already holds any BOS token
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def process(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids) after validating both."""
        params.validate()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        self.check_prompt_tokens(token_ids)
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token id {bad[0]} is out of range [0, {self.vocab_size})",
                                      param="logit_bias")
        return text, token_ids

    def check_prompt_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})",
                                      param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(token_ids)} tokens long; this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} tokens and at least one token must be left "
                "for the output",
                param="prompt")


def _text_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a string: OpenAI's list of content parts is joined."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise InvalidRequestError("each message needs a string 'role'", param="messages")
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                          param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError("message content must be a string or a list of text parts", param="messages")
    return {**message, "role": role, "content": content}


class InputProcessorActor(Actor):
    """Receives AddRequest; sends TokenizedRequest to the scheduler or RequestRejected to
    the frontend. Owns a tokenizer."""

    inbox_type = InputProcessorInbox

    def __init__(self, name: str, addresses: dict[str, str], sockets: Sockets, processor: InputProcessor) -> None:
        super().__init__(name, addresses, sockets)
        # requests arrive on the frontend's shared PUSH socket, balanced across processors
        self.inbox.socket.connect(addresses["input_processor"])
        self.to_scheduler = sockets.outbox(addresses["scheduler"])
        self.processor = processor

    @classmethod
    def from_spec(cls, spec: ActorSpec, sockets: Sockets) -> InputProcessorActor:
        from actors.worker.loader import load_tokenizer

        engine = spec.engine
        processor = InputProcessor(load_tokenizer(engine.tokenizer_path), engine.model.vocab_size,
                                   engine.scheduler.max_model_len)
        return cls(spec.name, spec.addresses, sockets, processor)

    def handle(self, message: AddRequest) -> None:
        try:
            token_ids = self._tokenize(message)
        except InvalidRequestError as error:
            self._reject(message.request_id, str(error), "invalid_request", error.param)
            return
        except Exception as error:  # noqa: BLE001 - one bad request must not end the actor
            logger.exception("request %s: input processing failed", message.request_id)
            self._reject(message.request_id, f"input processing failed: {error}", "internal_error", None)
            return
        self.to_scheduler.send(TokenizedRequest(request_id=message.request_id, prompt_token_ids=token_ids,
                                                params=message.params, arrival_time=message.arrival_time))

    def _tokenize(self, message: AddRequest) -> list[int]:
        if message.messages is not None:
            token_ids = self.processor.apply_chat_template(message.messages, message.add_generation_prompt)
            self.processor.check_prompt_tokens(token_ids)
            return token_ids
        if message.prompt is None:
            raise InvalidRequestError("a request needs a prompt or messages", param="prompt")
        return self.processor.process(message.prompt, message.params)[1]

    def _reject(self, request_id: str, text: str, error_type: str, param: str | None) -> None:
        self.to_frontend.send(RequestRejected(request_id=request_id, message=text, error_type=error_type,
                                              param=param))
