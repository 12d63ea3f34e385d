"""The end-of-run PNG: reward, greedy accuracy, staleness, and the sampler/learner mismatch over steps.

A run's ``curves.png`` is drawn off the run's critical path (matplotlib's import and ``savefig`` take seconds):
``start_plot`` starts ``python -m rollcorr.train.plots RUN_DIR`` as a detached process (its own session, no
terminal, so neither the run's exit nor a Ctrl-C at the terminal stops it), which writes the PNG atomically a
moment after the run ends; ``wait_for_plot`` waits for it. A failure leaves ``curves.png.error`` (one line).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rollcorr.plotting import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAME = "curves.png"
ERROR = "curves.png.error"  # one line, written by the plotting process when it fails

PANELS = (
    ("reward", ("reward/mean",)),
    ("greedy accuracy (held out)", ("eval/accuracy",)),
    ("version lag (tokens)", ("staleness/lag_mean", "staleness/lag_max")),
    ("mismatch", ("rollout_corr/kl", "rollout_corr/log_ppl_abs_diff")),
    (
        "discrepancy / drift (|log| mean)",
        ("factors/discrepancy_log_abs_mean", "factors/drift_log_abs_mean"),
    ),
    (
        "rejected / truncated fraction",
        ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_ratio_fraction_high"),
    ),
)


def plot_run(records: list[dict], path: Path) -> Path:
    """Write the curves of ``records`` (metrics.jsonl rows) to ``path`` (temp file then rename)."""
    return save_figure(plot_figure(records), path)


def plot_figure(records: list[dict]) -> Figure:
    """The figure of ``records``' curves (metrics.jsonl rows): six panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout()
    return fig


def write_curves(run_dir: Path) -> Path:
    """Draw ``run_dir``'s metrics.jsonl into ``run_dir/curves.png``. The PNG is rendered in memory and only then
    written (temp file, rename), so the run folder is touched for an instant: a folder removed meanwhile is not
    re-created, and a reader never sees a half-written PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollcorr.train.logging import read_metrics

    run_dir = Path(run_dir)
    buffer = io.BytesIO()
    fig = plot_figure(read_metrics(run_dir))
    try:
        fig.savefig(buffer, dpi=110, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{Path(NAME).stem}.", suffix=".png")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getvalue())
        os.chmod(tmp, 0o644)
        os.replace(tmp, run_dir / NAME)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return run_dir / NAME


def start_plot(run_dir: Path) -> subprocess.Popen | None:
    """Start the detached process that writes ``run_dir/curves.png``; None when it cannot start (then the PNG is
    drawn here, as before: the run's end waits for it)."""
    import rollcorr

    root = str(Path(rollcorr.__file__).resolve().parents[1])  # the child imports this very rollcorr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    (Path(run_dir) / ERROR).unlink(missing_ok=True)
    try:
        return subprocess.Popen([sys.executable, "-m", "rollcorr.train.plots", str(run_dir)], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    except OSError:  # no process to be had (out of file descriptors or processes): draw it in this one
        write_curves(Path(run_dir))
        return None


def wait_for_plot(run_dir: Path, process: subprocess.Popen | None = None, timeout_s: float = 300.0) -> Path:
    """``run_dir/curves.png`` once the plotting process has written it (``process``: its handle, when this process
    started it). Raises RuntimeError with the plotter's error line, or TimeoutError after ``timeout_s``."""
    path, error = Path(run_dir) / NAME, Path(run_dir) / ERROR
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if error.exists():
            raise RuntimeError(f"{path} was not written: {error.read_text().strip()}")
        if process is not None and process.poll() is not None:
            if process.returncode != 0 or not path.exists():
                raise RuntimeError(f"{path} was not written: the plotting process exited with {process.returncode}")
            return path
        if process is None and path.exists():
            return path
        time.sleep(0.05)
    raise TimeoutError(f"{path} was not written within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    """``python -m rollcorr.train.plots RUN_DIR``: write RUN_DIR/curves.png (exit 1 and ``curves.png.error`` on
    a failure; exit 1 and nothing written when RUN_DIR is gone)."""
    parser = argparse.ArgumentParser(prog="python -m rollcorr.train.plots", description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    run_dir = parser.parse_args(argv).run_dir
    if not run_dir.is_dir():
        print(f"{run_dir}: no such run folder", file=sys.stderr)
        return 1
    try:
        write_curves(run_dir)
    except Exception as err:  # noqa: BLE001 — said in one line, beside where the PNG would be
        line = f"{type(err).__name__}: {err}".splitlines()[0][:500]
        print(line, file=sys.stderr)
        if run_dir.is_dir():
            (run_dir / ERROR).write_text(line + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
