"""Mixed-precision learners: hf:amp-bf16 and hf:amp-fp16 (float32 master weights, autocast compute, fp16 with
dynamic loss scaling), in one process, resumed, at trainer.ranks=2, and as the audit's learner."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollcorr.cli import main
from rollcorr.engines import SamplingParams, make_learner, make_sampler, parse_spec
from rollcorr.train.amp import LossScaler
from rollcorr.train.config import load_config
from rollcorr.train.loop import Trainer, run

TINY = ["trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "rollout.prompts_per_step=4", "optim.skip_zero_grad=false"]


def test_amp_specs_are_learners_with_float32_weights():
    assert parse_spec("hf:amp-bf16").dtype == "amp-bf16" and str(parse_spec("hf:amp-fp16:sdpa")) == "hf:amp-fp16:sdpa"
    with pytest.raises(ValueError, match="hf:amp-bf16 is a learner .* as a sampler use hf:bf16"):
        make_sampler("hf:amp-bf16")
    rollout = make_sampler("hf:fp32").generate(["12+34=", "5+7="], SamplingParams(max_new_tokens=5, seed=0), n=2)
    fp32 = make_learner("hf:fp32").log_prob(rollout)
    for spec, dtype in (("hf:amp-bf16", torch.bfloat16), ("hf:amp-fp16", torch.float16)):
        learner = make_learner(spec)
        assert learner.autocast is dtype and all(p.dtype == torch.float32 for p in learner.model.parameters())
        log_prob = learner.log_prob(rollout, grad=True)
        gap = (log_prob - fp32)[rollout.response_mask].abs().max()
        # the low dtype's rounding shows (a float32 forward agrees to ~1e-6), and stays that size: bf16 keeps 8
        # significant bits, fp16 11 — each log-prob moves by a few units of its dtype's epsilon × its size
        eps = torch.finfo(dtype).eps
        assert 1e-5 < gap < 64 * eps * max(1.0, float(fp32.abs().max()))
        log_prob[rollout.response_mask].sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in learner.model.parameters() if p.grad is not None)


def test_the_loss_scaler_backs_off_on_overflow_and_grows_after_a_streak():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1024.0, 2048.0, float("inf")])
    assert not scaler.unscale([param])
    scaler.update(False)
    assert (scaler.scale, scaler.overflows, scaler.good_steps) == (512.0, 1, 0)
    for _ in range(3):
        param.grad = torch.tensor([512.0, 512.0, 512.0])
        assert scaler.unscale([param]) and torch.equal(param.grad, torch.ones(3))
        scaler.update(True)
    assert scaler.scale == 1024.0 and scaler.good_steps == 0
    restored = LossScaler()
    restored.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert restored == scaler
    assert LossScaler.for_learner("hf:amp-fp16") is not None and LossScaler.for_learner("hf:amp-bf16") is None


def test_a_forced_overflow_is_skipped_and_counted_and_the_scale_resumes(tmp_path, capsys):
    """A loss scale of 1e38 overflows fp16 at once: those optimizer steps are skipped (the weights do not move),
    counted in train/amp_overflow_skips and the alerts' summary, the scale halves each time; the run is not
    stopped as diverged, and a resumed run continues from the saved scale."""
    out = tmp_path / "run"
    config = load_config(None, [*TINY, "model.learner=hf:amp-fp16", "model.sampler=hf:fp16", "trainer.steps=2",
                                f"trainer.out={out}"])
    trainer = Trainer(config, run_dir=out)
    trainer.loss_scaler.scale = 1e38
    before = {k: v.clone() for k, v in trainer.learner.model.state_dict().items()}
    result = trainer.run()
    assert result.stopped is None and result.steps == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/amp_overflow_skips" in r]
    assert steps[0]["train/amp_overflow_skips"] == 2 and steps[0]["train/applied_updates"] == 0  # both mini-batches
    assert steps[0]["train/amp_loss_scale"] == 1e38 / 4
    assert [r["train/applied_updates"] for r in steps] == [0, 0]  # 1e38 / 2^4 still overflows: nothing applied
    after = trainer.learner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # a skipped step moves no weight
    assert "skipped an optimizer step for an fp16 gradient overflow" in capsys.readouterr().out
    saved = torch.load(out / "checkpoints" / "step_000002" / "state.pt", weights_only=False)["loss_scaler"]
    assert saved["scale"] == steps[-1]["train/amp_loss_scale"] and saved["overflows"] == 4
    resumed = Trainer(load_config(out / "config.yaml", ["trainer.steps=3"]), resume=out)
    assert resumed.loss_scaler.scale == saved["scale"] and resumed.loss_scaler.overflows == 4
    assert resumed.run().steps == 3


@pytest.mark.parametrize("learner, sampler", [("hf:amp-bf16", "hf:bf16"), ("hf:amp-fp16", "hf:fp16")])
def test_amp_learners_train_resume_and_run_at_two_ranks(tmp_path, learner, sampler):
    out = tmp_path / "run"
    first = run(load_config(None, [*TINY, f"model.learner={learner}", f"model.sampler={sampler}", "trainer.steps=2",
                                   f"trainer.out={out}"]), run_dir=out)
    assert first.steps == 2 and first.stopped is None
    assert run(load_config(out / "config.yaml", ["trainer.steps=3"]), resume=out).steps == 3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss/policy"] == r["loss/policy"] for r in records if "loss/policy" in r)  # finite (None: not)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "rollcorr", "train", "trainer.ranks=2", f"model.learner={learner}",
                           f"model.sampler={sampler}", "trainer.steps=2", *TINY, f"trainer.out={tmp_path / 'ranks2'}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    two = [json.loads(line) for line in (tmp_path / "ranks2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["learner/ranks"] for r in two if "learner/ranks" in r] == [2.0, 2.0]


def test_the_audit_scores_with_an_amp_learner(tmp_path):
    out = tmp_path / "audit"
    assert main(["audit", "--sampler", "hf:bf16", "--learner", "hf:amp-bf16", "-n", "8", "--max-new-tokens", "6",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"]["learner"] == "hf:amp-bf16" and summary["n_tokens"] > 0
