"""Structured outputs in the sampler: the logits processor that masks, each step, the tokens
a request's grammar does not allow next (actors/structured_output/ builds the grammars).

The worker that samples owns the matchers, so no grammar state crosses a process:
- a request's constraint compiles on a thread (its C++ part at the lowest CPU priority),
  before the scheduler schedules the request (CompileGrammar, actors/structured_output/grammar_compiles.py:
  a slow grammar delays only its own request, and one past --grammar-compile-timeout is
  refused); compiled grammars are kept by key, up to MAX_CACHED_GRAMMAR_BYTES, so a
  schema seen before is ready at once. Where nothing compiled ahead (the offline LLM, or
  a grammar dropped from the cache meanwhile) it compiles when the request joins and a
  step waits for what is left of it when the request's first token is due;
- after each step's sampling, a second thread advances the matchers past the sampled
  tokens and fills each request's next bitmask while the next step's forward runs
  (xgrammar's and SGLang's overlap); apply() waits for that and masks the logits on
  their device in one call;
- a request that rejoins (after preemption) gets a fresh matcher that replays its output.
Once the grammar is complete only a stop token may follow (so the request finishes); a
request whose grammar failed to build, or whose matcher rejected a token, may only stop.
With a reasoning parser, a request's output is free until the end of its reasoning
(`</think>`), and constrained from the next token on."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from actors.structured_output import GrammarBackend, GrammarMatcher, make_backend
from actors.config.structured_output import MAX_CACHED_GRAMMAR_BYTES
from actors.structured_output.reasoning import reasoning_ended, reasoning_marker_ids
from actors.layers.logits_processors import LogitsProcessor, RequestProcessor
from actors.layers.sampler import default_processors
from actors.layers.sampling_batch import StepRows
from kernels.token_bitmask import apply_token_bitmask
from messages.common import SamplingParams
from messages.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from actors.config import EngineConfig
    from actors.layers.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

# compiled grammars kept, by constraint key (least recently used dropped first), at most
# this many and MAX_CACHED_GRAMMAR_BYTES (actors/config/structured_output.py) of them
MAX_CACHED_GRAMMARS = 128
# compiles at a time: one slow grammar leaves a thread to the others
_COMPILE_THREADS = 2
_SLOW_WAIT_S = 0.05  # a step that waits this long for a grammar says so in the log


@dataclass(frozen=True)
class GrammarConfig:
    backend: str  # "auto" | "xgrammar" | "guidance"
    tokenizer_path: str
    vocab_size: int  # the logits' width
    eos_token_ids: tuple[int, ...]
    reasoning_parser: str | None = None


class _Model:
    """What every request's grammar needs of the model, built once on the compile thread:
    the backend (tokenizer loaded, vocabulary indexed) and the reasoning markers' ids."""

    def __init__(self, config: GrammarConfig) -> None:
        from actors.models.loader import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer_path)
        self.backend: GrammarBackend = make_backend(config.backend, tokenizer, config.vocab_size,
                                                    list(config.eos_token_ids))
        self.think = (None if config.reasoning_parser is None
                      else reasoning_marker_ids(tokenizer, config.reasoning_parser))


class _RequestGrammar:
    """One request's matcher, its live output and the bitmask of what may come next."""

    def __init__(self, compiled: Future, prompt_ids: list[int], output_ids: list[int], words: int) -> None:
        self.compiled = compiled
        self.prompt_ids = prompt_ids  # until the first advance decides whether the output starts in reasoning
        self.output_ids = output_ids  # the sampler's live list
        self.matcher: GrammarMatcher | None = None
        self.num_seen = 0  # output tokens the matcher (or the reasoning scan) has taken
        self.in_reasoning = False
        self.only_stop = False  # failed, or complete: only a stop token may follow
        self.bitmask = torch.zeros(1, words, dtype=torch.int32)
        self.filled_at = -1  # num_seen when bitmask was filled

    @property
    def constrained(self) -> bool:
        return self.matcher is not None and not self.in_reasoning

    def advance(self, model: _Model, stop_ids: list[int]) -> None:
        """Takes the output tokens not yet seen, then fills the bitmask for the next one.
        A backend's failure ends this request's constraint (it may only stop), never the step."""
        try:
            self._advance(model, stop_ids)
        except Exception:  # noqa: BLE001
            logger.exception("a grammar matcher failed; its request may only stop")
            self.matcher, self.only_stop, self.in_reasoning, self.filled_at = _NO_MATCHER, True, False, -1
            self._advance(model, stop_ids)

    def _advance(self, model: _Model, stop_ids: list[int]) -> None:
        if self.matcher is None:
            self._start(model)
        output = self.output_ids
        while self.num_seen < len(output):
            token = output[self.num_seen]
            self.num_seen += 1
            if self.in_reasoning:
                self.in_reasoning = token != model.think[1]
            elif not self.only_stop and not self.matcher.accept(token):
                logger.error("the grammar rejected token %d after %d tokens; the request may only stop now",
                             token, self.num_seen - 1)
                self.only_stop = True
            elif self.matcher.is_terminated():
                self.only_stop = True
        if self.constrained and self.filled_at != self.num_seen:
            if self.only_stop:
                self.bitmask.zero_()
                for token in stop_ids:
                    self.bitmask[0, token // 32] |= _bit(token % 32)
            else:
                self.matcher.fill_bitmask(self.bitmask, 0)
            self.filled_at = self.num_seen

    def _start(self, model: _Model) -> None:
        try:
            self.matcher = model.backend.matcher(self.compiled.result())
        except Exception:  # noqa: BLE001 - checked by the input processor; a backend may still refuse
            logger.exception("a grammar failed to build; its request may only stop")
            self.matcher = _NO_MATCHER
            self.only_stop = True
        if model.think is not None:
            self.in_reasoning = not reasoning_ended(self.prompt_ids, model.think)
        self.prompt_ids = []


class _Logged(Exception):
    """The backend's failure, already logged."""


class _NoModel:
    """No backend: every matcher fails to build (so its request may only stop)."""

    backend = None
    think = None


class _NoMatcher:
    def accept(self, token_id: int) -> bool:
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def is_terminated(self) -> bool:
        return True


_NO_MATCHER = _NoMatcher()


@torch.inference_mode()  # the bitmasks were made in the step's inference mode
def _advance_all(grammars: list[_RequestGrammar], model: _Model, stop_ids: list[int]) -> None:
    for grammar in grammars:
        if grammar.compiled.done():
            grammar.advance(model, stop_ids)


def _grammar_bytes(future: Future) -> int:
    """A compiled grammar's memory (xgrammar's own count; 0 while compiling, or unknown)."""
    if not future.done() or future.exception() is not None:
        return 0
    return int(getattr(future.result(), "memory_size_bytes", 0))


def _bit(index: int) -> int:
    """Bit `index` of an int32 word (bit 31 is the sign bit)."""
    return -(2**31) if index == 31 else 1 << index


class StructuredOutputs(RequestProcessor):
    """Masks the logits of requests with structured_outputs (see the module docstring)."""

    reads_output = True  # its matchers take the output on the host

    def __init__(self, config: GrammarConfig) -> None:
        super().__init__()
        self.config = config
        self.words = -(-config.vocab_size // 32)
        self.stop_ids = list(config.eos_token_ids)
        # (a compile's C++ part runs at the lowest CPU priority: xgrammar_backend.py)
        self._compile_thread = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="troupe-grammar-compile")
        self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="troupe-grammar-fill")
        self._model: Future | None = None
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.grammars: dict[int, _RequestGrammar] = {}  # slot -> its request's grammar
        self._filling: Future | None = None  # the fill-ahead of the last step's rows

    def needs(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def add(self, slot, params, prompt_ids, output_ids) -> None:
        self.grammars[slot] = _RequestGrammar(self._compile(params.structured_outputs), list(prompt_ids),
                                              output_ids, self.words)

    def remove(self, slot: int) -> None:
        del self.grammars[slot]

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        self._wait_for_fill()
        model = self.model()
        row_numbers = rows.where(self.flags).tolist()
        masked, masks = [], []
        for row, slot in zip(row_numbers, rows.slots[row_numbers].tolist()):
            grammar = self.grammars[slot]
            if grammar.matcher is None and not grammar.compiled.done():
                self._wait(grammar.compiled, "compile")
            grammar.advance(model, self.stop_ids)
            if grammar.constrained:
                masked.append(row)
                masks.append(grammar.bitmask)
        if not masked:
            return
        apply_token_bitmask(logits, torch.cat(masks), masked)

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:
        """The sampler has appended this step's tokens to the outputs: advance the matchers
        and fill their next masks on the fill thread, while the next step runs."""
        grammars = [self.grammars[slot] for slot in rows.slots[rows.where(self.flags)].tolist()]
        if grammars and self._model is not None and self._model.done() and self._model.exception() is None:
            model, stop_ids = self._model.result(), self.stop_ids
            self._filling = self._fill_thread.submit(_advance_all, grammars, model, stop_ids)

    def model(self) -> _Model | _NoModel:
        try:
            return self._wait(self._model_future(), "the tokenizer")
        except Exception:  # noqa: BLE001 - logged once; every structured request may only stop
            if not isinstance(self._model.exception(), _Logged):
                logger.exception("structured outputs are unavailable: the grammar backend failed to start")
                self._model = Future()
                self._model.set_exception(_Logged())
            return _NoModel()

    def _wait_for_fill(self) -> None:
        if self._filling is not None:
            self._filling.result()
            self._filling = None

    def _model_future(self) -> Future:
        if self._model is None:
            # on a thread of ordinary priority: every structured request waits for it, once
            self._model = ThreadPoolExecutor(1, thread_name_prefix="troupe-grammar-model").submit(_Model, self.config)
        return self._model

    def precompile(self, constraint: StructuredOutputsParams) -> Future:
        """The constraint's compiled grammar (a future: compiling, or done), kept for the
        request that will join with it."""
        return self._compile(constraint)

    def _compile(self, constraint: StructuredOutputsParams) -> Future:
        key = constraint.key()
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        model = self._model_future()
        future = self._compile_thread.submit(lambda: model.result().backend.compile(constraint))
        self._compiled[key] = future
        self._evict()
        return future

    def _evict(self) -> None:
        """Drops the least recently used grammars past MAX_CACHED_GRAMMARS or past
        MAX_CACHED_GRAMMAR_BYTES of compiled ones (requests that hold one keep it)."""
        sizes = {key: _grammar_bytes(future) for key, future in self._compiled.items()}
        total = sum(sizes.values())
        while len(self._compiled) > 1 and (len(self._compiled) > MAX_CACHED_GRAMMARS
                                           or total > MAX_CACHED_GRAMMAR_BYTES):
            key, _ = self._compiled.popitem(last=False)
            total -= sizes[key]

    @staticmethod
    def _wait(future: Future, what: str):
        start = time.perf_counter()
        result = future.result()
        waited = time.perf_counter() - start
        if waited > _SLOW_WAIT_S:
            logger.info("a step waited %.0f ms for %s of a structured output", 1e3 * waited, what)
        return result


def structured_outputs_of(runner) -> StructuredOutputs | None:
    """The grammar masks of a model runner's sampler, where it samples (rank 0 of its stage)."""
    processors = getattr(getattr(runner, "sampler", None), "processors", ())
    return next((processor for processor in processors if isinstance(processor, StructuredOutputs)), None)


def sampling_processors(engine: EngineConfig, parallel: TensorParallel) -> list[LogitsProcessor]:
    """The sampler's logits processors: the built-in ones, then (on the rank that samples)
    the structured outputs' grammar masks, last, so nothing lifts them."""
    processors = default_processors(list(engine.model.eos_token_ids), engine.logits_processors)
    if parallel.rank == 0:
        processors.append(StructuredOutputs(GrammarConfig(
            engine.structured_outputs_backend, engine.tokenizer_path or engine.model.model_path,
            engine.model.vocab_size, engine.model.eos_token_ids, engine.reasoning_parser)))
    return processors
