"""curves.png is drawn by a detached process after the run (``rollcorr.train.plots``): the run's end does not
wait for matplotlib, the PNG appears whole or not at all, and the process outlives the one that started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollcorr.train.plots import ERROR, NAME, start_plot, wait_for_plot

PNG = b"\x89PNG\r\n\x1a\n"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def metrics_folder(folder: Path, steps: int = 5) -> Path:
    """A run folder with a metrics.jsonl of ``steps`` steps."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "reward/mean": s / steps, "rollout_corr/kl": 1e-3 / s, "staleness/lag_mean": 0.0}
            for s in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_detached_process_writes_the_png_whole(tmp_path):
    run_dir = metrics_folder(tmp_path / "run")
    process = start_plot(run_dir)
    assert process is not None
    assert os.getsid(process.pid) == process.pid != os.getsid(0)  # its own session: a Ctrl-C here does not reach it
    path = wait_for_plot(run_dir, process, timeout_s=300)
    assert path == run_dir / NAME and path.read_bytes().startswith(PNG) and path.stat().st_size > 10_000
    assert sorted(p.name for p in run_dir.iterdir()) == ["curves.png", "metrics.jsonl"]  # no temp file left


def test_it_outlives_the_process_that_started_it(tmp_path):
    """The run's process exits right after starting the plotter: the PNG is still written."""
    run_dir = metrics_folder(tmp_path / "run")
    script = "import sys; from rollcorr.train.plots import start_plot; print(start_plot(sys.argv[1]).pid)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script, str(run_dir)], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip().isdigit() and done.stderr == ""
    path = wait_for_plot(run_dir, timeout_s=300)  # generous: only a failure to write takes this long
    assert path.read_bytes().startswith(PNG)


def test_a_failure_is_one_line_beside_the_png(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{not json\n")
    process = start_plot(run_dir)
    with pytest.raises(RuntimeError, match="curves.png was not written: JSONDecodeError"):
        wait_for_plot(run_dir, process, timeout_s=300)
    assert process.wait(timeout=120) == 1 and not (run_dir / NAME).exists()
    assert len((run_dir / ERROR).read_text().splitlines()) == 1


def test_a_run_folder_removed_meanwhile_is_not_recreated(tmp_path):
    from rollcorr.train.plots import main

    gone = tmp_path / "gone"
    assert main([str(gone)]) == 1
    assert not gone.exists()
