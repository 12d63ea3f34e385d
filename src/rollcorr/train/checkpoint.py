"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

``checkpoints/step_000050/`` holds ``state.pt`` (learner weights, optimizer, weight version, executor state —
lagged weight history or async queue —, π_old strategy state, RNG states, loop counters) and ``model/`` (the
learner weights as a Hugging Face directory, loadable on its own). It is written to a temporary directory
first and renamed into place, so a checkpoint directory either exists complete or not at all.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], model=None, tokenizer=None, keep: int = 2
) -> Path:
    """Write ``state`` (and the model as an HF directory) atomically; keep the newest ``keep`` checkpoints."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / STATE_FILE)
    if model is not None:
        model.save_pretrained(tmp / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
    if final.exists():
        old = final.parent / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    for stale in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no checkpoint in {str(run_dir)!r} (expected checkpoints/step_*/{STATE_FILE})"
        )
    return found[-1]


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
