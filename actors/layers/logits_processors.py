"""Logits processors: what changes a step's logits before the choice of tokens, as an
ordered list of batch-level plug-ins (vLLM V1's and SGLang's seam).

A processor hears of each request joining (add_request, with the request's slot) and
leaving (remove_request); each step the sampler asks it whether any row of the step
concerns it (wants), and only then hands it the logits to change in place (apply) and
the tokens sampled from them (on_sampled). A processor no request needs costs a numpy
lookup: no copy, no kernel. Per-token state (penalty counts, masks) is built on the
logits' device the first time a request's row is seen there, so nothing here names a
device. Adding one (a grammar's bitmask) is a subclass of RequestProcessor with
`needs` and `apply`, appended to default_processors (sampler.py)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from actors.layers.sampling_batch import StepRows
from messages.common import SamplingParams


class LogitsProcessor(Protocol):
    def add_request(self, slot: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        """output_ids is the request's live output list: the sampler appends to it."""

    def remove_request(self, slot: int) -> None: ...

    def wants(self, rows: StepRows) -> bool:
        """Whether apply has anything to do on these rows."""

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:  # [rows, vocab] fp32, in place
        ...

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:  # [rows] int64, on logits' device
        ...


class RequestProcessor:
    """A processor concerned with some requests only (needs(params)): keeps a flag per
    slot, so a step finds its rows with one numpy gather."""

    def __init__(self) -> None:
        self.flags = np.zeros(0, bool)  # slot -> concerned
        self.count = 0

    def needs(self, params: SamplingParams) -> bool:
        raise NotImplementedError

    def add_request(self, slot: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        if slot >= len(self.flags):
            grow = max(16, slot + 1 - len(self.flags), len(self.flags))
            self.flags = np.concatenate([self.flags, np.zeros(grow, bool)])
        if self.needs(params):
            self.flags[slot] = True
            self.count += 1
            self.add(slot, params, prompt_ids, output_ids)

    def remove_request(self, slot: int) -> None:
        if slot < len(self.flags) and self.flags[slot]:
            self.flags[slot] = False
            self.count -= 1
            self.remove(slot)

    def add(self, slot: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Keep what apply will need of a request this processor is concerned with."""

    def remove(self, slot: int) -> None: ...

    def wants(self, rows: StepRows) -> bool:
        return self.count > 0 and bool(self.flags[rows.slots].any())

    def concerns(self, slot: int) -> bool:
        return slot < len(self.flags) and bool(self.flags[slot])

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None: ...


class Penalties(RequestProcessor):
    """Repetition penalty over prompt and output (as vLLM and Hugging Face), presence and
    frequency penalties over the output (as OpenAI). Per slot on the device: which tokens
    the request has seen, which it has output, and the sum of its presence and frequency
    penalties per token; each sampled token updates them (one scatter), and a step
    applies them in a few passes over its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.repetition = np.ones(0, np.float32)  # slot -> its penalties
        self.frequency = np.zeros(0, np.float32)
        self.presence = np.zeros(0, np.float32)
        self.pending: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (prompt, output) to count
        self.seen: torch.Tensor | None = None  # [slots, vocab] bool: in the prompt or the output
        self.in_output: torch.Tensor | None = None  # [slots, vocab] bool
        self.subtracted: torch.Tensor | None = None  # [slots, vocab]: frequency x count + presence, if in output

    def needs(self, params: SamplingParams) -> bool:
        return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

    def add(self, slot, params, prompt_ids, output_ids) -> None:
        self.repetition, self.frequency, self.presence = (
            _fit(values, len(self.flags), fill) for values, fill in
            ((self.repetition, 1.0), (self.frequency, 0.0), (self.presence, 0.0)))
        self.repetition[slot] = params.repetition_penalty
        self.frequency[slot] = params.frequency_penalty
        self.presence[slot] = params.presence_penalty
        self.pending[slot] = (prompt_ids, output_ids)

    def remove(self, slot: int) -> None:
        self.pending.pop(slot, None)

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        self._count_pending(logits)
        row_numbers, row_index, slot_index = _concerned(self.flags, rows)
        slots = rows.slots[row_numbers]
        every_row = len(row_numbers) == logits.shape[0]  # then no gather and no copy back
        values = logits if every_row else logits.index_select(0, row_index)
        repetition = self.repetition[slots]
        if (repetition != 1.0).any():
            device = logits.device
            penalty = torch.tensor(repetition, device=device)
            repetition_penalty(values, self.seen.index_select(0, slot_index), penalty, sparse=device.type == "cpu")
        if (self.frequency[slots] != 0.0).any() or (self.presence[slots] != 0.0).any():
            values.sub_(self.subtracted.index_select(0, slot_index))
        if not every_row:
            logits.index_copy_(0, row_index, values)

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:
        row_numbers, row_index, slot_index = _concerned(self.flags, rows)
        slots = rows.slots[row_numbers]
        device = tokens.device
        index = (slot_index, tokens.index_select(0, row_index))
        first = ~self.in_output[index]
        frequency = torch.tensor(self.frequency[slots], device=device)
        presence = torch.tensor(self.presence[slots], device=device)
        self.subtracted.index_put_(index, frequency + presence * first, accumulate=True)
        self.in_output[index] = True
        self.seen[index] = True

    def _count_pending(self, logits: torch.Tensor) -> None:
        """The tables' rows of the requests that joined since the last step, on the logits' device."""
        if not self.pending:
            return
        vocab, device = logits.shape[-1], logits.device
        size = max(self.pending) + 1
        self.seen = _table(self.seen, size, vocab, torch.bool, device)
        self.in_output = _table(self.in_output, size, vocab, torch.bool, device)
        self.subtracted = _table(self.subtracted, size, vocab, logits.dtype, device)
        for slot, (prompt_ids, output_ids) in self.pending.items():
            output = _ids(output_ids, vocab, device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
            counts.index_put_((output,), torch.ones_like(output, dtype=logits.dtype), accumulate=True)
            self.in_output[slot] = counts > 0
            self.seen[slot] = self.in_output[slot]
            self.seen[slot, _ids(prompt_ids, vocab, device)] = True
            self.subtracted[slot] = float(self.frequency[slot]) * counts + float(self.presence[slot]) * (counts > 0)
        self.pending.clear()


def repetition_penalty(values: torch.Tensor,  # [rows, vocab], changed in place
                       seen: torch.Tensor,  # [rows, vocab] bool
                       penalty: torch.Tensor,  # [rows]
                       sparse: bool) -> None:
    """Seen tokens' logits divided by the penalty if positive, else multiplied (divided,
    not multiplied by the inverse: the same floats as Hugging Face). sparse: only the seen
    entries are read and written (a few hundred a row, where the dense form makes half a
    dozen passes over the whole rows: on the CPU, 2x faster at batch 64); it finds them
    with nonzero, which on a GPU would wait for the device."""
    if sparse:
        rows, token_ids = seen.nonzero(as_tuple=True)
        picked = values[rows, token_ids]
        row_penalty = penalty.index_select(0, rows)
        values[rows, token_ids] = torch.where(picked > 0, picked / row_penalty, picked * row_penalty)
    else:
        penalty = penalty.unsqueeze(1)
        values.copy_(torch.where(seen, torch.where(values > 0, values / penalty, values * penalty), values))


class LogitBias(RequestProcessor):
    """Adds each request's logit_bias to its row."""

    def __init__(self) -> None:
        super().__init__()
        self.bias: dict[int, tuple[list[int], list[float]]] = {}

    def needs(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def add(self, slot, params, prompt_ids, output_ids) -> None:
        self.bias[slot] = (list(params.logit_bias), list(params.logit_bias.values()))

    def remove(self, slot: int) -> None:
        del self.bias[slot]

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        row_numbers = rows.where(self.flags).tolist()
        token_ids = [self.bias[s][0] for s in rows.slots[row_numbers].tolist()]
        values = [v for s in rows.slots[row_numbers].tolist() for v in self.bias[s][1]]
        _put(logits, row_numbers, token_ids, torch.tensor(values, dtype=logits.dtype, device=logits.device),
             accumulate=True)


class AllowedTokens(RequestProcessor):
    """Only a request's allowed_token_ids may be sampled: a [slots, vocab] mask on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, list[int]] = {}
        self.allowed: torch.Tensor | None = None  # [slots, vocab] bool

    def needs(self, params: SamplingParams) -> bool:
        return bool(params.allowed_token_ids)

    def add(self, slot, params, prompt_ids, output_ids) -> None:
        self.pending[slot] = params.allowed_token_ids

    def remove(self, slot: int) -> None:
        self.pending.pop(slot, None)

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        if self.pending:
            vocab, device = logits.shape[-1], logits.device
            self.allowed = _table(self.allowed, max(self.pending) + 1, vocab, torch.bool, device)
            for slot, token_ids in self.pending.items():
                self.allowed[slot] = False
                self.allowed[slot, torch.tensor(token_ids, dtype=torch.long, device=device)] = True
            self.pending.clear()
        _, row_index, slot_index = _concerned(self.flags, rows)
        values = logits.index_select(0, row_index).masked_fill_(~self.allowed.index_select(0, slot_index), float("-inf"))
        logits.index_copy_(0, row_index, values)


class MinTokens(RequestProcessor):
    """Until a request has min_tokens of output, its stop tokens (and EOS unless
    ignore_eos) may not be sampled."""

    def __init__(self, eos_token_ids: list[int]) -> None:
        super().__init__()
        self.eos_token_ids = eos_token_ids
        self.min_tokens = np.zeros(0, np.int64)  # slot -> min_tokens
        self.blocked: dict[int, list[int]] = {}  # slot -> token ids blocked until then

    def needs(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0 and bool(params.stop_token_ids or not params.ignore_eos)

    def add(self, slot, params, prompt_ids, output_ids) -> None:
        self.min_tokens = _fit(self.min_tokens, len(self.flags), 0)
        self.min_tokens[slot] = params.min_tokens
        self.blocked[slot] = list(params.stop_token_ids or []) + ([] if params.ignore_eos else self.eos_token_ids)

    def remove(self, slot: int) -> None:
        del self.blocked[slot]

    def _blocked_rows(self, rows: StepRows) -> list[int]:
        concerned = self.flags[rows.slots]
        concerned[concerned] &= rows.num_output[concerned] < self.min_tokens[rows.slots[concerned]]
        return np.flatnonzero(concerned).tolist()

    def wants(self, rows: StepRows) -> bool:
        return super().wants(rows) and bool(self._blocked_rows(rows))

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        row_numbers = self._blocked_rows(rows)
        _put(logits, row_numbers, [self.blocked[s] for s in rows.slots[row_numbers].tolist()], float("-inf"))


class BadWords(RequestProcessor):
    """The last token of a bad word may not follow the rest of it. As vLLM, only the
    output counts, not the prompt; a one-token word is always banned."""

    reads_output = True  # its next apply reads the request's output list on the host

    def __init__(self) -> None:
        super().__init__()
        self.words: dict[int, tuple[list[list[int]], list[int]]] = {}  # slot -> (words, live output)

    def needs(self, params: SamplingParams) -> bool:
        return bool(params.bad_words_token_ids)

    def add(self, slot, params, prompt_ids, output_ids) -> None:
        self.words[slot] = (params.bad_words_token_ids, output_ids)

    def remove(self, slot: int) -> None:
        del self.words[slot]

    def apply(self, logits: torch.Tensor, rows: StepRows) -> None:
        row_numbers = rows.where(self.flags).tolist()
        endings = [bad_word_endings(*self.words[s]) for s in rows.slots[row_numbers].tolist()]
        _put(logits, row_numbers, endings, float("-inf"))


def bad_word_endings(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: its last token, when the output
    ends with the rest of it."""
    endings = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            endings.append(word[-1])
    return endings


def _ids(token_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Token ids as a tensor, less those past the logits' vocabulary (a tokenizer's extras)."""
    return torch.tensor([t for t in token_ids if t < vocab], dtype=torch.long, device=device)


def _concerned(flags: np.ndarray, rows: StepRows) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """The step's rows a processor is concerned with: row numbers (host), and as index
    tensors on the device the rows and their slots."""
    row_numbers = rows.where(flags)
    row_index = torch.tensor(row_numbers, dtype=torch.long, device=rows.device)
    return row_numbers, row_index, rows.index().index_select(0, row_index)


def _put(logits: torch.Tensor, row_numbers: list[int], token_ids: list[list[int]],
         values: float | torch.Tensor, accumulate: bool = False) -> None:
    """logits[row, token] = value (or += value) for each row and each of its tokens, in one pass."""
    flat_rows = [row for row, ids in zip(row_numbers, token_ids) for _ in ids]
    if not flat_rows:
        return
    device = logits.device
    index = (torch.tensor(flat_rows, dtype=torch.long, device=device),
             torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=device))
    if not isinstance(values, torch.Tensor):
        values = torch.full((len(flat_rows),), values, dtype=logits.dtype, device=device)
    logits.index_put_(index, values, accumulate=accumulate)


def _fit(values: np.ndarray, size: int, fill: float) -> np.ndarray:
    """A per-slot array with at least `size` entries, new ones `fill`."""
    if len(values) >= size:
        return values
    return np.concatenate([values, np.full(size - len(values), fill, values.dtype)])


def _table(table: torch.Tensor | None, size: int, vocab: int, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:  # [>= size, vocab]
    """A per-slot table with at least `size` rows: the old one, or a doubled copy of it."""
    if table is not None and table.shape[0] >= size:
        return table
    rows = max(size, 2 * table.shape[0] if table is not None else 16)
    grown = torch.zeros(rows, vocab, dtype=dtype, device=device)
    if table is not None:
        grown[: table.shape[0]] = table
    return grown
