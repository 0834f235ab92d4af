"""The tokenizer's routes, in vLLM's shapes: POST /tokenize (a prompt, or a conversation as
the chat template renders it), POST /detokenize, and GET /tokenizer_info (the tokenizer's
configuration, as its tokenizer_config.json holds it; with --enable-tokenizer-info-endpoint)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors.input_processor.chat_template import render_chat_text
from api.errors import bad_request
from api.protocol import DetokenizeRequest, TokenizeRequest
from api.responses import DetokenizeResponse, TokenizeResponse
from api.serving import ServingContext, json_response, read_json
from messages.input_processor import ChatOptions

# tokenizer_config.json fields that name the tokenizer's files on the server's disk
_FILE_FIELDS = ("vocab_file", "merges_file")


async def tokenize(ctx: ServingContext, request: Request) -> Response:
    """A prompt's token ids, or a conversation's as the chat template renders it; with
    return_token_strs, each token's string too."""
    body = await read_json(request, TokenizeRequest, ctx.settings.max_body_bytes)
    ctx.resolve_model(body.model)  # an adapter shares the base model's tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    ctx.check_chat_template(body.chat_template)
    tokenizer = await ctx.client.get_tokenizer()
    if body.prompt is not None:
        # a completion prompt gets the tokenizer's BOS, as the engine's own prompts do
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=add_special_tokens)
    else:
        # the chat template writes its own BOS: adding the tokenizer's too would double it
        add_special_tokens = False if body.add_special_tokens is None else body.add_special_tokens
        options = ChatOptions(add_generation_prompt=body.add_generation_prompt,
                              continue_final_message=body.continue_final_message,
                              chat_template=body.chat_template or ctx.settings.chat_template,
                              chat_template_kwargs=body.chat_template_kwargs, documents=body.documents)
        messages = [message.to_dict() for message in body.messages]
        # the input processor's own rendering, so /tokenize counts what a chat request runs
        rendered = await asyncio.to_thread(render_chat_text, tokenizer, messages, options,
                                           ctx.client.config.inputs.chat_template_timeout)
        tokens = await asyncio.to_thread(tokenizer.encode, rendered, add_special_tokens=add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return json_response(TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens,
                                          token_strs=token_strs))


async def detokenize(ctx: ServingContext, request: Request) -> Response:
    body = await read_json(request, DetokenizeRequest, ctx.settings.max_body_bytes)
    ctx.resolve_model(body.model)
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
    added_tokens = config.pop("added_tokens_decoder", None)
    config = _plain(config)
    if added_tokens is not None:  # objects, as tokenizer_config.json holds them and vLLM serves them
        config["added_tokens_decoder"] = {str(token_id): _added_token(token)
                                          for token_id, token in added_tokens.items()}
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None) is not None:
        config["chat_template"] = tokenizer.chat_template
    # the standard json module: model_max_length is often a huge "no limit" integer past 64 bits
    return Response(json.dumps(config, default=str), media_type="application/json")


def _added_token(token: Any) -> dict[str, Any]:
    """An added token (tokenizers' AddedToken) as tokenizer_config.json writes it."""
    if isinstance(token, dict):
        return token
    return {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
            "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special}


def _plain(value: Any) -> Any:
    """value with special tokens (AddedToken) as their text, so it encodes as JSON."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "content") and not isinstance(value, (str, bytes)):
        return value.content
    return value
