"""Shared helpers of the study scripts: seeds → mean ± spread, atomic JSON, training runs, curve plots.

A claim counts as reproduced only when the difference of two means exceeds the spread: ``separated(a, b)``
is True when |mean_a − mean_b| > std_a + std_b (sample standard deviations over seeds).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rollcorr.plotting import save_figure  # noqa: E402,F401  (re-exported for the studies)

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"

# The shared small grid every training study uses (docs/results.md lists it; no per-method tuning).
# Everything else is the shipped default config (16 prompts × 8 responses, 6 new tokens, temperature 1).
GRID = {"optim.lr": [2e-4, 4e-4, 1e-3]}  # 1e-3 collapses every arm within 10 steps (docs/results.md)
RUNS = ROOT.parent / "runs" / "experiments"  # training run folders (checkpoints, metrics); not committed
SEEDS = (0, 1, 2)
COMMIT_FILE = "code_commit"  # in a run folder: the commit (``code_commit()``) the run trained on


def summary(values: Sequence[float]) -> dict[str, Any]:
    """mean, std (sample, 0 for one value), min, max and the values themselves; NaN/inf are kept out of
    the moments and counted in ``n_nonfinite``."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    out: dict[str, Any] = {
        "values": [None if v is None or not math.isfinite(v) else float(v) for v in values]
    }
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
    """True when two ``summary`` results, each over ≥ 2 seeds, differ by more than their combined spread
    (std_a + std_b). With one seed there is no spread, so nothing counts as reproduced."""
    if a["mean"] is None or b["mean"] is None:
        return False
    if len(a["values"]) - a["n_nonfinite"] < 2 or len(b["values"]) - b["n_nonfinite"] < 2:
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
        x = str(x)
    if isinstance(x, str) and x.startswith(f"{ROOT.parent}/"):  # results.json holds no path of this machine
        return x[len(str(ROOT.parent)) + 1 :]  # relative to the checkout, e.g. runs/experiments/...
    return x


def code_commit() -> str | None:
    """The checkout's commit (``git rev-parse HEAD``), with ``+dirty`` when tracked files outside
    experiments/results differ from it (so a run's figures name the code they ran on); None outside git."""
    git = ["git", "-C", str(ROOT.parent)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)experiments/results"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    """The CPU model, torch's CPU capability and versions a run trained with (recorded in every run file)."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version()}


def first_commit(path: str) -> str | None:
    """The commit that added ``path`` (relative to the repository; its first commit), None outside git."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT.parent), "log", "--diff-filter=A", "--format=%H", "--", path],
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    commits = out.stdout.split()
    return commits[-1] if commits else None


def parse_part(parser, text: str) -> tuple[int, int]:
    """``--part K/N`` → (K, N), or the parser's one-line error."""
    try:
        k, n = (int(x) for x in text.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        parser.error(f"--part {text!r}: expected K/N with 1 ≤ K ≤ N")
    return k, n


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
    # the studies of docs/results.md ran with an optimizer step even on a zero gradient (the trainer's default
    # then); an arm that wants the new default sets optim.skip_zero_grad=true itself
    base.append("optim.skip_zero_grad=false")
    return load_config(None, base + list(overrides))


def train(overrides: Sequence[str], run_dir: Path) -> dict[str, Any]:
    """One training run through the trainer's public entry point; returns its result and metric records.

    A run folder that already holds a finished run of the same config (every key of its config.yaml equal
    to the current config, final checkpoint present) is read instead of retrained; an unfinished one of the same
    config is resumed, and a folder holding another config is replaced, so an interrupted study continues where
    it stopped.
    """
    import yaml

    from rollcorr.checkpoint import checkpoint_dir
    from rollcorr.train.logging import read_metrics
    from rollcorr.train.loop import run

    run_dir = Path(run_dir)
    config = train_config([*overrides, f"trainer.out={run_dir}"])
    saved = run_dir / "config.yaml"
    finished = checkpoint_dir(run_dir, config.trainer.steps) / "model"
    if saved.is_file() and finished.is_dir() and _same(yaml.safe_load(saved.read_text()), config.to_dict()):
        records = read_metrics(run_dir)
        evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
        commit_file = run_dir / COMMIT_FILE
        return {
            "run_dir": str(run_dir),
            "code_commit": commit_file.read_text().strip() if commit_file.is_file() else None,
            "steps": config.trainer.steps,
            "seconds": sum(r.get("time/step_s", 0.0) + r.get("time/eval_s", 0.0) for r in records),
            "initial_accuracy": evals[0] if evals else None,
            "final_accuracy": evals[-1] if evals else None,
            "stopped": None,
            "reused": True,
            "config": config.to_dict(),
            "records": records,
        }
    # an interrupted run of this config continues from its checkpoint; a folder of another config is replaced
    same = saved.is_file() and _same(yaml.safe_load(saved.read_text()), config.to_dict())
    commit = code_commit()
    result = run(config, resume=run_dir) if same else run(config, run_dir=run_dir, overwrite=True)
    (Path(result.run_dir) / COMMIT_FILE).write_text(f"{commit}\n")
    return {
        "run_dir": str(result.run_dir),
        "code_commit": commit,
        "steps": result.steps,
        "seconds": result.seconds,
        "initial_accuracy": result.initial_accuracy,
        "final_accuracy": result.final_accuracy,
        "stopped": result.stopped,
        "reused": False,
        "config": config.to_dict(),
        "records": read_metrics(Path(result.run_dir)),
    }


def _same(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Every key of the saved config equals the current one (keys the trainer added since are ignored)."""
    for key, value in saved.items():
        if (
            isinstance(value, dict)
            and isinstance(current.get(key), dict)
            and key != "correction"
            and key != "proximal"
        ):
            if not _same(value, current[key]):
                return False
        elif current.get(key, value) != value or key not in current:
            return False
    return True


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
    groups: dict[str, list[list[dict[str, Any]]]],
    keys: Sequence[str],
    path: Path,
    title: str = "",
    x_scale: float = 1.0,
    x_label: str = "step",
) -> Path:
    """One panel per metric key; one line per group (mean over seeds, band = ± std); x = step × x_scale."""
    n = len(keys)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, keys):
        for i, (label, runs) in enumerate(groups.items()):  # one colour per group in every panel
            steps, mean, std = mean_curve(runs, key)
            if not steps:
                continue
            steps = [s * x_scale for s in steps]
            (line,) = ax.plot(steps, mean, label=label, lw=1.3, color=colors[i % len(colors)])
            lo = [m - s for m, s in zip(mean, std)]
            hi = [m + s for m, s in zip(mean, std)]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel(x_label)
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


def quick_overrides() -> list[str]:
    """Tiny runs for ``--quick``: 2 steps, 2 prompts × 2 responses, 8 eval prompts."""
    return [
        "trainer.steps=2",
        "trainer.eval_every=0",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "task.eval_prompts=8",
    ]


def grid_points(grid: dict[str, list[Any]]) -> list[list[str]]:
    """Every combination of the grid as a list of ``key=value`` overrides."""
    points: list[list[str]] = [[]]
    for key, values in grid.items():
        points = [p + [f"{key}={v}"] for p in points for v in values]
    return points


def run_arms(
    arms: dict[str, list[str]],
    base: list[str],
    out: Path,
    *,
    seeds: Sequence[int] = SEEDS,
    grid: dict[str, list[Any]] | None = None,
    quick: bool = False,
    keep: Sequence[str] = (),
    only: dict[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Train every arm × grid point × seed; returns {arm: {grid_label: {"runs": [...]}}}.

    Run folders go to ``runs/experiments/<out name>/<arm>_<grid values>_s<seed>`` (``out/runs/...`` when
    ``out`` is outside experiments/results). ``base`` overrides apply to every run, then the arm's, then the grid point's and the seed. Only the
    metric keys in ``keep`` (plus step) are stored per record, so results.json stays small. ``quick`` runs
    the first grid point with 1 seed and ``quick_overrides()``. ``only`` restricts an arm to the grid points
    whose overrides are all in ``only[arm]`` (e.g. ``{"int8/x": ["optim.lr=0.0002"]}``).
    """
    grid = GRID if grid is None else grid
    points = grid_points(grid)
    if quick:
        points, seeds = points[:1], list(seeds)[:1]
    only = only or {}
    out = Path(out).resolve()
    runs_root = RUNS / out.name if out.is_relative_to(RESULTS) else out / "runs"
    results: dict[str, Any] = {}
    for arm, overrides in arms.items():
        results[arm] = {}
        for point in points:
            if arm in only and not set(point) <= set(only[arm]):
                continue  # a diagnostic arm that runs at some grid points only
            label = " ".join(point) or "default"
            runs = []
            for seed in seeds:
                tag = "_".join([arm.replace("/", "-"), *(p.split("=")[1] for p in point), f"s{seed}"])
                log(f"  {arm} [{label}] seed {seed}")
                extra = quick_overrides() if quick else []
                record = train([*base, *overrides, *point, *extra, f"trainer.seed={seed}"], runs_root / tag)
                record["seed"] = seed
                record["records"] = [{k: r[k] for k in ("step", *keep) if k in r} for r in record["records"]]
                runs.append(record)
            results[arm][label] = {"overrides": [*base, *overrides, *point], "runs": runs}
    return results


def run_study_arms(
    args, arms: dict[str, list[str]], base: list[str], out: Path, keep: Sequence[str], only=None
) -> dict[str, Any]:
    """``run_arms`` as a study's command line asks (``study_arguments``): the ``--arms`` chosen, ``--seeds``,
    ``--quick`` and the ``--lr`` part of the grid; with ``--keep-other-arms`` the arms of the existing
    ``out/results.json`` that this invocation does not run are carried over (``carry_over``)."""
    results = run_arms({a: arms[a] for a in args.arms}, base, out, seeds=range(args.seeds), quick=args.quick,
                       grid=chosen_grid(args), keep=keep, only=only)
    if args.keep_other_arms is not None:
        results = carry_over(results, Path(out) / "results.json", args.keep_other_arms or None)
    return results


def carry_over(results: dict[str, Any], previous: Path, recorded_in: str | None = None) -> dict[str, Any]:
    """``results`` plus every arm of the results file ``previous`` that ``results`` lacks, records and all, so
    a study rerun in part keeps its other arms' figures. A carried run that predates the ``code_commit``
    field gets ``recorded_in_commit``: the commit that recorded it (the code it ran on is that or older)."""
    if not Path(previous).is_file():
        raise FileNotFoundError(f"--keep-other-arms: no previous results file {previous}")
    old = json.loads(Path(previous).read_text())["runs"]
    merged = {arm: cells for arm, cells in old.items() if arm not in results}
    for cells in merged.values():
        for cell in cells.values():
            for run in cell["runs"]:
                if run.get("code_commit") is None and "recorded_in_commit" not in run:
                    run["recorded_in_commit"] = recorded_in
    order = [*old, *(arm for arm in results if arm not in old)]  # the previous file's order, new arms last
    return {arm: results[arm] if arm in results else merged[arm] for arm in order}


def code_label(run: dict[str, Any]) -> str:
    """A run's code version for tables: its short ``code_commit`` (``+dirty`` kept), "recorded in <c>" for runs
    older than that field (``recorded_in_commit``), "–" when the results file records neither."""
    commit, recorded = run.get("code_commit"), run.get("recorded_in_commit")
    if commit:
        return commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")
    return f"recorded in {recorded[:7]}" if recorded else "–"


def code_commits(results: dict[str, Any]) -> dict[str, list[str | None]]:
    """{arm: the distinct commits its runs trained on} (``code_commit``, else ``recorded_in_commit``)."""
    out = {}
    for arm, cells in results.items():
        commits = [
            r.get("code_commit") or r.get("recorded_in_commit") for c in cells.values() for r in c["runs"]
        ]
        out[arm] = sorted(set(commits), key=str)
    return out


def run_mean(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """mean ± std over seeds (``summary``) of each run's mean of ``key`` over all its logged steps."""
    per_seed = []
    for run in runs:
        _, values = curve(run["records"], key)
        per_seed.append(sum(values) / len(values) if values else None)
    return summary(per_seed)


def summarize_arms(results: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """Per arm and grid point: mean ± std over seeds of each key's last logged value."""
    return {
        arm: {
            label: {key: summary([final_value(r["records"], key) for r in cell["runs"]]) for key in keys}
            for label, cell in cells.items()
        }
        for arm, cells in results.items()
    }


def curve_groups(results: dict[str, Any], label: str | None = None) -> dict[str, list[list[dict]]]:
    """{arm: [records per seed]} at grid point ``label`` (default: each arm's first)."""
    groups = {}
    for arm, cells in results.items():
        cell = cells[label] if label is not None and label in cells else next(iter(cells.values()))
        groups[arm] = [r["records"] for r in cell["runs"]]
    return groups


def study_arguments(description: str, arms: Sequence[str]):
    """The common command line of the training studies."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 seed, first grid point (smoke test)")
    parser.add_argument("--arms", nargs="+", choices=list(arms), default=list(arms), help="arms to run")
    parser.add_argument("--seeds", type=int, default=len(SEEDS))
    parser.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the study's)")
    parser.add_argument("--lr", type=float, nargs="+", default=None, choices=GRID["optim.lr"],
                        help="run only these learning rates of the shared grid")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-other-arms", nargs="?", const="", default=None, metavar="RECORDED_IN",
                        help="carry the arms of the existing results.json that this invocation does not run "
                             "into the new one; RECORDED_IN names the commit that recorded runs older than "
                             "the code_commit field")
    return parser


def chosen_grid(args) -> dict[str, list[Any]]:
    """The shared grid, restricted to ``--lr`` when given."""
    return GRID if args.lr is None else {**GRID, "optim.lr": list(args.lr)}
