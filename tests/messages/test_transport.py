"""A bound outbox knows when its first peer has connected: the frontend waits for that
before it takes requests, so a request sent at once after start-up is never refused."""

import asyncio

import pytest
import zmq

from messages.common import Shutdown
from messages.transport import Namespace, Sockets


@pytest.mark.asyncio
async def test_wait_for_peer_is_false_until_a_peer_connects() -> None:
    namespace = Namespace("ipc")
    sockets = Sockets()
    try:
        address = namespace.address("requests")
        outbox = sockets.outbox(address, bind=True)
        assert not await outbox.wait_for_peer(0.05)
        with pytest.raises(zmq.Again):  # what a request sent in that gap met
            outbox.send(Shutdown("early"))
        inbox = sockets.inbox(address, Shutdown, bind=False)
        assert await asyncio.wait_for(outbox.wait_for_peer(5.0), 10.0)
        outbox.send(Shutdown("on time"))
        received = await asyncio.wait_for(inbox.recv(), 5.0)
        assert received == Shutdown("on time")
    finally:
        sockets.close()
        namespace.cleanup()
