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
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn
import uvloop

from actors.config.cli_flags import parse_size_flag
from actors.engine.args import EngineArgs
from actors.errors import EngineStartupError
from actors.frontend.client import AsyncClient
from api.server_flags import (add_lora_server_flags, add_openai_api_flags, add_openai_server_flags, bind_unix_socket,
                                check_openai_server_flags, openai_server_settings)
from api.app import build_app
from api.errors import APIError
from api.lora_models import LoRAModulePath, ServedModels
from api.serving import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS, ServerSettings, ServingContext

logger = logging.getLogger("actors.launch")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# How long aborted responses get to reach their clients before uvicorn cancels them.
_ABORT_GRACE_S = 5.0
LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m actors.launch",
        description="Serve a model with troupe behind an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
        epilog="example: python -m actors.launch --model ~/models/Qwen3-0.6B --port 8080 --api-key secret\n"
               "then:    curl http://127.0.0.1:8080/v1/chat/completions -H 'Authorization: Bearer secret' "
               "-H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = EngineArgs.add_cli_args(parser)
    groups["model"].add_argument("--served-model-name", nargs="+", metavar="NAME",
                                 help="the name(s) clients use in the 'model' field (default: --model as given)")
    add_lora_server_flags(groups["lora"])
    groups["engine"].add_argument("--num-input-processors", type=int, default=1, metavar="N",
                                  help="processes that tokenize requests side by side (default: %(default)s)")

    server = parser.add_argument_group("HTTP server")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="the port to listen on; 0 picks a free one "
                                                               "(default: %(default)s)")
    server.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health and /ping "
                             "(docs/security.md)")
    server.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                        help="requests allowed to wait beyond the --max-num-seqs running ones; past that, new "
                             "requests get 503 with Retry-After (default: %(default)s)")
    server.add_argument("--max-request-size", type=parse_size_flag, default=DEFAULT_MAX_BODY_BYTES, metavar="SIZE",
                        help="larger request bodies get 413 (default: 16MiB)")
    server.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long running requests may take to finish before they "
                             "are aborted (default: %(default)s)")
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="'info' logs one line per request (default: %(default)s)")
    add_openai_server_flags(server)
    add_openai_api_flags(parser.add_argument_group("OpenAI API (vLLM's flags)"))

    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        EngineArgs.from_cli_args(args).check()
    except ValueError as error:
        parser.error(str(error))
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
    """The EngineArgs fields the flags set, with the server's defaults for those left unset."""
    return dataclasses.asdict(EngineArgs.from_cli_args(args).for_server())


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
        client = AsyncClient(num_input_processors=args.num_input_processors,
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

    @staticmethod
    async def _load_lora_modules(models: ServedModels, modules: list[LoRAModulePath]) -> bool:
        """Checks and adds the --lora-modules adapters; False (logged, naming the adapter)
        when the engine cannot run one: a server must not start without an adapter it was given."""
        for module in modules:
            try:
                await models.load_adapter(module.name, module.path, module.base_model_name)
            except APIError as error:
                logger.error("--lora-modules: the adapter %r at %s cannot be served: %s", module.name, module.path,
                             error)
                return False
        return True

    async def _serve(self, client: AsyncClient) -> int:
        args = self.args
        names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
        settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                                  max_waiting_requests=args.max_waiting_requests,
                                  max_body_bytes=args.max_request_size,
                                  **openai_server_settings(args))
        # every adapter given is served before the app exists, so no route ever sees a half-loaded list
        models = ServedModels(names, client)
        if not await self._load_lora_modules(models, args.lora_modules):
            return 1
        app = build_app(client, settings, models)
        self.serving = app.state.serving
        # a backstop: by then abort_all() has ended every response (uvicorn would cancel them)
        # h11, named: its bound on the header block is the one --h11-max-incomplete-event-size sets
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, root_path=args.root_path,
                                timeout_graceful_shutdown=args.shutdown_timeout + _ABORT_GRACE_S, http="h11",
                                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size)
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
    from actors.engine.supervisor import run_worker_node as run_ranks

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        engine = await asyncio.to_thread(EngineArgs(**engine_args(args)).build)
    except (ValueError, OSError, ImportError) as error:
        logger.error("bad engine arguments: %s", error)
        return 1
    ranks = engine.parallel.local_ranks
    print(f"Node {args.node_rank} running ranks {ranks.start}..{ranks.stop - 1} of {engine.parallel.world_size}",
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

