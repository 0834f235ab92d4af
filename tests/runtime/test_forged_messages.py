"""Messages no actor should take, on a real engine's real sockets: a request carrying a
pickled logits processor (what SamplingParams once carried to the workers) pushed straight
into the scheduler's inbox, and bytes that are no message at all, are dropped where they
are decoded and logged; the pickle never runs, and the engine serves on."""

from __future__ import annotations

import asyncio
import pickle

import msgspec
import pytest
import zmq

from actors import AsyncClient, SamplingParams
from messages.scheduler import TokenizedRequest


class WritesAMarker:
    """What a pickled processor could make a worker run: here, it creates a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.asyncio
async def test_a_pickled_processor_on_the_scheduler_socket_is_dropped_never_run(tiny_llama_dir, tmp_path, capfd):
    marker = tmp_path / "ran"
    fields = msgspec.to_builtins(SamplingParams(temperature=0.0, max_tokens=2))
    fields["logits_processors"] = [pickle.dumps(WritesAMarker(str(marker)))]
    # a TokenizedRequest as the old wire format (or a forger) writes it: tagged, array-like
    request = msgspec.to_builtins(TokenizedRequest(request_id="forged", prompt_token_ids=[5, 6],
                                                   params=SamplingParams()))
    request[3] = fields
    async with AsyncClient(tiny_llama_dir, kv_cache_memory="32MiB", log_level="WARNING") as client:
        context = zmq.Context()
        forger = context.socket(zmq.PUSH)
        forger.linger = 1000
        try:
            forger.connect(client.processes.addresses["scheduler"])
            forger.send(msgspec.msgpack.encode(request))
            forger.send(b"\x93\x01\x02")  # not one of the scheduler's messages
            greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            output = await asyncio.wait_for(client.generate([5, 6, 7], greedy), 60)
            assert len(output.outputs[0].token_ids) == 3 and client.is_running
        finally:
            forger.close()
            context.term()
    assert not marker.exists()
    assert capfd.readouterr().err.count("dropped a message that is not one of this inbox's") >= 2
