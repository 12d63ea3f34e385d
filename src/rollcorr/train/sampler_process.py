"""The sampler in its own process: ``ProcessSource`` is a ``RolloutSource`` whose sampler computes elsewhere.

    trainer process                                     sampler process (one per executor)
    ───────────────                                     ──────────────────────────────────
    ProcessSource.load_weights(w, v)                    SourceSpec.build() once: sampler, tokenizer, task
      copy w into the shared weights buffer ─────────▶  ("load", v): sampler.load_weights(shared, v)
    ProcessSource.sample(index, partial, steps) ─────▶  ("sample", ...): RolloutSource.sample → Rollout
      ◀──────────────────────────────────────────────   ("ok", rollout) or ("error", traceback)

Why a process: a sampler thread shares the interpreter lock with the learner, so the two never really run
in parallel; a process computes on its own core while the trainer's thread waits on the pipe.

- **Start.** A fresh interpreter (``python -c "...serve(...)"``, importing the same rollcorr) that builds the
  sampler from the ``SourceSpec`` — nothing heavy is built in the trainer. Unlike ``multiprocessing``'s spawn,
  it does not re-run the trainer's main script, so a script without an ``if __name__ == "__main__"`` guard
  is safe.
- **Weights.** One anonymous shared-memory buffer (``memfd``) holds a copy of the state dict; both processes
  map it. Each load copies the new weights into it and sends ``("load", version)``, so weights and version
  travel as one request. Only the thread that drives the source writes the buffer, and only between requests,
  so the sampler never reads half-written weights.
- **Everything else** (requests, Rollouts, errors) is pickled over one socket pair.
- **Errors.** An exception in the sampler process (a construction error, a bad weight load, a failing
  sample) comes back with its traceback and is raised here as ``SamplerProcessError``, its own line first; a
  process that dies is reported with its exit code.
- **Heartbeat.** While it answers a request the process sends a heartbeat every ``HEARTBEAT_S``; a process
  that sends nothing for ``heartbeat_timeout_s`` (stopped with ``kill -STOP``, frozen) is killed and reported
  as a ``SamplerProcessError`` instead of blocking the trainer forever.
- **Shutdown.** ``close()`` asks the process to exit and waits; one that does not is terminated, then killed.
  The process exits by itself as soon as the trainer goes away (its end of the socket closes, also on
  ``kill -9``), and runs in its own session, so a Ctrl-C at the terminal reaches only the trainer (which
  finishes its step, saves a checkpoint and closes the sampler).

Listeners (``listeners`` for generated chunks, ``load_listeners`` for loaded weights) run in the trainer, in
the thread that drives the source, exactly as with an in-process ``RolloutSource``.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from rollcorr.engines.base import StateDict
from rollcorr.rollout import Rollout
from rollcorr.train.source import SourceSpec, copy_weights
from rollcorr.user_code import UserCodeError

Layout = list[tuple[str, torch.dtype, tuple[int, ...], int]]  # (name, dtype, shape, byte offset)
ALIGN = 64
HEARTBEAT_S = 2.0  # the sampler process says "still working" this often during a request


class SamplerProcessError(RuntimeError):
    """The sampler process failed (its exception and traceback are in the message) or died."""


def _send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def layout_of(weights: StateDict) -> tuple[Layout, int]:
    """Where each tensor lives in the flat buffer (offsets aligned to 64 bytes), and the buffer's size."""
    layout, offset = [], 0
    for name, value in weights.items():
        layout.append((name, value.dtype, tuple(value.shape), offset))
        offset += -(-value.numel() * value.element_size() // ALIGN) * ALIGN
    return layout, max(offset, ALIGN)


def map_weights(fd: int, layout: Layout, size: int) -> tuple[mmap.mmap, StateDict]:
    """The buffer behind ``fd`` mapped here, as tensors that view it (writes are seen by both processes)."""
    buffer = mmap.mmap(fd, size)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    tensors = {}
    for name, dtype, shape, offset in layout:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        tensors[name] = flat[offset : offset + nbytes].view(dtype).view(shape)
    return buffer, tensors


def _describe(err: BaseException) -> str:
    return "".join(traceback.format_exception(err)).rstrip()


def _answer(conn: Connection, message: tuple[str, Any]) -> bool:
    """Send ``message``; False when the trainer is gone."""
    try:
        _send(conn, message)
        return True
    except OSError:
        return False


def serve(conn_fd: int, weights_fd: int) -> None:
    """The sampler process: build the source with the shared weights, then answer requests until ``close``
    or until the trainer's end of the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(conn_fd)
    try:
        spec, layout, size, version = _receive(conn)
        _buffer, shared = map_weights(weights_fd, layout, size)
        if spec.threads > 0:
            torch.set_num_threads(spec.threads)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the trainer's output is not the place for the sampler's loading bar
        source = spec.build()
        source.load_weights(shared, version)
    except BaseException as err:  # noqa: BLE001 — every failure goes back to the trainer
        _answer(conn, ("error", _describe(err)))
        return
    send_lock, busy = threading.Lock(), threading.Event()

    def answer(message: tuple[str, Any]) -> bool:
        with send_lock:
            return _answer(conn, message)

    def beat() -> None:  # "still working" while a request runs: a stopped or frozen process sends none
        while not time.sleep(HEARTBEAT_S):
            if busy.is_set() and not answer(("beat", None)):
                return

    threading.Thread(target=beat, name="rollcorr-heartbeat", daemon=True).start()
    message: tuple[str, Any] = ("ok", os.getpid())
    while answer(message):
        try:
            op, args = _receive(conn)
        except (EOFError, OSError):
            return  # the trainer is gone
        if op == "close":
            return
        busy.set()
        try:
            result = source.load_weights(shared, *args) if op == "load" else source.sample(*args)
            message = ("ok", result)
        except UserCodeError as err:  # a reward that failed: its own line is the whole story
            message = ("user_error", str(err))
        except BaseException as err:  # noqa: BLE001
            message = ("error", _describe(err))
        busy.clear()


def _process_state(pid: int) -> str | None:
    """The state letter of ``/proc/PID/stat`` ("R", "S", "T" stopped, ...); None where unavailable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


class ProcessSource:
    """A ``RolloutSource`` built from ``spec`` in a sampler process; see the module docstring.

    The process starts with the first ``load_weights`` (an executor's ``start``), so a source that is never
    started costs nothing. One thread drives it at a time (the executor's producer); ``close()`` may come
    from another.
    """

    heartbeat_timeout_s: float = 60.0  # the sampler process beats every HEARTBEAT_S while it works

    def __init__(self, spec: SourceSpec, start_timeout_s: float = 300.0):
        self.spec, self.start_timeout_s = spec, start_timeout_s
        self.listeners: list[Callable[[Rollout], Any]] = []
        self.load_listeners: list[Callable[[StateDict, int], Any]] = []
        self.pid: int | None = None
        self._version: int | None = None
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._buffer: mmap.mmap | None = None
        self._shared: StateDict = {}
        self._lock = threading.Lock()  # one request on the socket at a time

    @property
    def alive(self) -> bool:
        """Whether the sampler process runs."""
        return self._process is not None and self._process.poll() is None

    @property
    def version(self) -> int:
        if self._version is None:
            raise RuntimeError("the sampler process holds no weights yet: load_weights first")
        return self._version

    def _start(self, weights: StateDict, version: int) -> None:
        layout, size = layout_of(weights)
        weights_fd = os.memfd_create("rollcorr-weights")
        ours, theirs = socket.socketpair()
        try:
            os.ftruncate(weights_fd, size)
            self._buffer, self._shared = map_weights(weights_fd, layout, size)
            self._copy_in(weights)
            code = f"from rollcorr.train.sampler_process import serve; serve({theirs.fileno()}, {weights_fd})"
            root = Path(__file__).resolve().parents[2]  # where this process imported rollcorr from
            if root.name not in ("site-packages", "dist-packages"):  # a source tree: make the sampler import it too
                code = f"import sys; sys.path.insert(0, {str(root)!r}); {code}"
            self._process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(), weights_fd),
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            self.pid = self._process.pid
        finally:
            theirs.close()
            os.close(weights_fd)  # both mappings keep the buffer alive
        self._conn = Connection(ours.detach())
        _send(self._conn, (self.spec, layout, size, int(version)))
        if not self._conn.poll(self.start_timeout_s):
            self.close(timeout_s=0)  # still starting, it could answer a close only once started: end it now
            raise SamplerProcessError(f"the sampler process did not start in {self.start_timeout_s:.0f} s")
        self._reply(self._process, self._conn, "start")

    def _copy_in(self, weights: StateDict) -> None:
        """Write ``weights`` into the shared buffer (same names and shapes as the first weights loaded)."""
        missing, unexpected = sorted(set(self._shared) - set(weights)), sorted(set(weights) - set(self._shared))
        bad = [k for k in set(weights) & set(self._shared) if weights[k].shape != self._shared[k].shape]
        if missing or unexpected or bad:
            raise ValueError(f"weights do not fit the sampler's model: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}, other shapes {sorted(bad)[:3]}")
        with torch.no_grad():
            for name, value in weights.items():
                self._shared[name].copy_(value)

    @staticmethod
    def _reply(process: subprocess.Popen, conn: Connection, op: str, heartbeat_timeout_s: float | None = None) -> Any:
        """The answer to ``op`` (heartbeats skipped); ``SamplerProcessError`` if the process died, failed, or
        sent nothing for ``heartbeat_timeout_s`` (stopped with SIGSTOP, or frozen): then it is killed."""
        try:
            while True:
                if heartbeat_timeout_s is not None and not conn.poll(heartbeat_timeout_s):
                    state = _process_state(process.pid)
                    process.kill()  # unresponsive: it cannot finish the request, and close() would wait on it
                    why = "it is stopped (SIGSTOP / Ctrl-Z)" if state in ("T", "t") else "it hangs"
                    raise SamplerProcessError(
                        f"the sampler process (pid {process.pid}) sent no heartbeat for {heartbeat_timeout_s:.0f} s "
                        f"during {op!r}: {why}; it was killed"
                    )
                status, value = _receive(conn)
                if status != "beat":
                    break
        except (EOFError, OSError):
            try:
                code = process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            raise SamplerProcessError(
                f"the sampler process (pid {process.pid}) died during {op!r} (exit code {code})"
            ) from None
        if status == "user_error":
            raise UserCodeError(value)
        if status == "error":  # the exception's own line first, then where it happened
            raise SamplerProcessError(f"{value.splitlines()[-1]} (in the sampler process, during {op!r}; its "
                                      f"traceback:)\n{value}")
        return value

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            process, conn = self._process, self._conn
            if conn is None:
                raise SamplerProcessError("the sampler process was closed")
            try:
                _send(conn, (op, args))
            except OSError:
                pass  # a dead process: _reply says so
            return self._reply(process, conn, op, self.heartbeat_timeout_s)

    def load_weights(self, weights: StateDict, version: int) -> None:
        if self._process is None:
            self._start(weights, version)
        else:
            self._copy_in(weights)
            self._call("load", version)
        self._version = int(version)
        for listener in self.load_listeners:
            listener(weights, version)

    def keep(self, weights: StateDict) -> StateDict:
        """A copy of published weights (fp32, CPU): the sampler's own form is in its process."""
        return copy_weights(weights)

    def sample(self, index: int, partial: Rollout | None = None, max_steps: int | None = None) -> Rollout:
        rollout = self._call("sample", index, partial, max_steps)
        for listener in self.listeners:
            listener(rollout)
        return rollout

    def responsive(self) -> bool:
        """False while the process is stopped (SIGSTOP): a request in progress cannot finish."""
        return self._process is None or _process_state(self._process.pid) not in ("T", "t")

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the process to exit (after the request it is answering); terminate or kill it if it does not."""
        process, conn = self._process, self._conn
        if process is None:
            return
        if _process_state(process.pid) in ("T", "t"):  # stopped (SIGSTOP): it can answer nothing; end it now
            process.kill()
        if conn is not None and self._lock.acquire(timeout=timeout_s):
            try:
                _send(conn, ("close", ()))
            except OSError:
                pass
            finally:
                self._lock.release()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if conn is not None:
            conn.close()
        self._process = self._conn = None
        self._shared = {}  # the tensors view the buffer; the mapping goes with the last of them
        self._buffer = None
