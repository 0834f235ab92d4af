"""Request fields beyond a body's Struct: the ones vLLM implements and troupe does not yet
are refused by name (a client must never get another meaning without knowing it); any
other unknown field is accepted and logged once, as vLLM does, so newer clients work."""

from __future__ import annotations

import logging

import msgspec

from actors.errors import InvalidRequestError

logger = logging.getLogger("api.fields")

# field -> why troupe refuses it
UNSUPPORTED_FIELDS = {
    "guided_decoding_backend": "a request cannot choose the grammar backend (as in vLLM V1); the server's "
                               "--structured-outputs-backend serves every request",
    "logits_processors": "custom logits processors are not supported",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "mm_processor_kwargs": "per-request image processor options are not supported",
    "multi_modal_data": "images go in /v1/chat/completions messages as image_url content parts (as in vLLM)",
    "kv_transfer_params": "KV-cache transfer is not supported",
    "vllm_xargs": "vllm_xargs are not supported",
    "functions": "the deprecated functions are not supported; send tools",
    "function_call": "the deprecated function_call is not supported; send tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported (with --reasoning-parser, reasoning is split from the "
                        "content; turn thinking off with chat_template_kwargs)",
    "lora_request": "LoRA adapters are not supported",
}
# values that mean "not set", so a client that sends the field empty is not refused
_UNSET_VALUES = (b"null", b"false", b"[]", b"{}", b'""')
_MAX_LOGGED_NAMES = 1000  # a client inventing names must not grow the set without bound
_logged_names: set[str] = set()


def check_extra_fields(body: bytes, body_type: type[msgspec.Struct]) -> None:
    """Raises InvalidRequestError for a set field troupe does not implement; logs the
    first sighting of any other unknown field. Call after the body decoded as body_type."""
    try:
        raw_fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError:
        return  # not an object: the typed decode has said what is wrong
    known = body_type.__struct_fields__
    for name, value in raw_fields.items():
        if name in known:
            continue
        reason = UNSUPPORTED_FIELDS.get(name)
        if reason is not None:
            if bytes(value).strip() not in _UNSET_VALUES:
                raise InvalidRequestError(f"{name}: {reason}", param=name)
        elif name not in _logged_names and len(_logged_names) < _MAX_LOGGED_NAMES:
            _logged_names.add(name)
            logger.warning("ignoring the unknown request field %r (logged once)", name)
