"""The check every request's adapter passes before it is queued (InputProcessor.process,
and AsyncClient.add_lora): enabled, readable, within max_lora_rank, and fitting the base
model. A checked adapter is remembered by (id, path) and the files' modification times,
so a request pays for it once."""

from __future__ import annotations

import os

from actors.config import LoRAConfig, ModelConfig
from actors.lora.adapter_files import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec, read_adapter
from messages.lora import LoRAAdapterError, LoRARequest, check_lora_request

_MAX_REMEMBERED = 1024


class LoRAChecker:
    def __init__(self, model: ModelConfig | None, lora: LoRAConfig | None) -> None:
        """lora None: the engine runs no adapters, and every one is refused."""
        self.model = model
        self.config = lora
        self._checked: dict[tuple[int, str], tuple[tuple[float, float], AdapterSpec]] = {}

    def check(self, lora: LoRARequest | None) -> AdapterSpec | None:
        """The adapter's spec (None for the base model), or LoRAAdapterError."""
        if check_lora_request(lora) is None:
            return None
        if self.config is None:
            raise LoRAAdapterError(f"the request asks for LoRA adapter {lora.lora_name!r}, and this engine was "
                                   "started without LoRA support (enable_lora=True, --enable-lora)")
        key = (lora.lora_int_id, lora.lora_path)
        stamp = _modified(lora.lora_path)
        known = self._checked.get(key)
        if known is not None and known[0] == stamp:
            if known[1].lora != lora:  # same adapter under another name: keep the caller's request
                return AdapterSpec(lora, known[1].weights_file, known[1].modules)
            return known[1]
        spec = read_adapter(lora, self.model, self.config.max_lora_rank)
        if len(self._checked) >= _MAX_REMEMBERED:
            self._checked.pop(next(iter(self._checked)))
        self._checked[key] = (stamp, spec)
        return spec


def _modified(path: str) -> tuple[float, float]:
    def mtime(name: str) -> float:
        try:
            return os.path.getmtime(os.path.join(path, name))
        except OSError:
            return -1.0

    return mtime(CONFIG_FILE), mtime(WEIGHTS_FILE)
