"""The executor in the scheduler's process: one plan reaches every rank as the same bytes,
and closing it tells every rank to shut down, whether or not that rank is still there."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from actors.scheduler.executor import Executor
from messages.common import SamplingParams, Shutdown
from messages.transport import Namespace, Sockets, encode
from messages.worker import ContinuingRequest, NewRequest, StepPlan, WorkerInbox

NUM_RANKS = 3


@pytest.fixture
def sockets():
    sockets = Sockets()
    yield sockets
    sockets.close()
    sockets.context.term()


def plan_addresses(num_ranks: int) -> dict[str, str]:
    namespace = Namespace("inproc")
    return {f"plans{rank}": namespace.address(f"plans{rank}") for rank in range(num_ranks)}


def connect_ranks(sockets: Sockets, addresses: dict[str, str], ranks: range) -> list[zmq.Socket]:
    """What each worker does: connect a PULL socket to its rank's plan address."""
    pulls = []
    for rank in ranks:
        pull = sockets.context.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVTIMEO, 5000)  # a missing message fails the test instead of hanging it
        pull.connect(addresses[f"plans{rank}"])
        pulls.append(pull)
    return pulls


def test_a_plan_reaches_every_rank_as_the_same_bytes(sockets):
    addresses = plan_addresses(NUM_RANKS)
    executor = Executor(sockets, addresses, NUM_RANKS)
    pulls = connect_ranks(sockets, addresses, range(NUM_RANKS))
    plan = StepPlan(step_id=7,
                    new_requests=[NewRequest("a", [1, 2, 3], 3, SamplingParams(max_tokens=4), [0], 0)],
                    continuing_requests=[ContinuingRequest("b", [5], 16)],
                    num_scheduled_tokens={"a": 3, "b": 1}, finished_request_ids=["c"])

    executor.submit(plan)

    received = [pull.recv() for pull in pulls]
    assert received == [encode(plan)] * NUM_RANKS
    assert msgspec.msgpack.Decoder(WorkerInbox).decode(received[0]) == plan
    for pull in pulls:
        pull.close()


def test_close_sends_shutdown_to_the_ranks_still_connected_and_skips_a_gone_one(sockets):
    addresses = plan_addresses(NUM_RANKS)
    executor = Executor(sockets, addresses, NUM_RANKS)
    # rank 2 never connects (a worker that died): close() must neither block nor raise
    pulls = connect_ranks(sockets, addresses, range(NUM_RANKS - 1))

    executor.close()

    decoder = msgspec.msgpack.Decoder(WorkerInbox)
    assert [type(decoder.decode(pull.recv())) for pull in pulls] == [Shutdown] * (NUM_RANKS - 1)
    for pull in pulls:
        pull.close()
