"""A conversation rendered with a chat template, with vLLM's request options: the
request's own template or the tokenizer's, add_generation_prompt or
continue_final_message, extra template variables, documents, tools. OpenAI's message shapes are
normalised first: a list of text parts becomes one string (a list of text and image parts
for a template that loops over them), the `developer` role is the `system` role, `name` is
kept for templates that read it.

Used by the input processor (every generation request) and by /tokenize, so the two
render a conversation the same way. Rendering runs under a time limit (--chat-template-timeout):
Jinja's sandbox bounds what a template may touch, not how long its loops run."""

from __future__ import annotations

import re
from typing import Any

from jinja2 import TemplateError

from actors.config import DEFAULT_CHAT_TEMPLATE_TIMEOUT_S
from actors.input_processor.time_limit import TimeLimitExceeded, call_with_time_limit
from messages.common import InvalidRequestError
from messages.input_processor import ChatOptions

# Variables a request's chat_template_kwargs may not set: the renderer's own arguments.
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                              "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
                              "tokenizer_kwargs"})
# a template that loops over a message's content parts (vLLM's "openai" content format, as
# llava-hf's templates do) gets the parts, not one string
_LOOPS_OVER_PARTS = re.compile(r"for\s+\w+\s+in\s+message\s*(?:\[\s*['\"]content['\"]\s*\]|\.content)")


def render_chat_text(tokenizer, messages: list[dict], options: ChatOptions,
                     timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S) -> str:
    """The prompt text of a conversation; InvalidRequestError naming the field at fault, or
    naming chat_template when rendering takes longer than timeout seconds."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects",
                                  param="messages")
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InvalidRequestError("this model's tokenizer has no chat template; send one as chat_template",
                                  param="messages")
    if options.add_generation_prompt and options.continue_final_message:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                  param="continue_final_message")
    keep_parts = bool(_LOOPS_OVER_PARTS.search(template)) if isinstance(template, str) else False
    conversation = [normalise_message(message, keep_parts) for message in messages]
    if options.continue_final_message and conversation[-1]["role"] != "assistant":
        raise InvalidRequestError("continue_final_message needs the last message to be the assistant's",
                                  param="continue_final_message")
    kwargs = dict(options.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                  param="chat_template_kwargs")
    try:
        return call_with_time_limit(lambda: tokenizer.apply_chat_template(
            conversation, tokenize=False, chat_template=template, documents=options.documents, tools=options.tools,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **kwargs), timeout)
    except TimeLimitExceeded:
        raise InvalidRequestError(f"the chat template took more than {timeout:g} s to render the messages "
                                  "(--chat-template-timeout)", param="chat_template") from None
    except (TemplateError, ValueError, TypeError, KeyError) as error:
        # a template that insists roles alternate, or a continued message it does not contain
        raise InvalidRequestError(f"the chat template rejected the messages: {error}", param="messages") from error


def normalise_message(message: dict[str, Any], keep_parts: bool = False) -> dict[str, Any]:
    """A message whose content is one string (keep_parts: a list of {"type": "text", "text"}
    and {"type": "image"} parts) and whose role a template knows. An image part
    (actors/multimodal/inputs.py's) carries its placeholder as its text."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise InvalidRequestError("each message needs a string 'role'", param="messages")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image") or not isinstance(part.get("text"), str):
                raise InvalidRequestError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                          param="messages")
            image = kind == "image" and keep_parts  # the template writes its own placeholder
            parts.append({"type": "image"} if image else {"type": "text", "text": part["text"]})
        content = parts if keep_parts else "\n".join(part["text"] for part in parts)
    elif keep_parts and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, (list, str)):
        raise InvalidRequestError("message content must be a string or a list of text parts", param="messages")
    normalised = {**message, "role": role, "content": content}
    if normalised.get("name") is None:
        normalised.pop("name", None)
    return normalised
