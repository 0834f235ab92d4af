"""SamplingParams.logits_processors in the sampler: vLLM V0's per-request callables, run
row by row on each of the request's steps. A request names them ("module:function");
the worker runs only those of the engine's allow-list, imported at start-up
(actors/layers/custom_registry.py), or callables of its own process (the offline LLM's)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch

from actors.layers.custom_registry import ProcessorRegistry
from actors.layers.logits_processors import RequestProcessor
from actors.layers.sampling_batch import StepRows
from messages.common import SamplingParams

logger = logging.getLogger(__name__)

# vLLM V0's offline form: (output_ids, logits_row) -> row or (prompt_ids, output_ids, logits_row) -> row
CustomProcessor = Callable[..., torch.Tensor]


class CustomProcessors(RequestProcessor):
    """Runs each request's processors, in their order, on its row of the logits (greedy
    requests too)."""

    reads_output = True  # its next apply reads the request's output list on the host

    def __init__(self, allowed: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.registry = ProcessorRegistry(allowed)
        self.functions: dict[int, tuple[list[tuple[CustomProcessor, bool]], list[int], list[int]]] = {}

    def needs(self, params: SamplingParams) -> bool:
        return bool(params.logits_processors)

    def add(self, slot, params, prompt_ids, output_ids) -> None:
        functions = []
        for entry in params.logits_processors:
            function = self.registry.resolve(entry)
            if function is None:  # the input processor refuses these: only a forged plan gets here
                logger.error("logits processor %r is not in this engine's allow-list: not run", entry)
                continue
            functions.append((function, _takes_prompt(function)))
        self.functions[slot] = (functions, list(prompt_ids), output_ids)

    def remove(self, slot: int) -> None:
        del self.functions[slot]

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        for row in rows.where(self.flags).tolist():
            functions, prompt_ids, output_ids = self.functions[int(rows.slots[row])]
            for function, takes_prompt in functions:
                before = logits[row]
                after = (function(prompt_ids, list(output_ids), before) if takes_prompt
                         else function(list(output_ids), before))
                if after is not before:
                    logits[row] = after


def _takes_prompt(function: CustomProcessor) -> bool:
    try:
        return len(inspect.signature(function).parameters) == 3
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False
