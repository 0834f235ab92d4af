"""What pipeline stages exchange over torch.distributed point-to-point, and when.

- Hidden states: rank r of stage s sends [2, num_tokens, hidden] (the hidden states and
  the residual, stacked: one message) to rank r of stage s + 1, which knows num_tokens from
  the plan. Sent without waiting (isend): the stage goes on with its next plan while the
  next stage receives.
- Sampled tokens: each step, the last stage sends the tokens it sampled to the same rank of
  every earlier stage, in the order of the step's sampling requests, which every stage
  derives from the plan alike. An earlier stage posts the receive (irecv) as it passes the
  step on, applies the tokens once they have arrived, and waits for them only when a later
  plan needs one as its input (a decode of a request sampled in that step).

Messages between two ranks keep their order (one tag per kind), and every stage runs the
plans in the order sent, so neither side needs a step id on the wire."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from actors.worker.model_runner import CachedRequest
    from actors.worker.pipeline import PipelineStage

_HIDDEN_TAG = 1
_TOKENS_TAG = 2


class StageLink:
    def __init__(self, stage: PipelineStage, device: torch.device) -> None:
        self.stage = stage
        self.device = device  # of every tensor sent: NCCL sends only GPU tensors
        self.waited_s = 0.0  # time blocked on the previous stage's hidden states or the last stage's tokens
        self._sends: deque[tuple[dist.Work, torch.Tensor]] = deque()  # kept alive until sent
        # per step passed on with samples, in order: its sampling requests, the tokens' buffer, the receive
        self._pending_tokens: deque[tuple[list[CachedRequest], torch.Tensor, dist.Work]] = deque()

    # ---- hidden states, stage to stage ----

    def send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        payload = torch.stack((hidden, residual))
        self._send(payload, self.stage.global_rank(self.stage.index + 1), _HIDDEN_TAG)

    def receive_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        payload = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        started = time.perf_counter()
        dist.recv(payload, src=self.stage.global_rank(self.stage.index - 1), tag=_HIDDEN_TAG)
        self.waited_s += time.perf_counter() - started
        return payload[0], payload[1]

    # ---- sampled tokens, last stage to the others ----

    def send_tokens(self, token_ids: list[int]) -> None:
        """On the last stage: this step's samples, to every earlier stage."""
        if not token_ids or self.stage.size == 1:
            return
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        for stage in range(self.stage.size - 1):
            self._send(tokens, self.stage.global_rank(stage), _TOKENS_TAG)

    def expect_tokens(self, samplers: list[CachedRequest]) -> None:
        """On an earlier stage: the step just passed on samples a token for each of these."""
        if not samplers:
            return
        tokens = torch.empty(len(samplers), dtype=torch.long, device=self.device)
        work = dist.irecv(tokens, src=self.stage.global_rank(self.stage.size - 1), tag=_TOKENS_TAG)
        self._pending_tokens.append((samplers, tokens, work))

    def apply_arrived_tokens(self) -> None:
        while self._pending_tokens and self._pending_tokens[0][2].is_completed():
            self._apply_next()

    def wait_for_tokens(self, scheduled: list[tuple[CachedRequest, int]]) -> None:
        """Applies arrived samples, in order, until every scheduled request has the tokens
        this step computes (a decode's input is the previous step's sample)."""
        for request, num_tokens in scheduled:
            while len(request.token_ids) < request.num_computed_tokens + num_tokens:
                if not self._pending_tokens:
                    raise RuntimeError(f"pipeline stage {self.stage.index}: {request.request_id} needs a token "
                                       "no step in flight samples")
                self._apply_next()

    def _apply_next(self) -> None:
        samplers, tokens, work = self._pending_tokens.popleft()
        started = time.perf_counter()
        work.wait()
        self.waited_s += time.perf_counter() - started
        for request, token in zip(samplers, tokens.tolist()):
            request.token_ids.append(token)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        self._sends.append((dist.isend(tensor, dst=dst, tag=tag), tensor))
