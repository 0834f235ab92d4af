"""The models a server answers to, as vLLM's OpenAIServingModels: the base model's served
names, then LoRA adapters, each reached by its own name in a request's `model` field.

    models = ServedModels(["smollm2"], client)
    await models.load_adapter("sql", "/adapters/sql")   # checked against the model first
    name, lora_request = models.resolve("sql")          # ("sql", LoRARequest("sql", 1, ...))

Adapters come from --lora-modules at start and, when runtime updating is allowed, from
POST /v1/load_lora_adapter. Each gets the next lora_int_id (1, 2, ...), never reused: the
engine keys an adapter's weights and prefix cache by its id, so a name unloaded and loaded
again with other files must not meet the old ones there."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from actors.frontend.client import AsyncClient
from actors.lora.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from api.errors import APIError
from messages.lora import LoRAAdapterError, LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules item (vLLM's name): an adapter served under name."""

    name: str
    path: str
    base_model_name: str | None = None  # the served model the adapter extends; default the first


def model_not_found(name: str) -> APIError:
    """vLLM's answer for a model it does not serve: 404, NotFoundError, the status as code."""
    return APIError(404, f"The model `{name}` does not exist.", type="NotFoundError", param="model", code=404)


def _invalid_input(message: str, param: str) -> APIError:
    return APIError(400, message, type="InvalidUserInput", param=param, code=400)


def _is_adapter_dir(path: str) -> bool:
    """Whether path is a directory with an adapter's two files, both readable."""
    return all(os.path.isfile(file) and os.access(file, os.R_OK)
               for file in (os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)))


class ServedModels:
    """The served names and the adapters loaded, by name. Loads and unloads run one at a
    time under a lock (a load awaits the adapter's check, and two loads of one name must
    not both pass the duplicate test); resolve() only reads, so requests never wait."""

    def __init__(self, base_model_names: list[str], client: AsyncClient) -> None:
        self.base_model_names = base_model_names
        self.client = client
        self.adapters: dict[str, LoRARequest] = {}  # adapter name -> its request, in load order
        self._last_lora_int_id = 0
        self._lock = asyncio.Lock()

    def resolve(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The name a response carries and the adapter a request runs with (None for the base
        model). No name (or an empty one) means the first served model, as vLLM; a name
        neither served nor loaded gets 404."""
        if not name or name in self.base_model_names:
            return self.base_model_names[0], None
        lora_request = self.adapters.get(name)
        if lora_request is None:
            raise model_not_found(name)
        return lora_request.lora_name, lora_request

    async def load_adapter(self, lora_name: str, lora_path: str, base_model_name: str | None = None,
                           from_request: bool = False) -> LoRARequest:
        """Checks the adapter against the model (the engine's AsyncClient.add_lora) and serves
        it under lora_name. APIError 400 for a missing field, a name already taken, or an
        adapter the engine cannot run (its message names what is wrong). from_request: a
        client's POST /v1/load_lora_adapter, which gets one answer for every path that holds
        no adapter (the operator's --lora-modules get the engine's own reason)."""
        if not lora_name or not lora_path:
            raise _invalid_input("Both 'lora_name' and 'lora_path' must be provided.",
                                 "lora_path" if lora_name else "lora_name")
        async with self._lock:
            if lora_name in self.adapters:
                raise _invalid_input(f"The lora adapter '{lora_name}' has already been loaded.", "lora_name")
            if lora_name in self.base_model_names:
                raise _invalid_input(f"'{lora_name}' is a served name of the base model; an adapter needs "
                                     "another name", "lora_name")
            if base_model_name is not None and base_model_name not in self.base_model_names:
                raise _invalid_input(f"base_model_name '{base_model_name}' is not a served model; this server "
                                     f"serves {', '.join(map(repr, self.base_model_names))}", "base_model_name")
            if from_request and not _is_adapter_dir(lora_path):
                # one answer for a path that does not exist, is a file, is a directory of something
                # else or cannot be read: the route must not tell which paths exist on the server
                raise APIError(400, f"no LoRA adapter can be read at lora_path (a directory holding {CONFIG_FILE} "
                                    f"and {WEIGHTS_FILE})", type="BadRequestError", param="lora_path", code=400)
            lora_request = LoRARequest(lora_name, self._last_lora_int_id + 1, lora_path,
                                       base_model_name=base_model_name)
            try:
                await self.client.add_lora(lora_request)
            except LoRAAdapterError as error:
                raise APIError(400, str(error), type="BadRequestError", param="lora_path", code=400) from error
            self._last_lora_int_id = lora_request.lora_int_id
            self.adapters[lora_name] = lora_request
            return lora_request

    async def unload_adapter(self, lora_name: str, lora_int_id: int | None = None) -> None:
        """Stops serving the adapter: requests naming it get 404 from now on (those running
        finish with it). 404 for a name not loaded, or one loaded with another lora_int_id."""
        if not lora_name:
            raise _invalid_input("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with self._lock:
            lora_request = self.adapters.get(lora_name)
            if lora_request is None or lora_int_id not in (None, lora_request.lora_int_id):
                raise APIError(404, f"The lora adapter '{lora_name}' cannot be found.", type="NotFoundError",
                               param="lora_name", code=404)
            del self.adapters[lora_name]
            await self.client.remove_lora(lora_request.lora_int_id)

    def parent_of(self, lora_request: LoRARequest) -> str:
        """The served model an adapter extends, for its /v1/models card."""
        return lora_request.base_model_name or self.base_model_names[0]
