"""What the frontend (AsyncClient, in the caller's process) receives: request outputs,
rejections, the actors' start-up handshakes and answers to its queries."""

from __future__ import annotations

from typing import Any

import msgspec

from messages.common import RequestOutput
from messages.pooling import PooledData


class RequestOutputs(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="outputs"):
    """detokenizer → frontend: one step's RequestOutput deltas, one per request that
    gained text or tokens or finished in it."""

    outputs: list[RequestOutput]


class PoolingResult(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One pooling request's output."""

    request_id: str
    data: PooledData
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class PoolingOutputs(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="pooling_outputs"):
    """scheduler → frontend: the pooling requests one step finished (no detokenizer work)."""

    outputs: list[PoolingResult]


class RequestRejected(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="rejected"):
    """input_processor or scheduler → frontend: a request that will not run, and why.
    error_type "invalid_request" is the caller's fault (HTTP 400); others are ours."""

    request_id: str
    message: str
    error_type: str = "invalid_request"
    param: str | None = None  # the offending field, when one is known


class RequestTokenized(msgspec.Struct, array_like=True, frozen=True, tag="tokenized_ack"):
    """input_processor → frontend: a request has left the input processor for the scheduler
    (were that processor to die now, the request would not die with it: input_routing.py)."""

    request_id: str


class ActorReady(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="ready"):
    """any actor → launcher: started, sockets bound, ready for work."""

    name: str  # e.g. "worker0", "scheduler", "input_processor1"
    pid: int
    info: dict[str, Any] = msgspec.field(default_factory=dict)  # e.g. a worker's num_kv_blocks


class ActorFailed(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="failed"):
    """any actor → launcher: an error it cannot recover from, sent just before it exits
    non-zero, so the launcher can say more than "process died"."""

    name: str
    error: str


class HistogramSnapshot(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """A histogram of counts so far, as Prometheus reads one: counts[i] observations fell in
    (bounds[i-1], bounds[i]]; counts has one more entry, for those above every bound."""

    bounds: list[int]
    counts: list[int]
    total: int  # the sum of the observed values


class Stats(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag="stats"):
    """scheduler → frontend: the answer to a GetStats query."""

    query_id: int
    stats: dict[str, int | float | str | HistogramSnapshot]


class Pong(msgspec.Struct, array_like=True, frozen=True, tag="pong"):
    """any actor → frontend: the answer to a Ping."""

    name: str
    ping_id: int


FrontendInbox = (RequestOutputs | PoolingOutputs | RequestRejected | RequestTokenized | ActorReady | ActorFailed
                 | Stats | Pong)
