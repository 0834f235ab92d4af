"""python -m actors.launch: the OpenAI-compatible HTTP server over a troupe engine.

    python -m actors.launch                      # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
    python -m actors.launch --model PATH --port 8080 --api-key secret
    python -m actors.launch --uds /run/troupe.sock --root-path /llm   # behind a proxy

Start-up: bind the port or Unix socket (so one in use fails at once, before the model
loads), start the engine's actor processes (AsyncClient), serve the app (api/) with uvicorn
on uvloop, and print one line, `Serving MODEL on http://HOST:PORT` (or `on unix:PATH`),
once requests are taken.

Shutdown: SIGTERM or SIGINT stops taking connections, gives running requests
--shutdown-timeout seconds to finish, aborts the rest, stops every actor process and
exits 0 (a second SIGINT skips the wait). If an engine actor dies, in-flight requests
fail (503) and the server exits 1."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn
import uvloop

from actors.config import parse_size
from actors.engine_args import ATTENTION_BACKENDS, DEVICES, DTYPES, LOAD_FORMATS
from actors.errors import EngineStartupError
from actors.frontend import AsyncClient
from actors.launch_args import (add_openai_api_flags, add_openai_server_flags, bind_unix_socket, check_openai_server_flags,
                                openai_server_settings)
from api.app import build_app
from api.serving import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS, ServerSettings, ServingContext

logger = logging.getLogger("actors.launch")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# How long aborted responses get to reach their clients before uvicorn cancels them.
_ABORT_GRACE_S = 5.0
LOG_LEVELS = ("debug", "info", "warning", "error")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes or a size like 512MiB or 2GiB, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m actors.launch",
        description="Serve a model with troupe behind an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
        epilog="example: python -m actors.launch --model ~/models/Qwen3-0.6B --port 8080 --api-key secret\n"
               "then:    curl http://127.0.0.1:8080/v1/chat/completions -H 'Authorization: Bearer secret' "
               "-H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="a local Hugging Face model directory or .gguf file (default: the embedded "
                            "SmolLM2-135M-Instruct)")
    model.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the name(s) clients use in the 'model' field (default: --model as given)")
    model.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="weights and activations; 'auto': float32 on the CPU, bfloat16 on CUDA (default: "
                            "%(default)s)")
    model.add_argument("--max-model-len", type=int, metavar="TOKENS",
                       help="the longest prompt plus output (default: the model's own limit)")
    model.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                       help="'dummy' runs random weights, for benchmarks (default: %(default)s)")
    model.add_argument("--seed", type=int, default=0, help="the engine's random seed (default: %(default)s)")

    server = parser.add_argument_group("HTTP server")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="the port to listen on; 0 picks a free one "
                                                               "(default: %(default)s)")
    server.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on the /v1 routes")
    server.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                        help="requests allowed to wait beyond the --max-num-seqs running ones; past that, new "
                             "requests get 503 with Retry-After (default: %(default)s)")
    server.add_argument("--max-request-size", type=_size, default=DEFAULT_MAX_BODY_BYTES, metavar="SIZE",
                        help="larger request bodies get 413 (default: 16MiB)")
    server.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long running requests may take to finish before they "
                             "are aborted (default: %(default)s)")
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="'info' logs one line per request (default: %(default)s)")
    add_openai_server_flags(server)
    add_openai_api_flags(parser.add_argument_group("OpenAI API (vLLM's flags)"))

    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="requests running at once (default: %(default)s)")
    engine.add_argument("--max-num-batched-tokens", type=int, metavar="TOKENS",
                        help="tokens computed in one step (default: %d on the CPU, %d on CUDA; a step's "
                             "time grows with its tokens, and every running request waits for it)"
                             % (SERVER_BATCHED_TOKENS["cpu"], SERVER_BATCHED_TOKENS["cuda"]))
    engine.add_argument("--block-size", type=int, default=16, metavar="TOKENS", help="tokens per KV-cache block (default: %(default)s)")
    engine.add_argument("--kv-cache-memory", type=_size, default="2GiB", metavar="SIZE",
                        help="memory for the KV cache, e.g. 512MiB or 4GiB (default: 2GiB)")
    engine.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                        help="on CUDA, size the KV cache from this share of the GPU's memory (e.g. 0.9): "
                             "what the weights and a profiled step leave of it; replaces --kv-cache-memory")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cache of shared prompt prefixes (default: on)")
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help=argparse.SUPPRESS)  # troupe's first spelling of --no-enable-prefix-caching
    engine.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                        help="'auto': Triton kernels on CUDA, the C++ kernels ('cpu') on the CPU; 'torch': the plain "
                             "torch references (default: %(default)s)")
    engine.add_argument("--device", choices=DEVICES, default="auto",
                        help="'auto': CUDA when there is a GPU, else the CPU (default: %(default)s)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="worker processes, one per device, each holding a slice of the model "
                             "(default: %(default)s)")
    engine.add_argument("--num-input-processors", type=int, default=1, metavar="N",
                        help="processes that tokenize requests side by side (default: %(default)s)")

    nodes = parser.add_argument_group(
        "several machines", "Node 0 serves HTTP and runs the first tensor-parallel ranks; every other node "
        "runs its share of the ranks only, started with the same flags and its own --node-rank. They meet at "
        "--master-addr: torch.distributed on --master-port, ZeroMQ over tcp on the ports just above it.")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="N", help="machines (default: %(default)s)")
    nodes.add_argument("--node-rank", type=int, default=0, metavar="I", help="this machine (default: %(default)s)")
    nodes.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                       help="node 0's address, reachable from every node (default: %(default)s)")
    nodes.add_argument("--master-port", type=int, default=29500, metavar="PORT",
                       help="the first of tensor-parallel-size + 2 free ports on node 0 (default: %(default)s)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_waiting_requests", "num_input_processors"):
        if getattr(args, name) < (0 if name == "max_waiting_requests" else 1):
            parser.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be non-negative")
    check_openai_server_flags(parser, args)
    return args


def engine_args(args: argparse.Namespace) -> dict:
    """The EngineArgs fields the flags set."""
    batched_tokens = args.max_num_batched_tokens or SERVER_BATCHED_TOKENS[_device_kind(args.device)]
    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched_tokens,
                block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                gpu_memory_utilization=args.gpu_memory_utilization,
                dtype=args.dtype, device=args.device, tensor_parallel_size=args.tensor_parallel_size,
                seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
                attention_backend=args.attention_backend, load_format=args.load_format,
                nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                master_port=args.master_port, max_logprobs=args.max_logprobs)


# The server's step size when --max-num-batched-tokens is not given. On the CPU a step's
# time grows with its tokens from a few dozen on (compute-bound), so a 2048-token prefill
# step stalls every decoding request for seconds (4.5 s on a 2-core EPYC); 512 cut the p99
# inter-token latency of benchmarks/serve_vs_offline.py's workload from 2.8 s to 1.4 s and
# the median time to first token from 4.8 s to 3.2 s at the same throughput (RESULTS.md).
# The offline LLM keeps 2048, as vLLM keeps a larger budget for its LLM class.
SERVER_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


def _device_kind(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handling: uvicorn re-raises a caught
    SIGTERM once it has stopped (so the process would die of it, not exit 0); the
    launcher handles signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Launcher:
    """One server's life: start the engine, serve, stop on a signal or an engine death."""

    def __init__(self, args: argparse.Namespace, sock: socket.socket) -> None:
        self.args = args
        self.sock = sock
        self.stop_requested = asyncio.Event()
        self.server: _Server | None = None
        self.serving: ServingContext | None = None
        self._aborting: list[asyncio.Task] = []

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.stop_requested.is_set():
            if signum == signal.SIGINT and self.serving is not None:
                logger.warning("second %s: aborting the running requests now", name)
                self._abort_soon(0.0)
            return
        logger.info("%s: stopping (running requests get %.0f s to finish)", name, self.args.shutdown_timeout)
        self.stop_requested.set()
        if self.server is not None:
            self.server.should_exit = True  # uvicorn stops accepting, then waits for the open responses
            self._abort_soon(self.args.shutdown_timeout)

    def _abort_soon(self, delay: float) -> None:
        """Ends what still runs after delay with finish_reason "abort", so that every
        client gets a complete response and uvicorn's wait for open responses ends."""
        serving = self.serving

        async def abort_after_delay() -> None:
            await asyncio.sleep(delay)
            if serving.open_requests:
                logger.warning("aborting %d running requests", len(serving.open_requests))
            await serving.abort_all()

        self._aborting.append(asyncio.ensure_future(abort_after_delay()))

    async def run(self) -> int:
        """The exit code: 0 after a signal, 1 when the engine failed to start or died."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.on_signal, signum)
        args = self.args
        client = AsyncClient(args.model, num_input_processors=args.num_input_processors,
                             log_level="DEBUG" if args.log_level == "debug" else "WARNING", **engine_args(args))
        try:
            if not await self._start(client):
                return 0
            return await self._serve(client)
        except (EngineStartupError, ValueError, OSError, ImportError) as error:
            logger.error("the engine did not start: %s", error)
            return 1
        finally:
            await client.close()
            self.sock.close()
            if self.args.uds:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.args.uds)  # a socket file outlives its socket

    async def _start(self, client: AsyncClient) -> bool:
        """Starts the engine; False when a signal came first (the start is cancelled)."""
        starting = asyncio.ensure_future(client.start())
        stopping = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return False
        starting.result()
        await client.get_tokenizer()  # loaded now, not by the first request that needs it
        return not self.stop_requested.is_set()

    async def _serve(self, client: AsyncClient) -> int:
        args = self.args
        names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
        settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                                  max_waiting_requests=args.max_waiting_requests,
                                  max_body_bytes=args.max_request_size, model_root=client.config.model.model_path,
                                  **openai_server_settings(args))
        app = build_app(client, settings)
        self.serving = app.state.serving
        # a backstop: by then abort_all() has ended every response (uvicorn would cancel them)
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, root_path=args.root_path,
                                timeout_graceful_shutdown=args.shutdown_timeout + _ABORT_GRACE_S)
        self.server = _Server(config)
        serve_task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        dying = asyncio.ensure_future(client.wait_until_dead())
        try:
            while not self.server.started and not serve_task.done():
                await asyncio.sleep(0.02)
            if self.server.started:
                print(f"Serving {names[0]} on {_listen_url(args, self.sock)}", flush=True)
            await asyncio.wait((serve_task, dying), return_when=asyncio.FIRST_COMPLETED)
            exit_code = 0
            if dying.done() and not serve_task.done():
                self.server.should_exit = True
                if self.stop_requested.is_set():
                    # the actors got the stop signal too (a service manager signals every process)
                    logger.info("the engine's actors stopped on the signal too; in-flight requests ended")
                else:
                    logger.error("the engine died (%s); in-flight requests failed; stopping", dying.result())
                    exit_code = 1
            await serve_task
            return exit_code
        finally:
            dying.cancel()
            for task in self._aborting:
                task.cancel()


async def run_worker_node(args: argparse.Namespace) -> int:
    """A node other than 0: its ranks only, until the engine stops them or a signal."""
    from actors.engine_args import EngineArgs
    from actors.supervisor import run_worker_node as run_ranks

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        engine = await asyncio.to_thread(EngineArgs(model=args.model, **engine_args(args)).build)
    except (ValueError, OSError, ImportError) as error:
        logger.error("bad engine arguments: %s", error)
        return 1
    ranks = engine.parallel.local_ranks
    print(f"Node {args.node_rank} running ranks {ranks.start}..{ranks.stop - 1} of {args.tensor_parallel_size}",
          flush=True)
    return await run_ranks(engine, stop, "DEBUG" if args.log_level == "debug" else "WARNING")


def _listen_url(args: argparse.Namespace, sock: socket.socket | None = None) -> str:
    """Where the server listens: unix:PATH, or http://HOST:PORT (the port sock is bound to:
    --port 0 picks one)."""
    if args.uds:
        return f"unix:{args.uds}"
    host, port = args.host, sock.getsockname()[1] if sock is not None else args.port
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn's own start/stop chatter only at debug; its warnings and errors always
    logging.getLogger("uvicorn.error").setLevel(logging.DEBUG if args.log_level == "debug" else logging.WARNING)
    if args.node_rank > 0:
        sys.exit(uvloop.run(run_worker_node(args)))
    try:
        sock = bind_unix_socket(args.uds) if args.uds else bind_socket(args.host, args.port)
    except OSError as error:
        logger.error("cannot listen on %s: %s", _listen_url(args), error)
        sys.exit(1)
    sys.exit(uvloop.run(Launcher(args, sock).run()))


if __name__ == "__main__":
    main()
