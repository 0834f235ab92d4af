"""Prompts as vLLM's entry points take them: text, token ids, or a prompt dict
({"prompt": text} or {"prompt_token_ids": ids}, with an optional "cache_salt"); and the
per-prompt list arguments (priority, ...) beside a list of prompts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from messages.common import InvalidRequestError

Prompt = str | list[int]
PromptInput = Prompt | dict[str, Any]  # vLLM's TextPrompt / TokensPrompt dicts too

_PROMPT_DICT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def split_prompt(prompt: PromptInput) -> tuple[Prompt, str | None]:
    """(text or token ids, cache_salt) of a prompt given in any of vLLM's forms."""
    if isinstance(prompt, dict):
        unknown = sorted(prompt.keys() - _PROMPT_DICT_KEYS)
        if unknown:
            raise InvalidRequestError(f"prompt dicts take 'prompt' or 'prompt_token_ids', and 'cache_salt'; "
                                      f"{', '.join(map(repr, unknown))} is not supported", param="prompt")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequestError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'",
                                      param="prompt")
        text_or_ids = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        return split_prompt(text_or_ids)[0], prompt.get("cache_salt")
    if not isinstance(prompt, (str, list)):
        raise InvalidRequestError("prompt must be a string, a list of token ids or a prompt dict", param="prompt")
    return prompt, None


def split_media(prompt: PromptInput) -> tuple[PromptInput, dict | None]:
    """(the prompt without it, its multi_modal_data: {"image": a PIL image or a list}) of a
    prompt dict; (prompt, None) for the rest. Only LLM.generate takes images in prompt dicts:
    elsewhere split_prompt() refuses the key by name."""
    if isinstance(prompt, dict) and "multi_modal_data" in prompt:
        return {key: value for key, value in prompt.items() if key != "multi_modal_data"}, prompt["multi_modal_data"]
    return prompt, None


def prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text, token ids or a prompt dict) as a list of one; a list as it is."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def per_prompt(values: Sequence | None, num_prompts: int, name: str, default: Any) -> list:
    """A per-prompt list argument as one value per prompt (None: the default for all)."""
    if values is None:
        return [default] * num_prompts
    if isinstance(values, (int, str)) or not isinstance(values, Sequence):  # one value (a LoRARequest...) for all
        return [values] * num_prompts
    values = list(values)
    if len(values) != num_prompts:
        raise InvalidRequestError(f"got {len(values)} values of {name} for {num_prompts} prompts", param=name)
    return values
