"""The tokenizer's routes, in vLLM's shapes: POST /tokenize (a prompt, or a conversation as
the chat template renders it), POST /detokenize, and GET /tokenizer_info (the tokenizer's
configuration, as its tokenizer_config.json holds it; with --enable-tokenizer-info-endpoint)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import Response

from actors.errors import InvalidRequestError
from actors.input_processor import _text_message
from api.errors import bad_request
from api.protocol import DetokenizeRequest, TokenizeRequest
from api.responses import DetokenizeResponse, TokenizeResponse
from api.serving import ServingContext, json_response, read_json

# tokenizer_config.json fields that name the tokenizer's files on the server's disk
_FILE_FIELDS = ("vocab_file", "merges_file")


async def tokenize(ctx: ServingContext, request: Request) -> Response:
    """A prompt's token ids, or a conversation's as the chat template renders it; with
    return_token_strs, each token's string too."""
    body = await read_json(request, TokenizeRequest, ctx.settings.max_body_bytes)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    tokenizer = await ctx.client.get_tokenizer()
    if body.prompt is not None:
        # a completion prompt gets the tokenizer's BOS, as the engine's own prompts do
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=add_special_tokens)
    else:
        # the chat template writes its own BOS: adding the tokenizer's too would double it
        add_special_tokens = False if body.add_special_tokens is None else body.add_special_tokens
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              param="continue_final_message")
        messages = [message.to_dict() for message in body.messages]
        rendered = await asyncio.to_thread(
            render_chat_prompt, tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs)
        tokens = await asyncio.to_thread(tokenizer.encode, rendered, add_special_tokens=add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return json_response(TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens,
                                          token_strs=token_strs))


def render_chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                       continue_final_message: bool = False, chat_template: str | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation as text, rendered by chat_template or the tokenizer's own; 400
    (InvalidRequestError) for messages the template cannot render.

    /tokenize's own rendering until the input processor takes these options; then both
    should share one."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model's tokenizer has no chat template; send one in chat_template",
                                  param="messages")
    conversation = [_text_message(message) for message in messages]
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            **(chat_template_kwargs or {}))
    except (TemplateError, ValueError, TypeError) as error:  # a template that insists roles alternate, a bad kwarg
        raise InvalidRequestError(f"the chat template rejected the messages: {error}", param="messages") from error


async def detokenize(ctx: ServingContext, request: Request) -> Response:
    body = await read_json(request, DetokenizeRequest, ctx.settings.max_body_bytes)
    ctx.check_model(body.model)
    vocab_size = ctx.client.config.model.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range [0, {vocab_size})", param="tokens")
    tokenizer = await ctx.client.get_tokenizer()
    return json_response(DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens)))


async def tokenizer_info(ctx: ServingContext, request: Request) -> Response:
    """The tokenizer's configuration (tokenizer_config.json's fields: special tokens,
    model_max_length, chat_template, ...) and its class, as vLLM's /tokenizer_info."""
    tokenizer = await ctx.client.get_tokenizer()
    config = {key: value for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _FILE_FIELDS}
    config = _plain(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None) is not None:
        config["chat_template"] = tokenizer.chat_template
    # the standard json module: model_max_length is often a huge "no limit" integer past 64 bits
    return Response(json.dumps(config, default=str), media_type="application/json")


def _plain(value: Any) -> Any:
    """value with special tokens (AddedToken) as their text, so it encodes as JSON."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "content") and not isinstance(value, (str, bytes)):
        return value.content
    return value
