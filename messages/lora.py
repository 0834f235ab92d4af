"""A request's LoRA adapter, as vLLM's LoRARequest: which fine-tune of the base model it
runs with. Travels on AddRequest, TokenizedRequest and the worker's NewRequest."""

from __future__ import annotations

import msgspec

from messages.errors import InvalidRequestError


class LoRAAdapterError(InvalidRequestError):
    """An adapter the engine cannot run (missing files, a rank over max_lora_rank, a module
    or shape the base model lacks...): raised before any request runs with it."""

    def __init__(self, message: str, param: str | None = "lora_request") -> None:
        super().__init__(message, param)


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    """lora_int_id names the adapter inside the engine (a positive integer, unique per
    adapter); lora_path is a PEFT directory (adapter_config.json, adapter_model.safetensors).
    Two requests with the same id and path share the adapter's weights and prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the model the adapter was trained on (informative)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAAdapterError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAAdapterError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRAAdapterError("lora_path must name the adapter's directory")

    @property
    def adapter_id(self) -> int:  # vLLM's alias
        return self.lora_int_id

    @property
    def name(self) -> str:  # vLLM's alias
        return self.lora_name

    @property
    def path(self) -> str:  # vLLM's alias
        return self.lora_path

    @property
    def cache_key(self) -> str:
        """What keeps its prefix-cache blocks apart from every other adapter's and the base's."""
        return f"{self.lora_int_id}:{self.lora_path}"


def check_lora_request(value: object) -> LoRARequest | None:
    """A request's lora_request argument: None or a LoRARequest (LoRAAdapterError otherwise)."""
    if value is not None and not isinstance(value, LoRARequest):
        raise LoRAAdapterError(f"lora_request must be a LoRARequest or None, got {type(value).__name__}")
    return value
