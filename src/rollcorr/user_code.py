"""The one door through which rollcorr calls user code: a reward function today, an environment tomorrow.

    value = call_user(fn, item, text, what="reward 'my_mod:score' on row 3", timeout=5.0)

``fn`` runs on a worker thread while the caller waits, so whatever it does is contained:

- it raises (anything, ``SystemExit`` included)  → ``UserCodeError``: one line, ``what``, the exception's own
  last line and the place in the user's file that raised it;
- it runs past ``timeout`` seconds               → ``UserCodeError`` saying so; the call is abandoned: ``Abandoned``
  is raised inside it at its next Python line (a thread cannot be stopped inside one C call, e.g. ``time.sleep``:
  it runs on) and the next call gets a fresh worker;
- a signal arrives while the caller waits        → the caller's signal handler runs at once (the wait is
  interruptible), and may raise: ``waiting()`` tells it what user code the main thread is waiting for.

``call_each(fn, calls, what, timeout)`` makes a batch of such calls (a batch's rewards) with one thread switch
per batch, not per call. A process that exits waits up to ``EXIT_WAIT_S`` for abandoned calls to stop: C++
libraries (torch) tear down at exit under a thread still inside them, and the process then aborts (exit code
134 or 139 instead of its own, after a one-line error). User code therefore never runs on the main thread:
a signal-based timeout inside it (``signal.alarm``) is not available there; ``timeout`` is the limit. What the
value must be is the caller's to check (a reward: ``rollcorr.tasks.base.checked_reward``).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

EXIT_WAIT_S = 5.0  # seconds an exiting process waits for abandoned user code to stop


class UserCodeError(RuntimeError):
    """User code (a reward, an environment) that raised, returned what it may not, or ran past its time limit;
    the message is one line naming it."""


class Abandoned(BaseException):
    """Raised inside user code whose call was abandoned (its time limit, a signal handler that raised), so that
    it stops at its next Python line; a BaseException, so that ``except Exception`` in user code lets it pass."""


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
    """A daemon thread running batches of calls (a daemon: a call that never returns cannot hold the exit).
    Once ``abandon``-ed it takes no more batches and ends as soon as the call it runs stops."""

    def __init__(self) -> None:
        super().__init__(name="rollcorr-user-code", daemon=True)
        self.batches: queue.SimpleQueue[_Calls | None] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        try:
            while (batch := self.batches.get()) is not None:
                batch.run()
        except Abandoned:  # landed after the call it was meant for had returned
            pass

    def abandon(self) -> None:
        """Stop the call running here at its next Python line (``Abandoned`` raised in this thread), then end."""
        self.batches.put(None)
        _abandoned.append(self)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(Abandoned))


_local = threading.local()  # each calling thread's workers (``_workers``)
_abandoned: list[_Worker] = []  # workers abandoned with a call running, waited for at exit
# what the main thread waits for (signal handlers run there, and ask ``waiting()``): its batches, and how call
# k of batch b is named
_main_waiting: list[tuple[list[_Calls], Callable[[int, int], str]]] = []


def _workers(n: int) -> list[_Worker]:
    """This thread's first ``n`` workers, started as needed (an abandoned one is replaced)."""
    pool = _local.__dict__.setdefault("pool", [])
    pool.extend([None] * (n - len(pool)))
    for i in range(n):
        if pool[i] is None:
            pool[i] = _Worker()
    return pool[:n]


def waiting() -> str | None:
    """What user code the main thread is waiting for now (``what`` of a call running), or None."""
    if not _main_waiting:
        return None
    batches, named = _main_waiting[-1]
    b = next((i for i, batch in enumerate(batches) if not batch.done.is_set()), 0)
    return named(b, batches[b].clock[0])


def call_user(fn: Callable[..., Any], *args: Any, what: str, timeout: float | None = None,
              timeout_key: str | None = None) -> Any:
    """``fn(*args)`` on this thread's worker: its value, or ``UserCodeError`` naming ``what`` (see the module
    docstring). ``timeout``: seconds (None: no limit); ``timeout_key``: the setting that sets it, for the message."""
    return call_each(fn, [args], lambda _: what, timeout, timeout_key)[0]


def call_each(fn: Callable[..., Any], calls: Sequence[tuple], what: Callable[[int], str],
              timeout: float | None = None, timeout_key: str | None = None, workers: int = 1) -> list[Any]:
    """``[fn(*args) for args in calls]`` as ``call_user`` makes each call (``what(i)`` names call i, ``timeout``
    bounds each), handed to the worker at once: one thread switch per batch, not per call. ``workers`` > 1
    shares the calls out among that many workers, which run side by side (worker w takes calls w, w + workers,
    …): for user code that mostly waits, as an environment's tool call may."""
    shares = [list(range(w, len(calls), workers)) for w in range(max(1, min(workers, len(calls))))]
    batches = [_Calls(fn, [calls[i] for i in share]) for share in shares]
    pool = _workers(len(batches))
    for worker, batch in zip(pool, batches):
        worker.batches.put(batch)

    def named(b: int, k: int) -> str:
        return what(shares[b][k])

    main = threading.current_thread() is threading.main_thread()
    if main:
        _main_waiting.append((batches, named))
    late = None
    try:
        for b, batch in enumerate(batches):
            if (k := _late(batch, timeout)) is not None:
                late = (b, k)
                break
    finally:
        if main:
            _main_waiting.pop()
        for w, batch in enumerate(batches):
            if not batch.done.is_set():  # abandoned (time limit, a signal handler raised): stopped, replaced
                pool[w].abandon()
                _local.pool[w] = None
    if late is not None:
        limit = f" ({timeout_key}={timeout:g})" if timeout_key else ""
        raise UserCodeError(f"{named(*late)} gave no answer in {timeout:g} s{limit}; it was abandoned")
    for b, batch in enumerate(batches):
        if batch.error is not None:
            raise UserCodeError(f"{named(b, len(batch.values))} failed: {said(batch.error)}") from None
    values: list[Any] = [None] * len(calls)
    for share, batch in zip(shares, batches):
        for i, value in zip(share, batch.values):
            values[i] = value
    return values


def _late(batch: _Calls, timeout: float | None) -> int | None:
    """Wait for ``batch`` (interruptibly); the index of a call that ran past ``timeout`` seconds, else None."""
    while True:
        index, started = batch.clock
        if batch.done.wait(None if timeout is None else max(0.0, started + timeout - time.monotonic())):
            return None
        if batch.clock[0] == index and time.monotonic() - started >= timeout:
            return index


@atexit.register
def _wait_for_abandoned() -> None:
    """At exit, while the interpreter is still whole: give abandoned calls up to ``EXIT_WAIT_S`` in all to stop
    (``Abandoned`` was raised in them), so that no thread is inside torch as C++ tears down (which aborts)."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for worker in _abandoned:
        worker.join(max(0.0, deadline - time.monotonic()))


def said(err: BaseException) -> str:
    """The exception's last line (``Type: message``) and where the innermost frame raised it (``file.py:line``)."""
    last = traceback.format_exception_only(type(err), err)[-1].strip().replace("\n", " ")
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{last[:300]}{where}"
