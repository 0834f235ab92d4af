"""Sleep mode (vLLM's sleep / wake_up) of a model runner: frees what the engine holds
between uses, as the frameworks that alternate training and serving on one machine need.

- level 1: the KV cache is dropped; the weights go to host memory (on CUDA a pinned copy;
  on the CPU they are in host memory already and stay);
- level 2: the KV cache and the weights are dropped; waking reloads the weights from the
  checkpoint (or the same dummy weights).

wake_up(tags) brings back "weights", "kv_cache" or both (no tags), so a trainer can wake the
weights, update them, then wake the cache. The scheduler forgets its prefix cache and
preempts every request before the runner sleeps (actors/scheduler/control.py): nothing in
the old KV cache is read again. Freed host memory goes back to the system (malloc_trim), so
the process's resident size drops by what was freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch

from messages.control import KV_CACHE, WEIGHTS, check_wake_tags



def release_memory(device: torch.device) -> None:
    """Hands freed memory back: the CUDA caching allocator's blocks, glibc's free heap pages."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        try:
            ctypes.CDLL(libc_name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
            pass


class SleepMode:
    """What a runner's sleep took away, and how to bring it back."""

    def __init__(self, runner) -> None:  # runner: model_runner.ModelRunner
        self.runner = runner
        self.level = 0
        self.asleep: set[str] = set()
        self._num_blocks: int | None = None
        self._host_weights: dict[int, torch.Tensor] | None = None  # level 1 on CUDA: tensor id -> host copy

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        runner = self.runner
        if KV_CACHE not in self.asleep:
            if runner.kv_caches:
                self._num_blocks = runner.kv_caches[0][0].shape[0]
            runner.kv_caches = []
            runner.graphs.drop()  # (the graphs hold the old cache's addresses, and their memory)
            self.asleep.add(KV_CACHE)
        if WEIGHTS not in self.asleep:
            # (an encoder's weights, and the Transformers fallback's modules, are reloaded rather than moved)
            reloaded = runner.model is None or runner.engine.model.model_impl == "transformers"
            if level == 2 or (runner.device.type != "cpu" and reloaded):
                runner.drop_weights()
            elif runner.device.type != "cpu":
                self._move_weights(torch.device("cpu"))
            self.level = level
            self.asleep.add(WEIGHTS)
        release_memory(runner.device)

    def wake_up(self, tags: list[str] | None = None) -> None:
        runner = self.runner
        for tag in check_wake_tags(tags):
            if tag not in self.asleep:
                continue
            if tag == WEIGHTS:
                if self._host_weights is not None:
                    self._move_weights(runner.device)
                elif self.level == 2 or runner.device.type != "cpu":
                    runner.load_weights()
            elif self._num_blocks is not None:
                runner.allocate_kv_cache(self._num_blocks)
            self.asleep.discard(tag)

    def _move_weights(self, device: torch.device) -> None:
        """Level 1 on CUDA: the decoder's tensors to pinned host memory and back (a tied LM
        head stays tied)."""
        model = self.runner.model
        moved: dict[int, torch.Tensor] = {}

        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if id(tensor) not in moved:
                copy = tensor.to(device, non_blocking=True)
                moved[id(tensor)] = copy.pin_memory() if device.type == "cpu" else copy
            return moved[id(tensor)]

        model.embed_tokens, model.final_norm, model.lm_head = (move(model.embed_tokens), move(model.final_norm),
                                                                move(model.lm_head))
        for layer in model.layers:
            for name, tensor in vars(layer).items():
                setattr(layer, name, move(tensor))
        if device.type != "cpu":
            torch.cuda.synchronize(device)
        self._host_weights = moved if device.type == "cpu" else None
