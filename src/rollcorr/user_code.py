"""The one door through which rollcorr calls user code: a reward function today, an environment tomorrow.

    value = call_user(fn, item, text, what="reward 'my_mod:score' on row 3", timeout=5.0)

``fn`` runs on a worker thread while the caller waits, so whatever it does is contained:

- it raises (anything, ``SystemExit`` included)  → ``UserCodeError``: one line, ``what``, the exception's own
  last line and the place in the user's file that raised it;
- it runs past ``timeout`` seconds               → ``UserCodeError`` saying so; the call is abandoned (a thread
  cannot be stopped: it runs on, and ends with the process; the next call gets a fresh worker);
- a signal arrives while the caller waits        → the caller's signal handler runs at once (the wait is
  interruptible), and may raise: ``waiting()`` tells it what user code the main thread is waiting for.

``call_each(fn, calls, what, timeout)`` makes a batch of such calls (a batch's rewards) with one thread switch
per batch, not per call. User code therefore never runs on the main thread:
a signal-based timeout inside it (``signal.alarm``) is not available there; ``timeout`` is the limit. What the
value must be is the caller's to check (a reward: ``rollcorr.tasks.base.checked_reward``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


class UserCodeError(RuntimeError):
    """User code (a reward, an environment) that raised, returned what it may not, or ran past its time limit;
    the message is one line naming it."""


class _Calls:
    """``fn`` over a list of argument tuples, run in order by a worker; ``clock`` is (the call running, since when)."""

    def __init__(self, fn: Callable[..., Any], calls: Sequence[tuple]) -> None:
        self.fn, self.calls = fn, calls
        self.done = threading.Event()
        self.values: list[Any] = []
        self.error: BaseException | None = None  # of call number len(values)
        self.clock = (0, time.monotonic())

    def run(self) -> None:
        for i, args in enumerate(self.calls):
            self.clock = (i, time.monotonic())
            try:
                self.values.append(self.fn(*args))
            except BaseException as err:  # noqa: BLE001 — whatever user code raises is its failure, said below
                self.error = err
                break
        self.done.set()


class _Worker(threading.Thread):
    """A daemon thread running batches of calls (a daemon: a call that never returns cannot hold the exit)."""

    def __init__(self) -> None:
        super().__init__(name="rollcorr-user-code", daemon=True)
        self.batches: queue.SimpleQueue[_Calls] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            self.batches.get().run()


_local = threading.local()  # each calling thread's worker
# what the main thread waits for (signal handlers run there, and ask ``waiting()``)
_main_waiting: list[tuple[_Calls, Callable[[int], str]]] = []


def waiting() -> str | None:
    """What user code the main thread is waiting for now (``what`` of the call running), or None."""
    if not _main_waiting:
        return None
    batch, what = _main_waiting[-1]
    return what(batch.clock[0])


def call_user(fn: Callable[..., Any], *args: Any, what: str, timeout: float | None = None,
              timeout_key: str | None = None) -> Any:  # fmt: skip
    """``fn(*args)`` on this thread's worker: its value, or ``UserCodeError`` naming ``what`` (see the module
    docstring). ``timeout``: seconds (None: no limit); ``timeout_key``: the setting that sets it, for the message."""
    return call_each(fn, [args], lambda _: what, timeout, timeout_key)[0]


def call_each(fn: Callable[..., Any], calls: Sequence[tuple], what: Callable[[int], str],
              timeout: float | None = None, timeout_key: str | None = None) -> list[Any]:  # fmt: skip
    """``[fn(*args) for args in calls]`` as ``call_user`` makes each call (``what(i)`` names call i, ``timeout``
    bounds each), handed to the worker at once: one thread switch per batch, not per call."""
    worker = getattr(_local, "worker", None)
    if worker is None:
        worker = _local.worker = _Worker()
    batch = _Calls(fn, calls)
    worker.batches.put(batch)
    main = threading.current_thread() is threading.main_thread()
    if main:
        _main_waiting.append((batch, what))
    late = None
    try:
        while late is None:
            index, started = batch.clock
            if batch.done.wait(None if timeout is None else max(0.0, started + timeout - time.monotonic())):
                break
            if batch.clock[0] == index and time.monotonic() - started >= timeout:
                late = index
    finally:
        if main:
            _main_waiting.pop()
        if not batch.done.is_set():  # abandoned (time limit, a signal handler raised): its worker may stay busy
            _local.worker = None
    if late is not None:
        limit = f" ({timeout_key}={timeout:g})" if timeout_key else ""
        raise UserCodeError(f"{what(late)} gave no answer in {timeout:g} s{limit}; it was abandoned")
    if batch.error is not None:
        raise UserCodeError(f"{what(len(batch.values))} failed: {said(batch.error)}") from None
    return batch.values


def said(err: BaseException) -> str:
    """The exception's last line (``Type: message``) and where the innermost frame raised it (``file.py:line``)."""
    last = traceback.format_exception_only(type(err), err)[-1].strip().replace("\n", " ")
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{last[:300]}{where}"
