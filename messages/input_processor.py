"""What an input processor receives: new requests from the frontend."""

from __future__ import annotations

from typing import Any

import msgspec

from messages.common import Ping, SamplingParams, Shutdown


class AddRequest(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="add"):
    """frontend → input_processor: a new generation request. Exactly one of prompt and
    messages is set: a completion prompt (text or token ids), or a chat conversation to
    render with the model's chat template."""

    request_id: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # OpenAI-style {"role", "content"} dicts
    add_generation_prompt: bool = True  # chat only
    params: SamplingParams
    arrival_time: float = 0.0  # time.time() at the frontend


InputProcessorInbox = AddRequest | Ping | Shutdown
