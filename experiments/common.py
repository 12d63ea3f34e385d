"""Shared helpers of the study scripts: seeds → mean ± spread, atomic JSON, training runs, curve plots.

A claim counts as reproduced only when the difference of two means exceeds the spread: ``separated(a, b)``
is True when |mean_a − mean_b| > std_a + std_b (sample standard deviations over seeds).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"

# The shared small grid every training study uses (docs/results.md lists it; no per-method tuning).
GRID = {
    "optim.lr": [2e-4, 5e-4],
    "rollout.prompts_per_step": [16],
    "rollout.group_size": [8],
    "rollout.max_new_tokens": [6],
}
SEEDS = (0, 1, 2)


def summary(values: Sequence[float]) -> dict[str, Any]:
    """mean, std (sample, 0 for one value), min, max and the values themselves; NaN/inf are kept out of
    the moments and counted in ``n_nonfinite``."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    out: dict[str, Any] = {"values": [None if v is None or not math.isfinite(v) else float(v) for v in values]}
    out["n_nonfinite"] = len(values) - len(finite)
    if not finite:
        return out | {"mean": None, "std": None, "min": None, "max": None}
    return out | {
        "mean": statistics.fmean(finite),
        "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
        "min": min(finite),
        "max": max(finite),
    }


def separated(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when two ``summary`` results differ by more than their combined spread (std_a + std_b)."""
    if a["mean"] is None or b["mean"] is None:
        return False
    return abs(a["mean"] - b["mean"]) > a["std"] + b["std"]


def write_json(data: Any, path: Path) -> Path:
    """Write JSON atomically (temp file in the same folder, then rename); NaN becomes null."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(data), f, indent=1, allow_nan=False)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def save_figure(fig, path: Path) -> Path:
    """Save a matplotlib figure atomically as PNG and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class Clock:
    """Wall time of a study, printed at the end."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


# ---------------------------------------------------------------- training studies


def train_config(overrides: Sequence[str]):
    """A validated ``TrainConfig``: the shipped default YAML plus dotted ``overrides`` (as ``rollcorr train``)."""
    from rollcorr.train.config import load_config

    base = ["trainer.progress=false", "trainer.tensorboard=false", "trainer.checkpoint_every=0"]
    return load_config(None, base + list(overrides))


def train(overrides: Sequence[str], run_dir: Path) -> dict[str, Any]:
    """One training run through the trainer's public entry point; returns its result and metric records."""
    from rollcorr.train.logging import read_metrics
    from rollcorr.train.loop import run

    config = train_config([*overrides, f"trainer.out={run_dir}"])
    result = run(config, run_dir=Path(run_dir))
    return {
        "run_dir": str(result.run_dir),
        "steps": result.steps,
        "seconds": result.seconds,
        "initial_accuracy": result.initial_accuracy,
        "final_accuracy": result.final_accuracy,
        "stopped": result.stopped,
        "records": read_metrics(Path(result.run_dir)),
    }


def curve(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric over a run's records (records without the key are skipped)."""
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def mean_curve(runs: list[list[dict[str, Any]]], key: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and sample std over seeds of a metric at the steps every run logged it."""
    per_run = [dict(zip(*curve(records, key))) for records in runs]
    steps = sorted(set.intersection(*(set(c) for c in per_run))) if per_run else []
    means, stds = [], []
    for s in steps:
        s_sum = summary([c[s] for c in per_run])
        means.append(s_sum["mean"] if s_sum["mean"] is not None else float("nan"))
        stds.append(s_sum["std"] if s_sum["std"] is not None else float("nan"))
    return steps, means, stds


def plot_curves(
    groups: dict[str, list[list[dict[str, Any]]]], keys: Sequence[str], path: Path, title: str = ""
) -> Path:
    """One panel per metric key; one line per group (mean over seeds, band = ± std)."""
    n = len(keys)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, runs in groups.items():
            steps, mean, std = mean_curve(runs, key)
            if not steps:
                continue
            (line,) = ax.plot(steps, mean, label=label, lw=1.3)
            lo = [m - s for m, s in zip(mean, std)]
            hi = [m + s for m, s in zip(mean, std)]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def final_value(records: list[dict[str, Any]], key: str) -> float | None:
    """The last logged value of ``key`` in a run (None when never logged)."""
    _, values = curve(records, key)
    return values[-1] if values else None


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
