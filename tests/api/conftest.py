"""A real server process (`python -m actors.launch`) on 127.0.0.1 and a free port, and the
helpers its tests share. The session's server runs a tiny random Llama with a long
context (room for requests that ask for thousands of tokens); tests that need a server of
their own (other flags, or one they kill) start one with ServerProcess."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 2048  # the shared server's context: room for requests of thousands of tokens
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# the engine flags of every test server: a small KV cache, and the CPU in float32 like the
# in-process engines the tests compare with (the launcher's default, "auto", takes a GPU)
ENGINE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "512", "--seed", "0",
                "--device", "cpu", "--dtype", "float32"]
STARTUP_TIMEOUT_S = 240.0
TEMPLATE_TIMEOUT_S = 2.0  # the shared server's --chat-template-timeout
RESPONSES_STORE_BYTES = 256 * 2**10  # the shared server's --responses-store-size
STOP_TIMEOUT_S = 30.0


def child_pids(pid: int) -> list[int]:
    """The direct children of a process, from /proc."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return children


def actor_name(pid: int) -> str:
    """An actor process's name ("worker0", "scheduler", ...), from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--name") + 1].decode() if b"--name" in argv else ""


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class ServerProcess:
    """`python -m actors.launch --model DIR --port 0 ...`, started and waited for (bounded);
    stop() or kill() ends it and every actor process it started."""

    def __init__(self, model_dir: str, log_path: Path, *flags: str, own_session: bool = False) -> None:
        """own_session: the server leads a process group of its own, which a test may
        signal as a whole (as a service manager does) without signalling pytest."""
        command = [sys.executable, "-m", "actors.launch", "--model", model_dir, "--host", "127.0.0.1", "--port", "0",
                   "--served-model-name", MODEL_NAME, *ENGINE_FLAGS, *flags]
        python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": python_path}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, start_new_session=own_session)
        self.actor_pids: dict[str, int] = {}  # actor name -> pid
        try:
            self.ready_line = self._wait_ready(STARTUP_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        self.url = self.ready_line.rsplit(" ", 1)[-1]
        self.actor_pids = {actor_name(pid): pid for pid in child_pids(self.popen.pid)}

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"the server exited with {self.popen.returncode}:\n{self.log()}")
            readable, _, _ = select.select([self.popen.stdout], [], [], 0.5)
            if readable:
                line = self.popen.stdout.readline().strip()
                if line.startswith("Serving "):
                    return line
                if line:
                    raise RuntimeError(f"unexpected output before the ready line: {line!r}")
        raise TimeoutError(f"the server did not start in {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> int:
        """SIGTERM, then the exit code (SIGKILL and an error past STOP_TIMEOUT_S)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the server ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s:\n{self.log()}")
        self._close()
        return self.popen.returncode

    def kill(self) -> None:
        """Last resort: SIGKILL the server and the actor processes it started."""
        for pid in [self.popen.pid, *self.actor_pids.values()]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.popen.wait(10)
        self._close()

    def _close(self) -> None:
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()

    def leftover_pids(self) -> list[int]:
        return [pid for pid in self.actor_pids.values() if pid_alive(pid)]


@pytest.fixture(scope="session")
def long_context_llama_dir(make_tiny_model) -> str:
    """Room for requests of thousands of tokens."""
    return make_tiny_model("llama", max_position_embeddings=4096)


@pytest.fixture(scope="session")
def server(long_context_llama_dir, tmp_path_factory):
    """The shared server: a context of MAX_MODEL_LEN, an API key, a 1 MiB body limit, room
    for 300 requests, requests' own chat templates rendered within TEMPLATE_TIMEOUT_S, 256 KiB of
    stored responses."""
    process = ServerProcess(long_context_llama_dir, tmp_path_factory.mktemp("server") / "server.log",
                            "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY, "--max-request-size", "1MiB",
                            "--max-waiting-requests", "44", "--trust-request-chat-template",
                            "--chat-template-timeout", str(TEMPLATE_TIMEOUT_S), "--responses-store-size",
                            str(RESPONSES_STORE_BYTES), "--log-level", "warning")
    yield from served(process)


def served(process: ServerProcess):
    """Yields a started server; when the fixture ends, stops it and checks that it exited
    cleanly and left no process behind (a fixture's `yield from served(...)`)."""
    try:
        yield process
    finally:
        exit_code = process.stop()
        assert exit_code == 0, process.log()
        assert not process.leftover_pids()


@pytest.fixture(scope="session")
def http(server):
    """A raw HTTP client of the shared server, with the API key."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as client:
        yield client


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a /metrics text, keyed by its name and its labels other than
    model_name and engine (the same on every engine metric): `vllm:num_requests_running`,
    `vllm:request_success_total{finished_reason="stop"}`."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
            samples[key] = sample.value
    return samples


def scrape_metrics(client: httpx.Client) -> dict[str, float]:
    """GET /metrics, parsed by parse_metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return parse_metrics(response.text)


def wait_until_idle(client: httpx.Client, timeout: float) -> dict[str, float]:
    """The metrics once no request runs or waits and no KV block is held; fails past timeout."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = scrape_metrics(client)
        idle = (gauges.get("vllm:num_requests_running") == 0 and gauges.get("vllm:num_requests_waiting") == 0
                and gauges.get("troupe_kv_cache_blocks_held") == 0)
        if idle:
            return gauges
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle {timeout} s later: {gauges}")
        time.sleep(0.05)


def sse_events(body: str) -> list[dict]:
    """The JSON events of a complete SSE body, checking its framing: `data: ...` events
    separated by blank lines, ending with `data: [DONE]`."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    blocks = body.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    events = []
    for block in blocks[:-2]:
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(json.loads(block[len("data: "):]))
    return events
