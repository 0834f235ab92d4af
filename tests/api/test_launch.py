"""python -m actors.launch as a user meets it: its flags, its one ready line and request
log, back-pressure, and how it ends (SIGTERM under load: exit 0; an actor killed: exit 1;
never a process left behind). Each test that serves starts a server of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.api.conftest import MODEL_NAME, REPO_ROOT, ServerProcess, child_pids, parse_metrics, sse_events


def launch(*flags: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors.launch", *flags], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def test_help_explains_every_flag_and_bad_ones_fail_clearly(tmp_path, long_context_llama_dir):
    result = launch("--help")
    assert result.returncode == 0
    for flag in ("--model", "--host", "--port", "--api-key", "--served-model-name", "--tensor-parallel-size",
                 "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--kv-cache-memory", "--gpu-memory-utilization", "--dtype", "--no-enable-prefix-caching", "--log-level",
                 "--max-waiting-requests", "--attention-backend", "--num-input-processors"):
        assert flag in result.stdout
    result = launch("--gpu-memory-utilization", "1.5")
    assert result.returncode == 2 and "(0, 1]" in result.stderr
    result = launch("--gpu-memory-utilization", "0.9", "--device", "cpu", "--port", "0")
    assert result.returncode == 1 and "--kv-cache-memory" in result.stderr
    result = launch("--kv-cache-memory", "lots")
    assert result.returncode == 2 and "512MiB" in result.stderr
    # the engine checks the rest before it starts any process
    result = launch("--model", str(tmp_path / "missing"), "--port", "0")
    assert result.returncode == 1 and "no such file or directory" in result.stderr
    result = launch("--model", long_context_llama_dir, "--port", "0", "--tensor-parallel-size", "3")
    assert result.returncode == 1 and "does not divide the model's 4 attention heads" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_fails_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = launch("--port", str(taken.getsockname()[1]), timeout=30.0)
    assert result.returncode == 1 and "cannot listen on" in result.stderr and result.stdout == ""


@pytest.fixture
def start_server(long_context_llama_dir, tmp_path):
    """start_server(*flags) -> a ServerProcess of its own, killed at the end if still up."""
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        started.append(ServerProcess(long_context_llama_dir, tmp_path / f"server{len(started)}.log", *flags))
        return started[-1]

    yield start
    for process in started:
        if process.popen.poll() is None or process.leftover_pids():
            process.kill()


def stream_in_background(url: str, body: dict, count: int) -> tuple[list[threading.Thread], list]:
    """count streaming requests, each in a thread; the list collects each one's response
    (read in full) or error."""
    outcomes: list = []

    def run() -> None:
        try:
            outcomes.append(httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60.0))
        except httpx.HTTPError as error:
            outcomes.append(error)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, outcomes


def wait_for_running(url: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if parse_metrics(httpx.get(f"{url}/metrics").text).get("vllm:num_requests_running") == count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} requests were not running within {timeout} s")


LONG = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True}


def test_back_pressure_turns_requests_away_with_retry_after_and_logs_each_request(start_server):
    server = start_server("--max-num-seqs", "2", "--max-waiting-requests", "1", "--shutdown-timeout", "1",
                          "--log-level", "info")
    assert server.ready_line == f"Serving {MODEL_NAME} on {server.url}"
    assert server.url.startswith("http://127.0.0.1:")
    threads, outcomes = stream_in_background(server.url, LONG, 3)  # two run, one waits
    wait_for_running(server.url, 2)
    time.sleep(0.2)  # the third is admitted too
    turned_away = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert turned_away.status_code == 503 and turned_away.headers["Retry-After"] == "1"
    assert turned_away.json()["error"]["code"] == "overloaded"

    assert server.stop() == 0
    for thread in threads:
        thread.join(30)
    # stopping aborted the three long streams: each still ended properly
    assert len(outcomes) == 3
    for outcome in outcomes:
        assert sse_events(outcome.text)[-1]["choices"][0]["finish_reason"] == "abort"
    log = server.log()
    assert log.count('"POST /v1/completions" 200') == 3 and log.count('"POST /v1/completions" 503') == 1
    assert "Exception in ASGI application" not in log and " ERROR api" not in log  # nothing unhandled


def test_sigterm_under_load_exits_0_within_30_s_and_leaves_no_process(start_server):
    server = start_server("--shutdown-timeout", "2", "--log-level", "warning")
    assert {"scheduler", "worker0", "detokenizer", "input_processor0"} <= set(server.actor_pids)
    threads, outcomes = stream_in_background(server.url, LONG, 16)
    wait_for_running(server.url, 16)
    server.signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    assert server.wait(30) == 0, server.log()
    assert time.monotonic() - signalled_at < 30
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == 16
    for outcome in outcomes:
        assert sse_events(outcome.text)[-1]["choices"][0]["finish_reason"] in ("length", "abort")
    assert not server.leftover_pids() and not child_pids(server.popen.pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def test_a_killed_actor_fails_in_flight_requests_and_the_server_exits_1(start_server):
    server = start_server("--log-level", "warning")
    threads, outcomes = stream_in_background(server.url, LONG, 4)
    wait_for_running(server.url, 4)
    os.kill(server.actor_pids["worker0"], signal.SIGKILL)
    assert server.wait(30) == 1, server.log()
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == 4
    for outcome in outcomes:
        # a stream already open ends with an error event, not silence; one still waiting
        # for its first token gets the error as its status
        if outcome.status_code == 200:
            assert sse_events(outcome.text)[-1]["error"]["code"] == "engine_dead"
        else:
            assert outcome.status_code == 503 and outcome.json()["error"]["code"] == "engine_dead"
    assert not server.leftover_pids()
    assert "the engine died" in server.log()


def test_sigterm_to_the_whole_process_group_is_a_clean_stop(long_context_llama_dir, tmp_path):
    """A service manager or `kill -- -PGID` signals every process of the group: the actors
    (in sessions of their own) are not hit, the launcher stops them in order, and the log
    says it stopped, not that the engine died."""
    server = ServerProcess(long_context_llama_dir, tmp_path / "server.log", "--shutdown-timeout", "2",
                           own_session=True)
    try:
        threads, outcomes = stream_in_background(server.url, LONG, 2)
        wait_for_running(server.url, 2)
        os.killpg(server.popen.pid, signal.SIGTERM)
        assert server.wait(30) == 0, server.log()
        for thread in threads:
            thread.join(30)
        # the running requests were given their time, then aborted in order: none failed
        assert len(outcomes) == 2
        for outcome in outcomes:
            assert sse_events(outcome.text)[-1]["choices"][0]["finish_reason"] in ("length", "abort")
        log = server.log()
        assert " ERROR " not in log and "engine died" not in log, log
        assert not server.leftover_pids()
    finally:
        if server.popen.poll() is None or server.leftover_pids():
            server.kill()


def test_step_size_defaults_by_device_and_prefix_caching_takes_vllms_flags():
    from api.server import engine_args, parse_args

    def resolved(*flags: str) -> dict:
        return engine_args(parse_args(list(flags)))

    assert resolved("--device", "cpu")["max_num_batched_tokens"] == 512
    assert resolved("--device", "cuda")["max_num_batched_tokens"] == 2048
    assert resolved("--device", "cpu", "--max-num-batched-tokens", "4096")["max_num_batched_tokens"] == 4096
    assert resolved()["enable_prefix_caching"] is True
    assert resolved("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert resolved("--no-prefix-caching")["enable_prefix_caching"] is False  # troupe's older spelling
    assert resolved("--no-enable-prefix-caching", "--enable-prefix-caching")["enable_prefix_caching"] is True
