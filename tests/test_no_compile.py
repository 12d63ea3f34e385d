"""No call compiles by default (#51): a default ``compute_correction`` at any size, ``rollcorr analyze``, the verl
drop-in and ``rollcorr train`` run without ``torch.compile``. Each runs in a fresh interpreter and reports what its
process imported and compiled: where nothing else pulls them in, neither ``torch._dynamo`` nor ``torch._inductor``
is imported at all; where a dependency imports them (transformers, which verl and the trainer load, imports
``torch._dynamo``), dynamo has converted no frame and Inductor's compiler (``torch._inductor.compile_fx``) was
never loaded. ``fused.warm`` compiles on request only (tests/test_correction_perf_fused.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPORT = """
import json, sys
def compiled():
    loaded = [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]
    frames = 0
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters
        frames = sum(counters["frames"].values())
    return {"loaded": loaded, "frames": frames, "compile_fx": "torch._inductor.compile_fx" in sys.modules}
"""


def _run(body: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ROLLCORR_FUSED"}
    script = REPORT + body + "\nprint('REPORT ' + json.dumps(compiled()))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def _compiled_nothing(report: dict) -> None:
    assert report["frames"] == 0 and not report["compile_fx"], report


def test_compute_correction_never_loads_the_compiler(tmp_path):
    """Large batches (above the fused kernel's ``MIN_POSITIONS``) and small ones, every preset of the speed
    table: neither torch._dynamo nor torch._inductor is imported."""
    report = _run("""
import torch
from rollcorr.config import preset
from rollcorr.correction import compute_correction, metrics_to_floats
g = torch.Generator().manual_seed(0)
for b, t in ((2, 8), (64, 8192)):
    rollout = -torch.rand(b, t, generator=g) - 1e-3
    old = (rollout + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-4)
    mask = torch.rand(b, t, generator=g) < 0.7
    for name in ("decoupled_token_is", "decoupled_seq_is_rs", "decoupled_geo_rs_token_tis"):
        for _ in range(3):
            metrics_to_floats(compute_correction(old, rollout, mask, preset(name), log_prob=old).metrics)
""", tmp_path)
    assert report["loaded"] == [], report


def test_analyze_never_loads_the_compiler(tmp_path):
    report = _run("""
from rollcorr.analyze.cli import sample_dump_path
from rollcorr.cli import main
try:
    main(["analyze", str(sample_dump_path()), "--preset", "decoupled_geo_rs_token_tis"])
except SystemExit as exit:
    assert not exit.code, exit.code
""", tmp_path)
    assert report["loaded"] == [], report


def test_the_verl_drop_in_compiles_nothing(tmp_path):
    pytest.importorskip("verl")
    report = _run("""
import torch
from rollcorr.compat.verl import compute_policy_loss_vanilla, compute_rollout_correction_and_rejection_mask
g = torch.Generator().manual_seed(0)
rollout = -torch.rand(64, 8192, generator=g) - 1e-3
old = (rollout + 0.05 * torch.randn(64, 8192, generator=g)).clamp(max=-1e-4)
mask = (torch.rand(64, 8192, generator=g) < 0.7).float()
for _ in range(3):
    w, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001")
""", tmp_path)
    _compiled_nothing(report)


def test_a_default_training_run_compiles_nothing(tmp_path):
    report = _run(f"""
from rollcorr.cli import main
try:
    main(["train", "trainer.steps=3", "trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false",
          "trainer.out={tmp_path / 'run'}"])
except SystemExit as exit:
    assert not exit.code, exit.code
""", tmp_path)
    _compiled_nothing(report)


def test_rollcorr_fused_1_warms_the_kernel_before_the_first_step(tmp_path, monkeypatch):
    """``ROLLCORR_FUSED=1``: the trainer compiles the fused kernel for its correction before its first step (never
    in a step); without it, nothing is warmed. ``fused.warm`` is replaced by a recorder here (compiling for real:
    tests/test_correction_perf_fused.py)."""
    from rollcorr.correction import fused
    from rollcorr.train import step
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    events = []
    attach = step.attach_correction
    monkeypatch.setattr(fused, "warm", lambda config, dtype: events.append(("warm", config, dtype)) or True)
    monkeypatch.setattr(step, "attach_correction", lambda *a, **kw: events.append(("step",)) or attach(*a, **kw))
    overrides = ["trainer.steps=2", "trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false",
                 "trainer.tensorboard=false", "trainer.checkpoint_every=0"]
    monkeypatch.delenv("ROLLCORR_FUSED", raising=False)
    run(load_config(None, [*overrides, f"trainer.out={tmp_path / 'plain'}"]))
    assert [e[0] for e in events] == ["step", "step"]
    events.clear()
    monkeypatch.setenv("ROLLCORR_FUSED", "1")
    config = load_config(None, [*overrides, f"trainer.out={tmp_path / 'fused'}"])
    run(config)
    assert [e[0] for e in events] == ["warm", "step", "step"]
    from rollcorr.train.build import build_step_config

    assert events[0][1] == build_step_config(config).correction and events[0][2] is torch.float32
