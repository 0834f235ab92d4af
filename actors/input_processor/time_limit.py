"""A time limit on pure-Python work that cannot be cancelled any other way: a chat
template rendering in Jinja's sandbox, which bounds what a template may touch but not how
long its loops run (three nested loops of a client's template took seconds).

    call_with_time_limit(lambda: template.render(...), seconds=5.0)   # TimeLimitExceeded past 5 s

The call runs in the calling thread, unchanged; one watchdog thread per process keeps the
deadlines, and at one raises TimeLimitExceeded inside the late thread
(PyThreadState_SetAsyncExc: delivered at the thread's next bytecode, so a loop in Python
stops there; a single long C call, which a sandboxed template cannot make last, would
finish first). A call that ends just as its deadline passes clears the exception before
returning, so it never lands in the caller's later code."""

from __future__ import annotations

import ctypes
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# the C API, called with the GIL held (PYFUNCTYPE): once to raise an exception type in a
# thread, once (a NULL exception) to clear one still pending there
_raise_in_thread = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))
_clear_in_thread = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))


class TimeLimitExceeded(BaseException):
    """Raised inside a call past its time limit. A BaseException, as KeyboardInterrupt is:
    library code's `except Exception` must not swallow it."""


class _Guard:
    __slots__ = ("thread_id", "deadline", "done", "fired")

    def __init__(self, thread_id: int, deadline: float) -> None:
        self.thread_id = thread_id
        self.deadline = deadline
        self.done = False  # the call returned (or raised): nothing to interrupt
        self.fired = False  # the watchdog raised TimeLimitExceeded in the thread


class _Watchdog:
    """One thread a process, sleeping until the nearest deadline of the calls in flight."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._deadlines: list[tuple[float, int, _Guard]] = []  # a heap; disarmed guards are dropped lazily
        self._order = itertools.count()
        self._pid: int | None = None  # the process whose thread runs (a fork has none)

    def arm(self, seconds: float) -> _Guard:
        guard = _Guard(threading.get_ident(), time.monotonic() + seconds)
        with self._condition:
            if self._pid != os.getpid():
                self._pid, self._deadlines = os.getpid(), []
                threading.Thread(target=self._run, name="troupe-time-limit", daemon=True).start()
            heapq.heappush(self._deadlines, (guard.deadline, next(self._order), guard))
            self._condition.notify()
        return guard

    def disarm(self, guard: _Guard) -> None:
        with self._condition:
            guard.done = True
            fired = guard.fired
        if fired:  # raised already (then this clears nothing), or still pending: cleared before it lands
            _clear_in_thread(guard.thread_id, None)

    def _run(self) -> None:
        with self._condition:
            while True:
                while self._deadlines and self._deadlines[0][2].done:
                    heapq.heappop(self._deadlines)
                if not self._deadlines:
                    self._condition.wait()
                    continue
                deadline, _, guard = self._deadlines[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._condition.wait(wait)
                    continue
                heapq.heappop(self._deadlines)
                guard.fired = True
                _raise_in_thread(guard.thread_id, TimeLimitExceeded)


_watchdog = _Watchdog()


def call_with_time_limit(call: Callable[[], T], seconds: float) -> T:
    """call() in this thread; TimeLimitExceeded once it has run for seconds."""
    guard = _watchdog.arm(seconds)
    try:
        return call()
    finally:
        _watchdog.disarm(guard)
