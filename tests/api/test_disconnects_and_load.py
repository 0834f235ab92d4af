"""Clients that give up, and many clients at once, against the shared server: a dropped
request is aborted in the engine (its KV blocks freed) long before it could have made its
tokens, a crowd of impatient clients leaves nothing behind, and 200 concurrent streams all
complete with well-formed SSE and exact usage. Sized for a 2-core CI machine: a tiny model,
short outputs, except where a request must still be running when its client leaves.

The bounds are on what the engine did, not on wall time alone: a 2-core machine shared with
other work stretches every second (a dropped request once took over a second to be seen
idle under load). A request not aborted would generate its 2,000 tokens; an aborted one
stops after a handful, however slow the machine, so the tokens generated are the check,
with generous time bounds around it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import pytest_asyncio

from tests.api.conftest import AUTH, MODEL_NAME, scrape_metrics, sse_events, wait_until_idle

# far more tokens than a request can produce in the time its client waits
LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}


@pytest_asyncio.fixture(scope="module")
async def aclient(server):
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)  # a connection per request
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120.0, limits=limits) as client:
        yield client


IDLE_TIMEOUT_S = 30.0  # how long a loaded machine may take to show the engine idle


def generated_tokens(http: httpx.Client) -> float:
    return scrape_metrics(http).get("vllm:generation_tokens_total", 0.0)


def test_dropped_stream_is_aborted_long_before_its_end(http):
    wait_until_idle(http, timeout=IDLE_TIMEOUT_S)
    before = generated_tokens(http)
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert scrape_metrics(http)["vllm:num_requests_running"] == 1
    # leaving the block closes the connection with the response half read
    wait_until_idle(http, timeout=IDLE_TIMEOUT_S)
    assert generated_tokens(http) - before < LONG["max_tokens"] / 2  # stopped, not run to its end


def test_dropped_non_streaming_request_is_aborted_long_before_its_end(server, http):
    # the engine's record of how the request ended is the check, not a token count: the tiny
    # model makes over a thousand tokens a second on a quiet machine, so a count bound reads the
    # machine's speed; the client leaves at 0.3 s, long before 2,000 tokens at any such speed
    wait_until_idle(http, timeout=IDLE_TIMEOUT_S)
    before = scrape_metrics(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=0.3,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "ignore_eos": True})
    after = wait_until_idle(http, timeout=IDLE_TIMEOUT_S)
    ended = {reason: after[f'vllm:request_success_total{{finished_reason="{reason}"}}']
             - before[f'vllm:request_success_total{{finished_reason="{reason}"}}'] for reason in ("abort", "length")}
    assert ended == {"abort": 1, "length": 0}  # stopped, not run to its end
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 2000


async def test_200_clients_giving_up_after_half_a_second_leave_nothing_behind(aclient, http):
    async def impatient(i: int) -> None:
        body = {**LONG, "prompt": [5 + i % 50] * (3 + i % 20), "stream": i % 2 == 0}
        try:
            async with asyncio.timeout(0.5):
                if body["stream"]:
                    async with aclient.stream("POST", "/v1/completions", json=body) as response:
                        async for _ in response.aiter_bytes():
                            pass
                else:
                    await aclient.post("/v1/completions", json=body)
        except TimeoutError:
            return
        raise AssertionError(f"request {i} finished within 0.5 s")

    await asyncio.to_thread(wait_until_idle, http, IDLE_TIMEOUT_S)
    before = await asyncio.to_thread(generated_tokens, http)
    async with asyncio.timeout(60):
        await asyncio.gather(*[impatient(i) for i in range(200)])
    response = await aclient.post("/v1/completions", json={"prompt": [9, 10], "max_tokens": 8, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
    gauges = await asyncio.to_thread(wait_until_idle, http, IDLE_TIMEOUT_S)
    assert gauges["troupe_kv_cache_blocks_held"] == 0
    # 200 requests of 2,000 tokens, all stopped early: a few hundred tokens in all, not 400,000
    assert gauges["vllm:generation_tokens_total"] - before < 200 * LONG["max_tokens"] / 20


async def test_200_concurrent_streams_complete_with_well_formed_sse_and_exact_usage(aclient):
    async def stream(i: int) -> tuple[int, list[dict]]:
        prompt = [5 + i % 97] * (1 + i % 30)
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True, "model": MODEL_NAME,
                "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": i}
        response = await aclient.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return len(prompt), sse_events(response.text)

    async with asyncio.timeout(300):
        results = await asyncio.gather(*[stream(i) for i in range(200)])
    assert len(results) == 200
    ids = set()
    for num_prompt_tokens, events in results:
        *chunks, last = events
        assert last["choices"] == [] and last["usage"] == {"prompt_tokens": num_prompt_tokens,
                                                            "completion_tokens": 6,
                                                            "total_tokens": num_prompt_tokens + 6}
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert {c["id"] for c in events} == {last["id"]}
        ids.add(last["id"])
    assert len(ids) == 200
