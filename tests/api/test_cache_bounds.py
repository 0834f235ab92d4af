"""Caches that a client fills are bounded by bytes, not by a count of entries whose size the
client chooses: the /v1/responses store (--responses-store-size) and the structured-output
check cache of the API and input processors (digests of the schemas, not their text)."""

from __future__ import annotations

import json

from actors.structured_output import backend
from messages.structured_outputs import StructuredOutputsParams
from tests.api.conftest import RESPONSES_STORE_BYTES


def _tools(num_tools: int, description_len: int) -> list[dict]:
    """Function tools a response stores whole (the shared server's template renders none)."""
    return [{"type": "function", "name": f"f{index}", "description": "d" * description_len,
             "parameters": {"type": "object", "properties": {}}} for index in range(num_tools)]


def test_stored_responses_are_bounded_by_their_bytes(http):
    """40 responses of 10 KB each are 400 KB: past the shared server's 256 KiB, the oldest
    are forgotten (a count of 1000 kept them all), the newest kept and continued."""
    ids = []
    for index in range(40):
        response = http.post("/v1/responses", json={"input": f"{index}", "tools": _tools(1, 10_000),
                                                    "tool_choice": "none", "max_output_tokens": 2})
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    kept = [http.get(f"/v1/responses/{response_id}").status_code for response_id in ids]
    assert kept[0] == 404 and kept[-1] == 200, kept
    assert 10 <= kept.count(200) <= RESPONSES_STORE_BYTES // 10_000, kept
    follow_up = http.post("/v1/responses", json={"input": "and then?", "previous_response_id": ids[-1],
                                                 "max_output_tokens": 2})
    assert follow_up.status_code == 200, follow_up.text
    gone = http.post("/v1/responses", json={"input": "and then?", "previous_response_id": ids[0]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"


def test_a_response_larger_than_the_store_is_served_and_not_kept(http):
    big = http.post("/v1/responses", json={"input": "y", "tools": _tools(5, 60_000), "tool_choice": "none",
                                           "max_output_tokens": 2})
    assert big.status_code == 200, big.text
    assert http.get(f"/v1/responses/{big.json()['id']}").status_code == 404


def test_the_check_cache_holds_digests_not_schema_texts():
    """60 distinct schemas of 60 KB each: the cache holds 16-byte digests, not 3.6 MB of text."""
    backend._checked.clear()
    for index in range(60):
        schema = {"type": "object", "properties": {"a": {"type": "string", "description": f"{index}" + "d" * 60_000}}}
        backend.check_constraint(StructuredOutputsParams(json=json.dumps(schema)))
    assert len(backend._checked) == 60
    held = sum(len(repr(key)) for key in backend._checked)
    assert held < 60 * 100, held
    # a schema checked before is found again by its digest
    before = dict(backend._checked)
    backend.check_constraint(StructuredOutputsParams(json=json.dumps(schema)))
    assert dict(backend._checked) == before
