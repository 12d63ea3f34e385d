"""Sharded checkpoints (``trainer.ranks=2``) as trustworthy as one process's: a shard that is missing or cut
short, with the checksum manifest gone too, is found from the shards' own index (``dcp/.metadata``) and the run
resumes from the newest intact checkpoint with a line, never a traceback from inside
``torch.distributed.checkpoint``. One real two-rank run (gloo, torch's launcher) makes the checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["trainer.data_parallel=shard", "rollout.prompts_per_step=4", "rollout.group_size=4", "task.eval_prompts=8", "trainer.progress=false",
         "trainer.plot=false", "trainer.tensorboard=false", "trainer.eval_every=0"]

pytestmark = pytest.mark.slow


def _train(*args: str) -> subprocess.CompletedProcess:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rollcorr", "train", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A finished two-rank run with sharded checkpoints at steps 1 and 2, kept pristine beside its path."""
    base = tmp_path_factory.mktemp("sharded")
    run_dir = base / "run"
    done = _train("trainer.ranks=2", "trainer.steps=2", "trainer.checkpoint_every=1", *SMALL, "--out", str(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    pristine = run_dir.rename(base / "pristine")
    return run_dir, pristine


@pytest.fixture
def run_copy(sharded):
    run_dir, pristine = sharded
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(pristine, run_dir, ignore=shutil.ignore_patterns(".lock"))
    return run_dir


def _newest(run_dir: Path) -> Path:
    newest = run_dir / "checkpoints" / "step_000002"
    (newest / "manifest.json").unlink()  # the byte-by-byte check gone: the shards' index is what is left
    return newest


def _shard(checkpoint: Path) -> Path:
    shards = sorted((checkpoint / "dcp").glob("*.distcp"))
    assert len(shards) == 2, shards  # one file per rank
    return shards[1]


def _resumed_from_step_1(run_dir: Path, result: subprocess.CompletedProcess, why: str) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "Traceback" not in out
    skipped = [line for line in out.splitlines() if "skipped checkpoint step_000002" in line]
    assert len(skipped) == 1 and why in skipped[0], out[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "reward/mean" in line]
    assert steps == [1, 2, 3]  # step 2 again from checkpoint 1 (its line replaced), then 3


@pytest.mark.timeout(900)
def test_missing_shard_without_manifest_falls_back_to_the_older_checkpoint(run_copy):
    _shard(_newest(run_copy)).unlink()
    _resumed_from_step_1(run_copy, _train("--resume", str(run_copy), "trainer.steps=3"), "missing")


@pytest.mark.timeout(900)
def test_cut_shard_without_manifest_falls_back_to_the_older_checkpoint(run_copy):
    shard = _shard(_newest(run_copy))
    os.truncate(shard, shard.stat().st_size // 2)
    _resumed_from_step_1(run_copy, _train("--resume", str(run_copy), "trainer.steps=3", "trainer.ranks=1"), "cut short")


@pytest.mark.timeout(900)
def test_every_checkpoint_damaged_is_one_line_that_says_what_is_wrong(run_copy):
    for step in (1, 2):
        checkpoint = run_copy / "checkpoints" / f"step_{step:06d}"
        (checkpoint / "manifest.json").unlink()
        (checkpoint / "dcp" / ".metadata").unlink()
    result = _train("--resume", str(run_copy), "trainer.steps=3")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("rollcorr train:")]
    assert len(errors) == 1 and ".metadata: missing" in errors[0], result.stderr[-3000:]


@pytest.mark.timeout(900)
def test_a_refused_resume_is_said_once_without_a_resume_hint(run_copy):
    """Rank 0 checks the run folder and every rank stops with its error: one line, not one per rank, and the
    launcher adds no "continue with --resume" (the run was never started)."""
    result = _train("--resume", str(run_copy), "trainer.steps=3", "optim.lr=0.1")
    assert result.returncode == 2
    said = [line for line in result.stderr.splitlines() if line.startswith("rollcorr train:")]
    assert len(said) == 1 and "optim.lr" in said[0], result.stderr[-3000:]
    assert "--resume" not in result.stderr.replace(said[0], "") and "Traceback" not in result.stderr
