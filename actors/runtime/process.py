"""One actor, one process: how the launcher starts an actor process, and what runs in it.

Children are fresh interpreters (`python -m actors.runtime.process`) rather than forks or
multiprocessing spawns: nothing of the caller's state (threads, event loop, CUDA) leaks
into them, and the caller's __main__ is never re-imported. The ActorSpec travels on
the child's stdin as msgpack.

A child dies with its parent (PR_SET_PDEATHSIG), runs in a session of its own (a signal
to the launcher's process group, from a shell or a service manager, reaches the launcher
alone, which then stops the engine in order: running requests finish first), ignores
SIGINT (the launcher decides how a Ctrl-C ends the engine) and exits 0 after a Shutdown, non-zero after an error it
could not handle, having told the launcher what it was (ActorFailed)."""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import subprocess
import sys
import traceback

import msgspec

from actors.runtime.actor import ActorSpec

# kind -> "module:class" of the actor that runs it
ACTOR_CLASSES = {
    "input_processor": "actors.input_processor.actor:InputProcessorActor",
    "scheduler": "actors.scheduler.actor:SchedulerActor",
    "worker": "actors.worker.actor:WorkerActor",
    "detokenizer": "actors.detokenizer.actor:DetokenizerActor",
}

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class ActorProcess:
    """The launcher's handle on one actor process."""

    def __init__(self, spec: ActorSpec, env: dict[str, str] | None = None) -> None:
        self.name = spec.name
        self.spec = spec
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        child_env = dict(os.environ if env is None else env)
        # the child imports this checkout's packages even when troupe is not installed
        child_env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # OpenMP threads that spin long after each parallel region keep the cores from the
        # other actors, whose work sits between two model steps (measured on 2 cores: a tiny
        # model's decode took 150 ms a token with libgomp's default spinning, 2.5 ms with
        # passive waiting); threads that sleep at once pay a wake-up at each of a step's
        # hundreds of parallel regions (SmolLM2 served one request at a time: 31.5 ms a
        # token passive). A short spin covers the gaps inside a step and sleeps through
        # those between steps: 22.6 ms a token, the in-process engine's time.
        if "OMP_WAIT_POLICY" not in child_env:
            child_env.setdefault("GOMP_SPINCOUNT", "10000")
        # the name on the command line tells the processes apart in ps, top and psutil
        self.popen = subprocess.Popen([sys.executable, "-m", "actors.runtime.process", "--name", spec.name],
                                      stdin=subprocess.PIPE, env=child_env, start_new_session=True)
        assert self.popen.stdin is not None
        self.popen.stdin.write(msgspec.msgpack.encode(spec))
        self.popen.stdin.close()
        self.pid = self.popen.pid
        self.pidfd = open_pidfd(self.pid)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def open_pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when the process ends (Linux 5.3+), or None."""
    if hasattr(os, "pidfd_open"):
        try:
            return os.pidfd_open(pid)
        except OSError:
            pass
    return None


def _die_with_parent(name: str) -> None:
    """Also names the process (what ps -o comm and psutil's name() show; 15 bytes)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(f"troupe-{name}".encode()[:15]))
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own clean-up has to do
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _load_actor_class(kind: str) -> type:
    if kind not in ACTOR_CLASSES:
        raise ValueError(f"unknown actor kind {kind!r}")
    module_name, class_name = ACTOR_CLASSES[kind].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ActorSpec)
    _die_with_parent(spec.name)
    run_spec(spec)


def run_spec(spec: ActorSpec, leave=os._exit) -> None:
    """Runs the actor until it stops, then ends the process with leave(exit code) (a Ray
    worker's leaves as Ray asks: actors/engine/ray_executor.py)."""
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {spec.name}: %(message)s")
    from messages.frontend import ActorFailed
    from messages.transport import Sockets

    sockets = Sockets(secret=spec.secret)
    try:
        actor = _load_actor_class(spec.kind).from_spec(spec, sockets)
        import uvloop

        uvloop.run(actor.run())
    except BaseException as error:  # noqa: BLE001 - report anything that ends the actor
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        logging.getLogger(__name__).error("%s failed:\n%s", spec.name, traceback.format_exc())
        failure = sockets.outbox(spec.addresses["frontend"])
        failure.send(ActorFailed(name=spec.name, error=detail))
        _exit(sockets, 1, leave)
    _exit(sockets, 0, leave)


def _exit(sockets, code: int, leave=os._exit) -> None:
    """Leaves without the interpreter's teardown, which takes seconds once torch and
    transformers are loaded and has nothing left to do: the sockets are flushed (each
    closes with a bounded linger) and so are the log streams."""
    sockets.close()
    sockets.context.term()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    leave(code)


if __name__ == "__main__":
    main()
