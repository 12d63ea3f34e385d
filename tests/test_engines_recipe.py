"""The engine recipe of docs/engines.md, followed from outside the package: its jitter backend (one file,
written to a folder rollcorr is not in) registers itself when imported, and then preflight refuses what the
backend refuses in one line, ``rollcorr train`` trains with it (2 steps; the sampler in this process and in a
sampler process) and ``rollcorr audit`` audits it (a small audit, with the in-process ``--whatif batch``).

Real engines throughout: the built-in model, the jitter sampler (hf's decode loop on noised float32 weights)
and the hf float32 learner. The noise is the measured mismatch: jitter:0 is the float32 hf sampler, whose
log-probs differ from the learner's in the last bits only (|Δ log p| ≲ 1e-6, so k3 ≈ ½Δ² ≲ 1e-12), while
N(0, 0.02²) on every weight moves them by far more (k3 ≈ 0.2 on the built-in model).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rollcorr.cli import main
from rollcorr.engines import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "engines.md"
SMALL_TRAIN = ["trainer.steps=2", "trainer.eval_every=0", "task.eval_prompts=0", "rollout.prompts_per_step=4",
               "rollout.group_size=4", "rollout.max_new_tokens=6", "trainer.progress=false", "trainer.plot=false",
               "trainer.tensorboard=false", "trainer.checkpoint_every=0"]
SMALL_AUDIT = ["-n", "16", "--max-new-tokens", "8"]
FLOAT32_K3 = 1e-9  # an fp32 pair: rounding only (≲ 1e-12), with room
NOISE_K3 = 1e-2  # jitter:0.02 on the built-in model: ≈ 0.2


def doc_block(first_line_start: str) -> str:
    """The fenced block of docs/engines.md whose first line starts with ``first_line_start``."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)
    (body,) = [b for b in blocks if b.startswith(first_line_start)]
    return body


def doc_commands() -> dict[str, list[str]]:
    """The recipe's command lines, by sub-command: ["rollcorr", "train", "plugins=jitter_engine", ...]."""
    lines = [shlex.split(line) for line in doc_block("rollcorr train plugins=").splitlines() if line.strip()]
    return {argv[1]: argv for argv in lines}


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """The recipe's file in a folder of its own, imported from there (which registers "jitter")."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "jitter_engine.py").write_text(doc_block("# jitter_engine.py"), encoding="utf-8")
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module("jitter_engine")
        assert BACKENDS["jitter"].module == "jitter_engine" and not module.__file__.startswith(str(ROOT))
        yield folder
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("jitter_engine", None)
        BACKENDS.pop("jitter", None)


def run_doc_command(command: str, extra: list[str], folder: Path, cwd: Path) -> subprocess.CompletedProcess:
    """A command of the recipe as written (``rollcorr`` as ``python -m rollcorr``), plus ``extra`` arguments, in
    a fresh interpreter that finds the recipe's module on its path (and this checkout's rollcorr)."""
    argv = doc_commands()[command]
    path = os.pathsep.join([str(folder), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", *argv, *extra], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=900)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_preflight_says_the_backends_own_refusal_in_one_line(outside, tmp_path, capsys):
    out = tmp_path / "out"
    refusal = "'jitter:0.5': jitter's option is a noise std in [0, 0.1], e.g. jitter:0.01"
    assert main(["train", "model.sampler=jitter:0.5", "--out", str(out)]) == 2
    assert one_line(capsys.readouterr().err) == f"rollcorr train: config error: model.sampler: {refusal}"
    assert main(["audit", "--sampler", "jitter:0.5", "--out", str(out)]) == 2
    assert one_line(capsys.readouterr().err) == f"rollcorr audit: error: --sampler: {refusal}"
    assert main(["audit", "--learner", "jitter", "--out", str(out)]) == 2  # the default hook: no learner
    assert one_line(capsys.readouterr().err) == (
        "rollcorr audit: error: --learner: learners exist for the hf backend only, got 'jitter'"
    )
    assert not out.exists()  # refused before any report or run folder


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rollcorr_train_samples_with_it(outside, tmp_path, mode):
    """The recipe's train command, 2 steps: in ``sync`` the sampler is built in this process, in ``async`` in a
    sampler process, which imports the backend's module (``Backend.module``) before building it."""
    run = tmp_path / "run"
    done = run_doc_command("train", [*SMALL_TRAIN, f"trainer.mode={mode}", f"trainer.out={run}"], outside, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert len(steps) == 2
    assert all(s["rollout_corr/k3_kl"] > NOISE_K3 for s in steps)  # the jitter sampler drew these tokens
    assert "sampler: jitter:0.02" in (run / "config.yaml").read_text()


def test_rollcorr_audit_audits_it(outside, tmp_path):
    """The recipe's audit command (jitter:0.02, --whatif batch: the backend says its sampler is in this process)
    against jitter:0, the float32 hf sampler: the noise is what the audit measures."""
    done = run_doc_command("audit", [*SMALL_AUDIT, "--out", str(tmp_path / "noised")], outside, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    noised = json.loads((tmp_path / "noised" / "summary.json").read_text())
    assert noised["source"]["sampler"] == "jitter:0.02" and noised["source"]["learner"] == "hf:fp32"
    (batch,) = noised["whatif"]
    assert batch["change"] == "batch" and batch["sampler"] == "jitter:0.02"
    assert main(["audit", "--sampler", "jitter:0", *SMALL_AUDIT, "--out", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert plain["divergence"]["k3_kl"] < FLOAT32_K3 < NOISE_K3 < noised["divergence"]["k3_kl"]
