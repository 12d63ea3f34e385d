"""Run folders: one writer at a time, a new run never lands in an old one, resume never makes things worse.

- ``new_run_dir``: ``--out`` or ``runs/<UTC timestamp>-<random suffix>`` (unique even for runs started in
  the same second).
- ``prepare_new_run``: refuses a non-empty folder unless asked to overwrite it (and then only a run folder).
- ``RunLock``: an ``fcntl`` advisory lock on ``RUN/.lock`` holding the writer's pid; a second writer (a
  second ``--resume``, or a new run with the same ``--out``) fails at once naming that pid. The kernel drops
  the lock when the process dies, so a killed run never leaves a stale lock.
- ``check_resume_config``: which keys may change on ``--resume`` (``RESUMABLE_KEYS``), checked against the
  checkpoint's stored config before anything is written.
- ``repair_metrics``: keeps every intact ``metrics.jsonl`` line up to the checkpoint step and says what it
  dropped.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollcorr.safe_io import (
    UnsafePathError,
    atomic_write_bytes,
    describe_os_error,
    open_inside,
    open_text_inside,
)
from rollcorr.train.config import ConfigError

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # what the model wrote (train.logging.SampleLog)
CONFIG_FILE = "config.yaml"

# Keys that may differ from the checkpoint's config on ``--resume``: they change what is logged, saved or
# how long the run goes, never what a step computes. ``trainer.steps`` must stay >= the checkpoint's step
# (note: with ``optim.schedule=cosine`` a new ``trainer.steps`` reshapes the remaining learning-rate decay).
RESUMABLE_KEYS = (
    "plugins",  # which modules are imported (what a run uses of them is named by other keys, checked here)
    "trainer.steps",
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.max_bad_steps",
    "trainer.threads",
    "trainer.ranks",  # the sharded checkpoint is resharded on load (distributed/checkpoint.py)
    "trainer.fsdp.reshard_after_forward",  # when gathered weights are freed, not what they compute
    "trainer.tensorboard",
    "trainer.wandb",
    "trainer.progress",
    "trainer.plot",
)


class RunFolderError(RuntimeError):
    """A run folder that cannot be used as asked (not empty, locked, not a run); one line for the user."""


class RunFinished(RunFolderError):
    """``--resume`` of a run whose newest checkpoint is already at ``trainer.steps``: nothing to do."""


def new_run_dir(out: str | None) -> Path:
    """``out`` (a path; a leading ``~`` is the user's home), or ``runs/<UTC timestamp>-<6 hex digits>``."""
    if out:
        return Path(out).expanduser()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{secrets.token_hex(3)}"


def _contents(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []


def check_new_run_dir(run_dir: Path, overwrite: bool = False) -> None:
    """Refuse a folder that is not empty (unless ``overwrite`` and it is a run folder); nothing is written."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"--out {run_dir}: exists and is not a directory")
    contents = _contents(run_dir)
    if not contents:
        return
    is_run = (run_dir / CONFIG_FILE).is_file() or (run_dir / METRICS_FILE).is_file()
    if not overwrite and not is_run:  # the user's own files: neither --resume nor --overwrite applies
        raise RunFolderError(
            f"--out {run_dir}: is not empty ({len(contents)} entries, e.g. {contents[0].name}) and holds no run; "
            "choose another --out (nothing there was touched)"
        )
    if not overwrite:
        raise RunFolderError(
            f"--out {run_dir}: holds a run; continue it with `rollcorr train --resume {run_dir}`, replace it with "
            f"--overwrite, or choose another --out"
        )
    if not is_run:
        raise RunFolderError(
            f"--out {run_dir}: --overwrite only replaces a run folder (with {CONFIG_FILE} or {METRICS_FILE}); "
            f"this one holds other files ({contents[0].name}, ...)"
        )


def make_run_dir(run_dir: Path) -> None:
    """Create the (checked) folder of a new run; ``RunFolderError`` (one line) where that is impossible
    (``/proc``, a read-only disk, a parent that is a file)."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"--out {run_dir}: cannot create the run folder ({describe_os_error(err)})") from None


def clear_run_dir(run_dir: Path) -> None:
    """Delete everything in a (locked, checked) run folder except the lock file."""
    for p in _contents(Path(run_dir)):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


class RunLock:
    """Exclusive advisory lock on ``run_dir/.lock`` for the life of a run (``with`` or ``release()``)."""

    def __init__(self, run_dir: Path):
        self.fd: int | None = None  # set before anything can fail: __del__ reads it
        self.path = Path(run_dir) / LOCK_FILE
        try:  # never follows a planted link, never truncates a FIFO or a device
            fd = open_inside(self.path, os.O_RDWR | os.O_CREAT)
        except UnsafePathError as err:
            raise RunFolderError(f"{err}; remove it to use this run folder") from None
        except OSError as err:
            raise RunFolderError(f"{Path(run_dir)}: cannot create its lock file {LOCK_FILE} "
                                 f"({describe_os_error(err)})") from None
        if os.fstat(fd).st_nlink > 1:  # a hard link to a file elsewhere: writing the pid would change it
            os.close(fd)
            raise RunFolderError(f"{self.path}: has other hard links (a file shared with another folder); "
                                 "remove it to use this run folder")
        self.fd = fd
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip()[:20] or "unknown"
            os.close(self.fd)
            self.fd = None
            raise RunFolderError(
                f"{Path(run_dir)}: in use by another rollcorr process (pid {holder}); wait for it to finish or "
                f"stop it, then try again"
            ) from None
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as err:
            self.release()
            raise RunFolderError(f"{self.path}: cannot write ({describe_os_error(err)})") from None

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:  # a Trainer built but never run must not keep its folder locked
        if getattr(self, "fd", None) is not None:
            self.release()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and not prefix:  # sections only; a mapping compares whole
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def check_resume_config(stored: dict[str, Any], new: dict[str, Any], checkpoint_step: int) -> None:
    """``ConfigError`` naming the first key that may not change on resume (see ``RESUMABLE_KEYS``)."""
    old_flat, new_flat = _flatten(stored), _flatten(new)
    for key in sorted(set(old_flat) | set(new_flat)):
        if key in RESUMABLE_KEYS or old_flat.get(key) == new_flat.get(key):
            continue
        raise ConfigError(
            f"{key}: cannot change on --resume (the checkpoint was trained with {old_flat.get(key)!r}, "
            f"asked for {new_flat.get(key)!r}); keys that may change: {', '.join(RESUMABLE_KEYS)}"
        )
    steps = new["trainer"]["steps"]
    if steps < checkpoint_step:
        raise ConfigError(
            f"trainer.steps: {steps} is below the newest checkpoint's step {checkpoint_step}; a run cannot go "
            f"back (start a new run to train fewer steps)"
        )


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of the intact training lines of ``metrics.jsonl`` (step 0's evaluation line excluded)."""
    path = Path(run_dir) / METRICS_FILE
    if not os.path.lexists(path):
        return []
    try:
        f = open_text_inside(path, "rb")
    except UnsafePathError as err:
        raise RunFolderError(f"{err}; move it aside to resume") from None
    steps = []
    with f:
        for raw in f:
            try:
                step = int(json.loads(raw)["step"])
            except (ValueError, KeyError, TypeError, OverflowError):
                continue
            if step > 0:
                steps.append(step)
    return steps


def check_restart_from_zero(run_dir: Path, checkpoint_every: int) -> None:
    """A run without a checkpoint restarts from step 0 only if it was killed before its first one: refuse
    (``RunFolderError``) when ``checkpoints/`` is gone (a new run makes it at once) but steps were logged, or
    when a step past ``checkpoint_every`` was logged (its checkpoint was saved before that step began)."""
    steps = logged_steps(run_dir)
    if not steps:
        return
    gone = not os.path.lexists(Path(run_dir) / "checkpoints")
    if gone or (checkpoint_every > 0 and max(steps) > checkpoint_every):
        why = "checkpoints/ is gone" if gone else f"no checkpoint is left (one was saved at step {checkpoint_every})"
        raise RunFolderError(
            f"{run_dir}: {METRICS_FILE} records {len(steps)} trained step(s) (up to step {max(steps)}) but "
            f"{why}; refusing to discard them and restart from step 0. To start the run again: "
            f"rollcorr train --config {Path(run_dir) / CONFIG_FILE} --out {run_dir} --overwrite"
        )


def repair_metrics(run_dir: Path, step: int, name: str = METRICS_FILE) -> str | None:
    """Keep every intact line of the run's ``name`` (``metrics.jsonl``, ``samples.jsonl``: one JSON object
    with a "step" per line) with step <= ``step``; drop the rest. Returns a report of what was dropped (None
    when nothing was). Written to a temp file, fsynced, then renamed."""
    path = Path(run_dir) / name
    if not os.path.lexists(path):
        return None
    keep, after, unreadable = [], 0, []
    try:
        f = open_text_inside(path, "rb")
    except UnsafePathError as err:
        raise RunFolderError(f"{err}; move it aside to resume") from None
    with f:
        for number, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                record_step = int(record["step"])
            except (ValueError, KeyError, TypeError, OverflowError):  # 1e400 is inf: int() overflows
                unreadable.append(number)
                continue
            if record_step <= step:
                keep.append(line)
            else:
                after += 1
    if not after and not unreadable:
        return None
    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())
    parts = []
    if after:
        parts.append(f"{after} line(s) after step {step}")
    if unreadable:
        shown = ", ".join(map(str, unreadable[:5])) + (" ..." if len(unreadable) > 5 else "")
        parts.append(f"{len(unreadable)} unreadable line(s) (line {shown})")
    return f"{name}: kept {len(keep)} line(s) up to step {step}; dropped {' and '.join(parts)}"
