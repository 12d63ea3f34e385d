"""Warnings that speak (train/alerts.py, compute_correction, analyze), checked on constructed situations:
a correction window that excludes ratio 1 rejects every token on any CPU; a sampler log-prob shifted by 3 nats
on the first 3/4 of the rows puts their geometric-mean ratio at e³, far outside a [0.5, 2] band that the
bf16-level mismatch of the other rows never leaves; a task whose answer is longer than the response cap gives
every response reward 0, so every advantage and the gradient are exactly 0.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import rollcorr.correction
from rollcorr.analyze.cli import main as analyze_main
from rollcorr.config.presets import preset
from rollcorr.correction import AllRejectedWarning, compute_correction
from rollcorr.train import alerts
from rollcorr.train.alerts import RunAlerts, step_conditions
from rollcorr.train.config import load_config
from rollcorr.train.loop import run

TINY = ["task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.checkpoint_every=0"]
REJECT_ALL = "algorithm.correction={preset: decoupled_geo_rs, rs: [token_k1], rs_thresholds: [[1.5, 2.0]]}"
GEO_WIDE = "algorithm.correction={preset: decoupled_geo_rs, rs_thresholds: ['0.5_2.0']}"


def train(tmp_path, model_dir, *overrides):
    config = load_config(
        None, [*TINY, f"model.path={model_dir}", f"trainer.out={tmp_path / 'run'}", *overrides]
    )
    result = run(config)
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    return result, [r for r in map(json.loads, lines) if "train/applied_updates" in r]


def warning_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning: step")]


def step_metrics(
    tokens=100, kept_tokens=100, seqs=16, kept_seqs=16, applied=2, zero_skips=0, zero=0, adv=0.5
):
    return {"rollout_corr/num_tokens": tokens, "rollout_corr/num_kept_tokens": kept_tokens,
            "rollout_corr/num_valid_seqs": seqs, "rollout_corr/num_kept_seqs": kept_seqs,
            "train/applied_updates": applied, "train/zero_grad_skips": zero_skips,
            "train/zero_grad_minibatches": zero, "advantage/abs_mean": adv}


# ---------------------------------------------------------------- the rules, on given metrics


def test_conditions_are_strictly_more_than_half_and_all():
    assert not any(step_conditions(step_metrics()).values())
    half = step_conditions(step_metrics(kept_tokens=50, kept_seqs=8))
    assert not half["rejected_most_tokens"] and not half["rejected_most_sequences"]
    most = step_conditions(step_metrics(kept_tokens=49, kept_seqs=7))
    assert most["rejected_most_tokens"] and most["rejected_most_sequences"] and not most["rejected_all"]
    everything = step_conditions(step_metrics(kept_tokens=0, kept_seqs=0, applied=0, zero_skips=2, zero=2))
    assert all(everything[name] for name in ("rejected_all", "rejected_most_tokens", "rejected_most_sequences",
                                             "no_gradient"))
    # a gradient that is zero on one mini-batch of two is counted in train/zero_grad_minibatches only
    assert not step_conditions(step_metrics(applied=1, zero_skips=1, zero=1))["no_gradient"]
    assert step_conditions(step_metrics(applied=2, zero=2))["no_gradient"]  # optim.skip_zero_grad=false
    assert not any(step_conditions({}).values())  # a step without the counts (nothing to say)


def test_said_once_then_every_n_further_occurrences_with_counts_in_metrics():
    watch = RunAlerts(repeat_every=3)
    said = {}
    for step in range(1, 9):
        bad = step != 2  # steps 1, 3, 4, ..., 8 reject 10 of 16 sequences
        metrics = step_metrics(kept_seqs=6 if bad else 16)
        said[step] = watch.observe(step, metrics)
        assert metrics["alerts/rejected_most_sequences"] == float(bad)
        assert metrics["alerts/rejected_most_sequences_steps"] == watch.counts["rejected_most_sequences"]
    assert [s for s, m in said.items() if m] == [1, 5, 8]  # occurrences 1, 4 and 7
    assert said[1] == [
        "warning: step 1: the correction rejected 62 % of the sequences (10 of 16); the update rests on the "
        f"other 6; {alerts.ADVICE}. (first warning of this kind in this run; repeated every 3 such steps)"
    ]
    assert said[5][0].endswith("(still happening: 4 of 5 steps so far)")
    assert watch.summary() == "alerts: 7 of 8 steps rejected > 50 % of sequences"


def test_everything_rejected_is_said_once_per_step_and_summarised_per_condition():
    watch = RunAlerts()
    said = watch.observe(1, step_metrics(kept_tokens=0, kept_seqs=0, applied=0, zero_skips=2, zero=2, adv=0))
    assert len(said) == 1 and "rejected every token (100 tokens in 16 sequences)" in said[0]
    assert "no optimizer step was taken" in said[0]
    said = watch.observe(2, step_metrics(applied=0, zero_skips=2, zero=2, adv=0.0))
    assert (
        len(said) == 1
        and "gradient was exactly 0 (every kept group's responses got the same reward" in said[0]
    )
    assert watch.summary() == ("alerts: 1 of 2 steps rejected > 50 % of sequences; 1 step rejected > 50 % of "
                               "tokens; 1 step rejected every token; 2 steps had no gradient")
    assert RunAlerts().summary() is None


def test_a_resumed_run_keeps_its_counts():
    records = [{"step": 0, "eval/accuracy": 0.5}]
    watch = RunAlerts()
    for step in (1, 2, 3):
        metrics = step_metrics(kept_seqs=0 if step < 3 else 16, kept_tokens=10)
        watch.observe(step, metrics)
        records.append({"step": step, **metrics})
    again = RunAlerts.from_records(records)
    assert again.steps == 3 and again.counts == watch.counts and again.summary() == watch.summary()


# ---------------------------------------------------------------- the trainer says it


def test_trainer_warns_when_everything_is_rejected(tmp_path, addition_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(alerts, "REPEAT_EVERY", 2)
    result, steps = train(tmp_path, addition_model_dir, REJECT_ALL, "trainer.steps=3")
    out = capsys.readouterr().out
    said = warning_lines(out)
    assert [line.split(":")[1] for line in said] == [" step 1", " step 3"]  # occurrences 1 and 3
    assert "the correction rejected every token" in said[0] and "no optimizer step was taken" in said[0]
    assert said[0].endswith("(first warning of this kind in this run; repeated every 2 such steps)")
    assert said[1].endswith("(still happening: 3 of 3 steps so far)")
    for i, r in enumerate(steps, start=1):
        assert r["alerts/rejected_all"] == 1.0 and r["alerts/rejected_all_steps"] == i
        assert r["alerts/no_gradient"] == 1.0 and r["alerts/rejected_most_sequences"] == 1.0
    assert ("alerts: 3 of 3 steps rejected > 50 % of sequences; 3 steps rejected > 50 % of tokens; 3 steps "
            "rejected every token; 3 steps had no gradient") in out


def test_trainer_warns_when_most_sequences_are_rejected(tmp_path, addition_model_dir, capsys, monkeypatch):
    real = rollcorr.correction.compute_correction

    def skewed(old_log_prob, rollout_log_prob, *args, **kwargs):
        shifted = rollout_log_prob.clone()
        shifted[: len(shifted) * 3 // 4] -= 3.0  # log π_old − log μ = 3 + (bf16-level mismatch) on 12 rows
        return real(old_log_prob, shifted, *args, **kwargs)

    monkeypatch.setattr(rollcorr.correction, "compute_correction", skewed)
    _, steps = train(tmp_path, addition_model_dir, GEO_WIDE, "trainer.steps=2")
    out = capsys.readouterr().out
    said = warning_lines(out)
    assert said[0].startswith("warning: step 1: the correction rejected 75 % of the sequences (12 of 16); "
                              "the update rests on the other 4;")
    assert not any("step 2: the correction" in line for line in said)  # once, until it persists
    for r in steps:
        assert r["rollout_corr/num_kept_seqs"] == 4.0 and r["alerts/rejected_most_sequences"] == 1.0
        assert r["alerts/rejected_all"] == 0.0
        assert r["alerts/rejected_most_tokens"] == float(r["rollout_corr/rollout_rs_masked_fraction"] > 0.5)
    assert "alerts: 2 of 2 steps rejected > 50 % of sequences" in out


@pytest.mark.parametrize("skip", [True, False])
def test_trainer_warns_when_the_gradient_is_zero(tmp_path, addition_model_dir, capsys, skip):
    task = tmp_path / "unreachable.jsonl"  # answers longer than rollout.max_new_tokens: every reward is 0
    task.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": "12345678"}) + "\n" for i in range(10))
    )
    _, steps = train(tmp_path, addition_model_dir, f"task.name={task}", "trainer.steps=2",
                     f"optim.skip_zero_grad={str(skip).lower()}")
    out = capsys.readouterr().out
    said = warning_lines(out)
    assert len(said) == 1 and said[0].startswith(
        "warning: step 1: the gradient was exactly 0 (every kept group's responses got the same reward, so every "
        "advantage was 0);"
    )
    assert ("no optimizer step was taken" if skip else "Adam still moved the weights") in said[0]
    for r in steps:
        assert r["reward/mean"] == 0.0 and r["alerts/no_gradient"] == 1.0 and r["alerts/rejected_all"] == 0.0
        assert r["train/zero_grad_minibatches"] == 2.0
    assert "alerts: 2 of 2 steps had no gradient" in out


def test_a_healthy_run_says_nothing(tmp_path, addition_model_dir, capsys, alternating_rewards):
    """Rewards 1, 0, 1, 0, … in every group (whatever was sampled) and no rejection: nothing to say."""
    _, steps = train(tmp_path, addition_model_dir, "trainer.steps=2")
    out = capsys.readouterr().out
    assert "warning" not in out and "alerts:" not in out
    assert all(r[f"alerts/{name}"] == 0.0 for r in steps for name in alerts.CONDITIONS)


# ---------------------------------------------------------------- the library and analyze say it


def test_compute_correction_warns_when_everything_is_rejected():
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 6, generator=g) - 0.1
    old = rollout + 0.01 * torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 3:] = False
    reject_all = preset("decoupled_geo_rs", rs_threshold="100_200")  # ρ ≈ 1 is never in [100, 200]
    with pytest.warns(
        AllRejectedWarning, match=r"rejected every token of this batch \(21 tokens in 4 sequences\)"
    ):
        res = compute_correction(old, rollout, mask, reject_all)
    assert not res.kept_mask.any() and float(res.metrics["rollout_corr/all_rejected"]) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute_correction(old, rollout, mask, reject_all, warn=False)  # asked not to
        compute_correction(old, rollout, mask, preset("decoupled_geo_rs", rs_threshold="0.5_2.0"))  # keeps


def test_analyze_warns_when_everything_is_rejected(tmp_path, capsys):
    cfg = tmp_path / "reject_all.yaml"
    cfg.write_text("preset: decoupled_geo_rs\nrs: [token_k1]\nrs_thresholds: [[1.5, 2.0]]\n")
    assert analyze_main(["--config", str(cfg)]) == 0  # a warning, not an error
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "warning: the correction rejects every token of this dump" in out
    assert "That is everything: a training step on this data would have no gradient." in out
    assert analyze_main([]) == 0
    assert "warning: the correction rejects every token" not in capsys.readouterr().out


# ---------------------------------------------------------------- the learning-rate rules


def test_an_accuracy_drop_of_a_quarter_between_evaluations_warns_once_with_the_lr():
    from rollcorr.train.alerts import ACCURACY_DROP, RunAlerts

    alerts = RunAlerts()
    alerts.seen_evaluation({"eval/accuracy": 0.875})  # step 0's evaluation
    quiet = {**step_metrics(), "eval/accuracy": 0.875 - ACCURACY_DROP + 0.01, "train/lr": 3e-4}
    assert alerts.observe(1, quiet) == [] and quiet["alerts/accuracy_drop"] == 0.0
    fell = {**step_metrics(), "eval/accuracy": 0.25, "train/lr": 3e-4}
    (said,) = alerts.observe(2, fell)
    assert "greedy accuracy fell from 0.635 to 0.250" in said and "optim.lr=0.0003" in said
    assert fell["alerts/accuracy_drop"] == 1.0
    assert alerts.observe(3, step_metrics()) == []  # a step without an evaluation compares nothing
    # a resumed run knows its last evaluation from metrics.jsonl
    resumed = RunAlerts.from_records([{"step": 0, "eval/accuracy": 0.9}, {"step": 1, **step_metrics()}])
    assert resumed.last_accuracy == 0.9


def test_the_accuracy_rule_in_numbers():
    from rollcorr.train.alerts import accuracy_dropped

    assert accuracy_dropped(0.875, 0.25) and accuracy_dropped(0.175, 0.05)  # the two SmolLM2 runs
    assert not accuracy_dropped(0.5, 0.3)  # 0.2, to more than half
    assert not accuracy_dropped(0.12, 0.04)  # to a third, but by less than 0.1 (a few prompts of a small set)
    assert not accuracy_dropped(0.4, 0.7)
    # the share must also be answers: 0.25 → 0.0 on 4 prompts is one answer, on 40 prompts ten
    assert not accuracy_dropped(0.25, 0.0, prompts=4) and accuracy_dropped(0.25, 0.0, prompts=40)
    assert accuracy_dropped(0.875, 0.25, prompts=8)  # five of eight answers lost


def test_the_lr_rule_speaks_for_large_models_only():
    from rollcorr.train.alerts import lr_warning

    assert lr_warning(1_000_000, 3e-4) is None  # the built-in model: its default
    assert lr_warning(135_000_000, 1e-5) is None
    said = lr_warning(135_000_000, 3e-4)
    assert said.startswith("warning: optim.lr=0.0003 is far above") and "135 M parameters" in said


def test_the_lr_rule_counts_the_weights_that_train():
    """LoRA on a 135 M model trains ~0.9 M adapter weights, whose usual learning rate is ~10x full fine-tuning's:
    2e-4 is in range there (it was said to be "far above" for 135 M parameters), 3e-3 is not."""
    from rollcorr.train.alerts import lr_warning

    assert lr_warning(135_000_000, 2e-4, trainable=920_000) is None
    said = lr_warning(135_000_000, 3e-3, trainable=920_000)
    assert said.startswith("warning: optim.lr=0.003 is far above the usual range for LoRA adapters (0.9 M trainable")
    assert lr_warning(135_000_000, 2e-4, trainable=135_000_000) is not None  # every weight trains: the full rule


@pytest.mark.parametrize("lora", [False, True])
def test_the_trainer_hands_the_lr_rule_the_weights_that_train(tmp_path, addition_model_dir, capsys, monkeypatch, lora):
    """The rule at the start of a run counts the learner's trainable parameters: with the threshold lowered to the
    built-in model's size, lr 2e-4 is "far above" for the full learner and in range for its LoRA adapters."""
    monkeypatch.setattr(alerts, "LARGE_MODEL", 1)
    extra = ["model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"] if lora else []
    train(tmp_path, addition_model_dir, "trainer.steps=1", "optim.lr=2e-4", *extra)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: optim.lr=")]
    if lora:
        assert said == []
    else:
        assert len(said) == 1 and "far above the usual range for a model of" in said[0]
