"""Pooling a step's final hidden states into one output per pooling request, across the
chunks a long prompt is prefilled in.

How the model runner calls it, once per step:

    pooler = Pooler()                                   # one per worker, owns per-request state
    spans = [PoolingSpan(request_id, start_row, num_rows, pooling_type, is_first, is_last), ...]
    pooled = pooler.pool(hidden, spans)                 # hidden: [num_tokens, hidden] of the step
    # pooled: request_id -> fp32 tensor, only for the spans with is_last (prompt ended this step):
    #   LAST / CLS / MEAN -> [hidden];  ALL -> [prompt_len, hidden]
    embedding = finish_embedding(pooled[rid], normalize, dimensions)   # embed
    scores = finish_logits(head(pooled[rid]), activation)              # classify
    pooler.discard(request_id)                          # a request aborted mid-prompt

A span is one request's rows of the flat batch: rows start_row .. start_row + num_rows - 1
are prompt tokens num_computed .. num_computed + num_rows - 1 of that request. is_first says
the span starts at prompt token 0, is_last that it ends the prompt; a prompt in one chunk
has both. Rows of the batch no span covers (decode tokens of generation requests) are left
alone. Spans of one request must arrive in prompt order, one per step.

What is kept between steps, per request whose prompt is not done: MEAN a running fp32 sum
and count, CLS the first row, ALL the rows so far (copied: the runner may reuse its hidden
buffer), LAST nothing (only the final chunk's last row matters).

Within a step, each pooling type costs one batched operation over all its spans: an
index_select of the first or last rows for CLS / LAST, and one index_add_ segment sum for
MEAN; only ALL slices per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PoolingSpan:
    request_id: str
    start_row: int  # first row of this request in the step's flat hidden states
    num_rows: int  # prompt tokens of this request computed this step
    pooling_type: str  # LAST, MEAN, CLS or ALL (config.POOLING_TYPES)
    is_first: bool  # the span starts at prompt token 0
    is_last: bool  # the span ends the prompt: its output is returned this step


@dataclass
class PoolingState:
    """What a request whose prompt spans several steps carries to the next one."""
    pooling_type: str
    num_tokens: int = 0  # prompt tokens pooled so far
    sum: torch.Tensor | None = None  # MEAN: [hidden] fp32 running sum of rows
    first_row: torch.Tensor | None = None  # CLS: [hidden] row of prompt token 0
    rows: list[torch.Tensor] = field(default_factory=list)  # ALL: [n, hidden] chunks, in order


class Pooler:
    """Owns the PoolingState of every pooling request whose prompt is still being prefilled."""

    def __init__(self) -> None:
        self.states: dict[str, PoolingState] = {}  # request_id -> state between its chunks

    def discard(self, request_id: str) -> None:
        """Forget a request (aborted or preempted mid-prompt: it restarts with is_first)."""
        self.states.pop(request_id, None)

    def pool(self, hidden: torch.Tensor,  # [num_tokens, hidden] the step's final hidden states
             spans: list[PoolingSpan]) -> dict[str, torch.Tensor]:
        """request_id -> pooled fp32 output for every span that ends its prompt."""
        assert hidden.dim() == 2, hidden.shape
        outputs: dict[str, torch.Tensor] = {}
        by_type: dict[str, list[PoolingSpan]] = {"LAST": [], "MEAN": [], "CLS": [], "ALL": []}
        for span in spans:
            assert span.num_rows > 0 and span.start_row + span.num_rows <= hidden.shape[0], span
            if span.is_first:
                # a first chunk starts over: a preempted request's earlier rows are stale
                self.states.pop(span.request_id, None)
            else:
                assert span.pooling_type == "LAST" or span.request_id in self.states, \
                    f"{span.request_id}: a later chunk came before the prompt's first"
            by_type[span.pooling_type].append(span)
        self._pool_last(hidden, by_type["LAST"], outputs)
        self._pool_cls(hidden, by_type["CLS"], outputs)
        self._pool_mean(hidden, by_type["MEAN"], outputs)
        self._pool_all(hidden, by_type["ALL"], outputs)
        return outputs

    def _pool_last(self, hidden: torch.Tensor, spans: list[PoolingSpan], outputs: dict[str, torch.Tensor]) -> None:
        ending = [span for span in spans if span.is_last]
        if not ending:
            return
        last_rows = _rows(hidden, [span.start_row + span.num_rows - 1 for span in ending])
        for span, row in zip(ending, last_rows):
            outputs[span.request_id] = row

    def _pool_cls(self, hidden: torch.Tensor, spans: list[PoolingSpan], outputs: dict[str, torch.Tensor]) -> None:
        starting = [span for span in spans if span.is_first]
        first_row_of: dict[str, torch.Tensor] = {}
        if starting:
            first_rows = _rows(hidden, [span.start_row for span in starting])
            first_row_of = {span.request_id: row for span, row in zip(starting, first_rows)}
        for span in spans:
            row = first_row_of.get(span.request_id)
            if span.is_last:
                outputs[span.request_id] = row if row is not None else self.states.pop(span.request_id).first_row
            elif row is not None:
                self.states[span.request_id] = PoolingState("CLS", first_row=row)

    def _pool_mean(self, hidden: torch.Tensor, spans: list[PoolingSpan], outputs: dict[str, torch.Tensor]) -> None:
        if not spans:
            return
        sums = _segment_sums(hidden, spans)  # [len(spans), hidden] fp32
        for span, chunk_sum in zip(spans, sums):
            state = self.states.pop(span.request_id, None) or PoolingState("MEAN")
            state.sum = chunk_sum if state.sum is None else state.sum + chunk_sum
            state.num_tokens += span.num_rows
            if span.is_last:
                outputs[span.request_id] = state.sum / state.num_tokens
            else:
                self.states[span.request_id] = state

    def _pool_all(self, hidden: torch.Tensor, spans: list[PoolingSpan], outputs: dict[str, torch.Tensor]) -> None:
        for span in spans:
            state = self.states.pop(span.request_id, None) or PoolingState("ALL")
            # a copy (also of fp32 rows): the runner may overwrite its hidden buffer next step
            state.rows.append(hidden[span.start_row:span.start_row + span.num_rows].to(torch.float32, copy=True))
            state.num_tokens += span.num_rows
            if span.is_last:
                outputs[span.request_id] = torch.cat(state.rows) if len(state.rows) > 1 else state.rows[0]
            else:
                self.states[span.request_id] = state


def _rows(hidden: torch.Tensor, row_indices: list[int]) -> torch.Tensor:
    """[len(row_indices), hidden] fp32 copies of those rows, in one index_select."""
    index = torch.tensor(row_indices, dtype=torch.long, device=hidden.device)
    return hidden.index_select(0, index).float()


def _segment_sums(hidden: torch.Tensor, spans: list[PoolingSpan]) -> torch.Tensor:
    """[len(spans), hidden] fp32 sum of each span's rows, in one index_add_."""
    device = hidden.device
    lengths = torch.tensor([span.num_rows for span in spans], dtype=torch.long, device=device)
    segment_ids = torch.repeat_interleave(torch.arange(len(spans), device=device), lengths)
    covered = sum(span.num_rows for span in spans)
    span_ends = [span.start_row + span.num_rows for span in spans]
    if covered == hidden.shape[0] and all(span.start_row == end for span, end in zip(spans[1:], span_ends)) \
            and spans[0].start_row == 0:
        rows = hidden  # the spans tile the batch in order (an all-MEAN step): no gather
    else:
        starts = torch.tensor([span.start_row for span in spans], dtype=torch.long, device=device)
        span_offsets = torch.cumsum(lengths, 0) - lengths
        offset_in_span = torch.arange(covered, device=device) - torch.repeat_interleave(span_offsets, lengths)
        rows = hidden.index_select(0, torch.repeat_interleave(starts, lengths) + offset_in_span)
    sums = torch.zeros(len(spans), hidden.shape[1], dtype=torch.float32, device=device)
    return sums.index_add_(0, segment_ids, rows.float())


def finish_embedding(vector: torch.Tensor,  # [..., hidden] pooled, fp32
                     normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """Matryoshka truncation to `dimensions`, then L2 normalisation: the order
    sentence-transformers (truncate_dim) and vLLM use, so a truncated embedding is a unit
    vector too. Rows of an ALL output are each normalised. Check `dimensions` first with
    config.check_dimensions."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = F.normalize(vector.float(), p=2, dim=-1)
    return vector


def finish_logits(logits: torch.Tensor,  # [..., num_labels] a classifier head's output
                  activation: str | None) -> torch.Tensor:
    """Scores from logits: softmax over labels, an independent sigmoid per label, or the
    raw logits (None)."""
    logits = logits.float()
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    assert activation is None, activation
    return logits
