"""What an input processor receives: new requests from the frontend."""

from __future__ import annotations

from typing import Any

import msgspec

from messages.common import Ping, SamplingParams, Shutdown
from messages.lora import LoRARequest
from messages.pooling import PoolingParams


class ChatOptions(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """How to render a conversation with the chat template (vLLM's request fields)."""

    add_generation_prompt: bool = True  # end with the assistant's turn opening
    continue_final_message: bool = False  # leave the last (assistant) message open, to be continued
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's own
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    documents: list[dict[str, Any]] | None = None  # for retrieval-augmented templates
    tools: list[dict[str, Any]] | None = None  # OpenAI-style tool definitions, for templates that render them


class PromptImage(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """An image of a prompt dict's multi_modal_data on its way to the input processor:
    exactly one of a URL (data, http(s) or file, read there) and an encoded image's bytes
    (a PIL image travels as PPM: raw pixels, lossless, no compression work)."""

    url: str | None = None
    data: bytes | None = None


class AddRequest(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="add"):
    """frontend → input_processor: a new generation request. Exactly one of prompt and
    messages is set: a completion prompt (text or token ids), or a chat conversation to
    render with the model's chat template. Field order is the wire format: append fields,
    never reorder."""

    request_id: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # OpenAI-style {"role", "content"} dicts
    chat: ChatOptions | None = None  # chat only; None: the defaults
    params: SamplingParams
    arrival_time: float = 0.0  # time.time() at the frontend
    # None: a text prompt gets the tokenizer's special tokens (BOS), a rendered chat none
    add_special_tokens: bool | None = None
    priority: int = 0  # lower runs first under priority scheduling (vLLM's meaning)
    cache_salt: str | None = None  # prefix-cache entries are shared only between equal salts
    lora_request: LoRARequest | None = None  # the adapter to run with; None: the base model
    # set: a pooling request (params then only carries n=1); its prompt is run, nothing generated
    pooling_params: PoolingParams | None = None
    images: list[PromptImage] | None = None  # a prompt dict's multi_modal_data images, in placeholder order


InputProcessorInbox = AddRequest | Ping | Shutdown
