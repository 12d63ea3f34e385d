"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

``checkpoints/step_000050/`` holds ``state.pt`` (learner weights, optimizer, weight version, executor state —
lagged weight history or async queue —, π_old strategy state, RNG states, loop counters) and ``model/`` (the
learner weights as a Hugging Face directory, loadable on its own). It is written to ``.tmp-step_000050``,
every file and the directory are fsynced, and only then renamed into place (a step saved twice goes through
``.old-step_000050``), so a checkpoint directory either exists complete or not at all. ``recover_checkpoints``
tidies what a kill between those renames leaves behind.

A run folder is untrusted input (it may come from a colleague or a bucket): ``state.pt`` is read with
``torch.load(weights_only=True)``, which builds tensors, numbers, strings and containers only — plus the one
rollcorr type a checkpoint holds (``Rollout``, the async executor's queued batches). The RNG states are stored
as plain tensors and lists for that reason.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollcorr.rollout import Rollout

STATE_FILE = "state.pt"
STATE_KEYS = ("step", "version", "model", "optimizer", "executor", "proximal", "rng", "loop", "config")
SAFE_TYPES = [Rollout]  # the only non-builtin type a state.pt may contain (queued async batches)
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (truncated, corrupt, or holding code)."""


def rng_state() -> dict[str, Any]:
    """torch, Python and NumPy global RNG states as tensors, tuples and lists (safe to load)."""
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, key.tolist(), int(pos), int(has_gauss), float(gauss)],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk (directories: so a rename survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], model=None, tokenizer=None, keep: int = 2
) -> Path:
    """Write ``state`` (and the model as an HF directory) atomically; keep the newest ``keep`` checkpoints.

    On any error (a full disk) the temporary directory is removed again and the error re-raised.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        torch.save(state, tmp / STATE_FILE)
        if model is not None:
            model.save_pretrained(tmp / "model")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "model")
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_checkpoint(run_dir, step, tmp, keep)


def commit_checkpoint(run_dir: Path, step: int, tmp: Path, keep: int = 2) -> Path:
    """Rename the complete, fsynced ``tmp`` into ``step_N`` (through ``.old-step_N`` when it exists) and keep
    the newest ``keep`` checkpoints. Shared by one-process and sharded (``distributed/checkpoint.py``) saves."""
    final = checkpoint_dir(run_dir, step)
    if final.exists():
        old = final.parent / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
        fsync_path(final.parent)
    for stale in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def recover_checkpoints(run_dir: Path) -> list[str]:
    """Tidy ``checkpoints/`` after a kill; returns one message per thing done.

    ``.old-step_N`` is a complete checkpoint renamed aside while step N was saved again: it becomes
    ``step_N`` again when that one is missing, and is removed otherwise. ``.tmp-step_N`` is a save that did
    not finish (or finished after ``.old-step_N`` was made: the older complete copy is kept) and is removed.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = []
    for old in sorted(root.glob(".old-step_*")):
        final = root / old.name.removeprefix(".old-")
        if (final / STATE_FILE).is_file():
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name} (superseded by {final.name})")
        else:
            shutil.rmtree(final, ignore_errors=True)
            old.rename(final)
            done.append(f"restored {final.name} from {old.name} (the run was killed while re-saving it)")
    for tmp in sorted(root.glob(".tmp-step_*")):
        shutil.rmtree(tmp, ignore_errors=True)
        done.append(f"removed the unfinished save {tmp.name}")
    if done:
        fsync_path(root)
    return done


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoints of a run (``step_N/state.pt`` exists), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def checkpoint_step(path: Path) -> int:
    return int(_STEP_DIR.match(Path(path).name).group(1))


def latest_checkpoint(run_dir: Path) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no checkpoint in {str(run_dir)!r} (expected checkpoints/step_*/{STATE_FILE})"
        )
    return found[-1]


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read ``path/state.pt`` without running code from it; ``CheckpointError`` (one line) if unreadable."""
    file = Path(path) / STATE_FILE
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, a forbidden global, a read error
        text = str(err).strip()
        reason = text.splitlines()[0] if text else type(err).__name__
        if "Weights only load failed" in text:  # torch's safe unpickler met something that is not data
            found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", text)
            detail = text.partition("WeightsUnpickler error:")[2].strip().splitlines()
            reason = (
                f"it calls {found.group(1)!r}" if found else detail[0] if detail else "unsupported content"
            )
            reason = f"refused to load: {reason} (a checkpoint holds only tensors, numbers and strings)"
        raise CheckpointError(f"{file}: {reason}") from None
    missing = [key for key in STATE_KEYS if key not in state] if isinstance(state, dict) else ["step"]
    if missing:
        raise CheckpointError(f"{file}: not a rollcorr checkpoint (no {missing[0]!r} entry)")
    return state


def load_latest_intact(run_dir: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint that loads: (path, state, one message per newer one skipped and why).

    (None, None, messages) when the run has no readable checkpoint.
    """
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path), skipped
        except CheckpointError as err:
            skipped.append(f"skipped checkpoint {path.name}: {err}")
    return None, None, skipped
