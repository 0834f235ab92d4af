"""AsyncClient's adapter calls, as vLLM's engine clients name them: add_lora checks an
adapter against the model up front (so a bad one fails here, not in a request), and the
client remembers the adapters it was given. Workers load an adapter's weights at the first
request that uses it and evict the least recently used past max_cpu_loras, so removing an
adapter only forgets it here: its memory goes when others push it out."""

from __future__ import annotations

import asyncio

from actors.lora.checker import LoRAChecker
from messages.lora import LoRAAdapterError, LoRARequest


class LoRAClientMixin:
    config = None  # the client's EngineConfig, once started

    def _lora_state(self) -> tuple[LoRAChecker, dict[int, LoRARequest]]:
        state = self.__dict__.get("_lora_registry")
        if state is None:
            if self.config is None:
                raise RuntimeError("start() the client first")
            state = self.__dict__["_lora_registry"] = (LoRAChecker(self.config.model, self.config.lora), {})
        return state

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Checks the adapter (LoRAAdapterError naming what is wrong) and remembers it; True
        when it is new. An id already added with another path is an error."""
        checker, adapters = self._lora_state()
        known = adapters.get(getattr(lora_request, "lora_int_id", None))
        if known is not None and known.lora_path != lora_request.lora_path:
            raise LoRAAdapterError(f"lora_int_id {lora_request.lora_int_id} is already adapter "
                                   f"{known.lora_name!r} at {known.lora_path}")
        await asyncio.to_thread(checker.check, lora_request)
        adapters[lora_request.lora_int_id] = lora_request
        return known is None

    async def remove_lora(self, lora_id: int) -> bool:
        """Forgets an added adapter; False when it was not added."""
        return self._lora_state()[1].pop(lora_id, None) is not None

    async def list_loras(self) -> set[int]:
        """The ids of the adapters added and not removed."""
        return set(self._lora_state()[1])
