"""The engine's tcp sockets across nodes (docs/security.md, "Engine sockets across hosts"):
two launchers on loopback as two nodes, and a stranger on the same network who reaches
every tcp port of node 0. Whatever the stranger sends (a forged ActorFailed that would
end the server, with no CURVE or with a key of its own) is refused at the handshake and
logged; a stranger that connects to a plan socket to take the workers' step plans gets
none; the server keeps serving with the tokens of one rank; and every port the engine
listens on is on the interface it was given (torch.distributed's TCPStore included)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import msgspec
import psutil
import zmq

from actors import LLM, SamplingParams
from messages.frontend import ActorFailed
from messages.transport import free_tcp_port_range
from tests.api.conftest import AUTH, ENGINE_FLAGS, MODEL_NAME, REPO_ROOT, ServerProcess

ENGINE_KEY = "the two nodes' shared secret, 32+ characters"


def stranger_sockets(context: zmq.Context, port: int) -> tuple[list[zmq.Socket], list[zmq.Socket]]:
    """What a stranger opens on node 0's ports: pushers of a forged message to the
    frontend's inbox, and pullers on each plan socket; each without CURVE and with a CURVE
    key pair of its own (it cannot know the engine's)."""
    pushers, pullers = [], []
    for curve in (False, True):
        def socket(kind: int, address: str) -> zmq.Socket:
            opened = context.socket(kind)
            opened.linger = 0
            if curve:
                public, secret = zmq.curve_keypair()
                server_public, _ = zmq.curve_keypair()  # a guess at the engine's server key
                opened.curve_publickey, opened.curve_secretkey, opened.curve_serverkey = public, secret, server_public
            opened.connect(address)
            return opened

        pushers.append(socket(zmq.PUSH, f"tcp://127.0.0.1:{port + 1}"))
        pullers += [socket(zmq.PULL, f"tcp://127.0.0.1:{port + 2 + rank}") for rank in range(2)]
    forged = msgspec.msgpack.encode(ActorFailed(name="worker1", error="forged by a stranger"))
    for pusher in pushers:
        pusher.send(forged, flags=zmq.NOBLOCK)  # queued: it would leave once a handshake succeeded
    return pushers, pullers


def listening_addresses(root_pid: int) -> set[str]:
    """The IP addresses the process tree of root_pid listens on (tcp)."""
    pids = {root_pid} | {child.pid for child in psutil.Process(root_pid).children(recursive=True)}
    return {conn.laddr.ip for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids}


def test_strangers_on_every_tcp_socket_are_refused_and_logged_and_the_server_serves(tiny_llama_dir, tmp_path,
                                                                                     monkeypatch):
    port = free_tcp_port_range(5)
    monkeypatch.setenv("TROUPE_ENGINE_KEY", ENGINE_KEY)  # node 0 (ServerProcess) inherits it
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    node1_log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "actors.launch", "--model", tiny_llama_dir, *ENGINE_FLAGS,
                              *flags, "--node-rank", "1"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=node1_log,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    node0 = None
    context = zmq.Context()
    try:
        node0 = ServerProcess(tiny_llama_dir, tmp_path / "node0.log", *flags, "--node-rank", "0",
                              "--api-key", AUTH["Authorization"].split()[1])
        pushers, pullers = stranger_sockets(context, port)
        deadline = time.monotonic() + 30
        while node0.log().count("failed the engine's authentication") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # node 0 logs each socket's refusals: the frontend's and the two plan sockets'

        llm = LLM(tiny_llama_dir, kv_cache_memory="32MiB")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        expected = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{node0.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text  # the forged ActorFailed never arrived
        assert response.json()["choices"][0]["text"] == llm.tokenizer.decode(expected, skip_special_tokens=True)
        assert not any(puller.poll(100) for puller in pullers), "a stranger received a step plan"
        log = node0.log()
        for refused_port in (port + 1, port + 2, port + 3):
            assert f"refused a connection on tcp://127.0.0.1:{refused_port}" in log, log
        # nothing listens beyond the interface named (--master-addr 127.0.0.1, --host 127.0.0.1)
        assert listening_addresses(node0.popen.pid) | listening_addresses(node1.pid) <= {"127.0.0.1"}
        assert node0.stop() == 0
        assert node1.wait(30) == 0
    finally:
        for opened in [*locals().get("pushers", []), *locals().get("pullers", [])]:
            opened.close(0)
        context.term()
        if node0 is not None and node0.popen.poll() is None:
            node0.kill()
        node1.kill()
        node1.wait(10)
        node1.stdout.close()
        node1_log.close()


def test_a_node_without_the_engine_key_refuses_to_start(tiny_llama_dir):
    env = {key: value for key, value in os.environ.items() if key != "TROUPE_ENGINE_KEY"}
    done = subprocess.run([sys.executable, "-m", "actors.launch", "--model", tiny_llama_dir, *ENGINE_FLAGS,
                           "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"], cwd=REPO_ROOT,
                          env={**env, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "TROUPE_ENGINE_KEY" in done.stderr, done.stderr
