"""rollcorr train end to end: every mode, the staleness bound, resume, NaN steps, OAPL.

The runs use a small model fine-tuned here in a few seconds on 1-digit addition (a real Qwen2 with the
built-in tokenizer), so the tests do not depend on the shipped checkpoint. Its training batches are rewarded
1, 0, 1, 0, … by row (the ``alternating_rewards`` fixture), so every group's advantages — hence every gradient —
are non-zero whatever tokens this CPU samples.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from rollcorr.checkpoint import latest_checkpoint, load_checkpoint
from rollcorr.engines import SamplingParams, make_sampler
from rollcorr.tasks import make_task
from rollcorr.train.config import load_config
from rollcorr.train.loop import Trainer, run
from rollcorr.train.source import RolloutSource, finished

pytestmark = pytest.mark.usefixtures("alternating_rewards")

TINY = [
    "task.name=addition:1",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "task.eval_prompts=16",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.tensorboard=false",
    "optim.lr=1e-3",
    "trainer.mini_batches=1",
]


def tiny_config(tmp_path, addition_model_dir, *overrides, name="run"):
    return load_config(
        None, [*TINY, f"model.path={addition_model_dir}", f"trainer.out={tmp_path / name}", *overrides]
    )


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir):
    return [r for r in records(run_dir) if "reward/mean" in r]


def final_weights(run_dir):
    return load_checkpoint(latest_checkpoint(run_dir))["model"]


def test_sync_run_writes_run_folder_and_learns_something(tmp_path, addition_model_dir):
    config = tiny_config(
        tmp_path, addition_model_dir, "trainer.steps=3", "trainer.tensorboard=true", "trainer.plot=true"
    )
    result = run(config)
    out = result.run_dir
    assert result.steps == 3 and result.stopped is None
    assert (out / "config.yaml").is_file() and result.wait_for_plot().stat().st_size > 10_000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (latest_checkpoint(out) / "model" / "model.safetensors").is_file()
    steps = step_records(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    # TensorBoard holds every finite scalar of every step, as metrics.jsonl has it (float32 in the event file)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    for key in ("reward/mean", "loss/policy", "rollout_corr/kl", "time/step_s"):
        logged = {e.step: e.value for e in board.Scalars(key)}
        assert logged == {r["step"]: float(torch.tensor(r[key], dtype=torch.float32)) for r in steps}, key
    finite = {k for r in steps for k, v in r.items() if k != "step" and v is not None and math.isfinite(v)}
    assert finite <= set(board.Tags()["scalars"])
    for r in steps:
        assert r["staleness/lag_max"] == 0.0  # synchronous: every token from the current version
        assert r["proximal/exact_token_fraction"] == 1.0
        assert r["factors/drift_log_abs_mean"] == 0.0
        assert math.isfinite(r["rollout_corr/kl"]) and "rollout_corr/rollout_is_mean" in r
        assert r["train/applied_updates"] == 1.0
        # the policy entropy over response tokens: 0 < H < log V (the built-in vocabulary has 101 tokens)
        assert 0.0 < r["actor/entropy"] < math.log(128)
    assert result.initial_accuracy is not None and result.final_accuracy is not None
    # the weights moved
    start = make_sampler("hf:fp32", addition_model_dir).float_model.state_dict()
    end = final_weights(out)
    assert any(not torch.equal(start[k].float(), end[k]) for k in end)


def test_simulated_async_holds_a_fixed_lag(tmp_path, addition_model_dir):
    config = tiny_config(tmp_path, addition_model_dir, "trainer.mode=simulated_async", "trainer.lag=2", "trainer.steps=5",
                         "algorithm.proximal.name=snapshot")
    run(config)
    steps = step_records(tmp_path / "run")
    assert [r["sampler/version"] for r in steps] == [0, 0, 0, 1, 2]
    assert [r["staleness/lag_max"] for r in steps] == [0, 1, 2, 2, 2]
    # the snapshot strategy gives exact old logits, so the two factors are reported separately
    assert all("factors/discrepancy_log_abs_mean" in r for r in steps)
    assert steps[-1]["factors/drift_log_abs_mean"] > 0


def test_simulated_async_resume_is_bit_identical(tmp_path, addition_model_dir):
    """A run killed after step 3 and resumed from its step-2 checkpoint ends exactly like an uninterrupted one."""
    full = run(tiny_config(tmp_path, addition_model_dir, "trainer.mode=simulated_async", "trainer.lag=1",
                           "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3",
                           "task.eval_prompts=4", name="full"))
    killed = tmp_path / "killed"
    shutil.copytree(full.run_dir, killed)
    shutil.rmtree(killed / "checkpoints" / "step_000004")  # what survives a kill during step 4
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    (killed / "metrics.jsonl").write_text("\n".join(lines[:4]) + '\n{"step": 4, "tor')  # steps 0-3, torn line
    resumed = run(load_config(killed / "config.yaml"), resume=killed)
    assert resumed.steps == 4
    a, b = final_weights(full.run_dir), final_weights(killed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra, rb = step_records(full.run_dir), step_records(killed)
    assert [r["step"] for r in rb] == [1, 2, 3, 4]  # metrics after the checkpoint were replaced, not doubled
    for x, y in zip(ra, rb):
        assert x["reward/mean"] == y["reward/mean"] and x["loss/policy"] == y["loss/policy"]
    assert any(r["loss/grad_norm"] > 0 for r in ra)  # the weights really moved between checkpoints


@pytest.mark.parametrize("partial", [False, True])
def test_async_never_trains_above_max_staleness(tmp_path, addition_model_dir, partial):
    config = tiny_config(tmp_path, addition_model_dir, "trainer.mode=async", "trainer.max_staleness=1", "trainer.queue_size=4",
                         "trainer.steps=8", f"trainer.partial_rollouts={str(partial).lower()}",
                         "trainer.partial_chunk_tokens=1", "trainer.eval_every=0")
    result = run(config)
    steps = step_records(result.run_dir)
    assert len(steps) == 8
    assert max(r["staleness/lag_max"] for r in steps) <= 1
    assert steps[-1]["async/dropped_total"] == 0  # admission control, not drop-after-generation


def test_partial_rollout_resumes_with_new_weights_and_keeps_token_versions(addition_model_dir):
    sampler = make_sampler("hf:bf16", addition_model_dir)
    task = make_task("addition:2")
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    source = RolloutSource(sampler, task, sampler.tokenizer, params, prompts_per_step=3, group_size=2, seed=0)
    part = source.sample(0, max_steps=1)  # one token each, then a weight update
    assert not finished(part) and part.rewards is None
    new = {k: v.float() * 1.01 for k, v in sampler.float_model.state_dict().items()}
    source.load_weights(new, 1)
    done = source.sample(0, part)
    assert finished(done) and done.rewards is not None
    mask = done.response_mask.bool()
    assert torch.equal(done.response_ids[:, :1], part.response_ids[:, :1])  # the prefix is kept
    assert bool((done.version[:, 0] == 0).all())  # first token: version 0
    later = done.version[:, 1:][mask[:, 1:]]
    assert later.numel() > 0 and bool((later == 1).all())  # the rest: the new weights
    assert done.rollout_log_prob is not None and torch.isfinite(done.rollout_log_prob[mask]).all()


def test_nan_gradient_step_is_skipped_then_run_stops_with_checkpoint(tmp_path, addition_model_dir):
    config = tiny_config(
        tmp_path, addition_model_dir, "trainer.steps=6", "trainer.max_bad_steps=2", "task.eval_prompts=4"
    )
    trainer = Trainer(config)
    before = {k: v.clone() for k, v in trainer.learner.model.state_dict().items()}
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * float("nan")

    param = next(trainer.learner.model.parameters())
    handle = param.register_hook(poison)
    result = trainer.run()
    handle.remove()
    assert calls["n"] >= 2
    assert result.stopped is not None and "2 consecutive steps" in result.stopped
    assert result.steps == 2
    steps = step_records(result.run_dir)
    assert [r["train/skipped_updates"] for r in steps] == [1.0, 1.0]
    saved = final_weights(result.run_dir)
    assert saved and set(saved) <= set(before)  # model/'s weights: a tied lm-head once, under its embedding's name
    for k, v in saved.items():  # the checkpoint holds the weights from before the bad steps
        assert torch.equal(before[k], v), k


def test_single_nan_step_is_skipped_and_training_continues(tmp_path, addition_model_dir):
    config = tiny_config(tmp_path, addition_model_dir, "trainer.steps=3", "task.eval_prompts=4")
    trainer = Trainer(config)
    state = {"first": True}

    def poison_once(grad):
        if state["first"]:
            state["first"] = False
            return grad * float("inf")
        return grad

    next(trainer.learner.model.parameters()).register_hook(poison_once)
    result = trainer.run()
    assert result.stopped is None and result.steps == 3
    steps = step_records(result.run_dir)
    assert [r["train/skipped_updates"] for r in steps] == [1.0, 0.0, 0.0]
    assert [r["train/bad_steps_in_row"] for r in steps] == [1.0, 0.0, 0.0]


def test_oapl_syncs_the_sampler_every_n_steps(tmp_path, addition_model_dir):
    config = tiny_config(tmp_path, addition_model_dir, "algorithm.name=oapl", "algorithm.oapl_sync_every=3", "trainer.max_staleness=2",
                         "trainer.steps=6", "task.eval_prompts=4", "algorithm.correction.preset=disabled")
    run(config)
    steps = step_records(tmp_path / "run")
    assert [r["sampler/version"] for r in steps] == [0, 0, 0, 3, 3, 3]
    assert [r["staleness/lag_max"] for r in steps] == [0, 1, 2, 0, 1, 2]
    assert all("actor/oapl_value_mean" in r for r in steps)


@pytest.mark.parametrize("name", ["dapo", "drgrpo", "rloo", "cispo", "gspo"])
def test_every_algorithm_runs_two_steps(tmp_path, addition_model_dir, name):
    config = tiny_config(tmp_path, addition_model_dir, f"algorithm.name={name}", "trainer.steps=2", "task.eval_prompts=0",
                         "trainer.mini_batches=2", "trainer.micro_batch_size=3")
    result = run(config)
    steps = step_records(result.run_dir)
    assert len(steps) == 2 and all(math.isfinite(r["loss/policy"]) for r in steps)


def test_admission_counts_dropped_batches_against_the_trained_version():
    """Batch i is trained at version i − dropped: a drop makes later batches *older*-tolerant, not fresher."""
    from rollcorr.train.versions import admissible, trained_version

    assert trained_version(5, dropped=2) == 3
    assert admissible(5, dropped=2, sampler_version=1, max_staleness=2)  # trained at 3, lag 2
    assert not admissible(5, dropped=2, sampler_version=0, max_staleness=2)  # lag 3
    assert not admissible(5, dropped=0, sampler_version=2, max_staleness=2)  # trained at 5, lag 3


@pytest.mark.parametrize("skip", [True, False])
def test_zero_gradient_mini_batches_take_no_optimizer_step_when_asked(tmp_path, addition_model_dir, skip):
    """A K1 window that excludes ratio 1 rejects every token: the gradient is exactly 0 on every mini-batch.
    With optim.skip_zero_grad the optimizer never steps (weights bit-identical, not counted as bad steps)."""
    reject_all = (
        "algorithm.correction={preset: decoupled_geo_rs, rs: [token_k1], rs_thresholds: [[1.5, 2.0]]}"
    )
    config = tiny_config(tmp_path, addition_model_dir, "trainer.steps=2", "trainer.mini_batches=2", reject_all,
                         f"optim.skip_zero_grad={skip}")
    result = run(config)
    assert result.stopped is None
    for r in step_records(result.run_dir):
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 1.0
        assert r["train/zero_grad_skips"] == (2.0 if skip else 0.0)
        assert r["train/applied_updates"] == (0.0 if skip else 2.0)
        assert r["train/bad_steps_in_row"] == 0.0
        if not skip:
            assert r["loss/grad_norm"] == 0.0
    if skip:
        start = make_sampler("hf:fp32", addition_model_dir).float_model.state_dict()
        end = final_weights(result.run_dir)
        assert all(torch.equal(start[k].float(), end[k]) for k in end)


def test_ewma_resets_when_the_default_preset_keeps_fewer_tokens(tmp_path, addition_model_dir, monkeypatch):
    """The default correction preset (token TIS) rejects nothing; from step 3 on the correction here keeps only
    the first group's rows (a deterministic stand-in for a correction that rejects), so the keep share falls
    to at most 8/22 whatever this CPU samples. EWMA hears it from the correction itself (``after_correction``)
    and resets; β follows the measured lag (simulated_async, lag 1: 0 at step 1, then 1), not max_staleness."""
    import dataclasses

    import rollcorr.correction as correction
    from rollcorr.proximal import lag_beta

    real, calls = correction.compute_correction, []

    def rejecting(*args, **kwargs):
        res = real(*args, **kwargs)
        calls.append(1)
        if len(calls) < 3:
            return res
        keep = torch.zeros_like(res.kept_mask)
        keep[:2] = 1  # rows 0 and 1: one group, rewards 1 and 0, so the gradient is not zero
        return dataclasses.replace(res, kept_mask=res.kept_mask * keep)

    monkeypatch.setattr(correction, "compute_correction", rejecting)
    config = tiny_config(tmp_path, addition_model_dir, "trainer.steps=4", "task.eval_prompts=0",
                         "trainer.mode=simulated_async", "trainer.lag=1", "algorithm.proximal.name=ewma")
    from rollcorr.config.presets import preset

    assert config.algorithm.correction == preset("decoupled_token_is")  # the default preset
    run(config)
    steps = step_records(tmp_path / "run")
    # the strategy's metrics at step n come from its state after step n − 1's correction
    assert [r["proximal/ewma_resets"] for r in steps] == [0.0, 0.0, 0.0, 1.0]
    assert steps[1]["proximal/ewma_keep_ratio"] == 1.0 and steps[2]["proximal/ewma_keep_ratio"] == 1.0
    assert steps[3]["proximal/ewma_keep_ratio"] <= 8 / 22
    assert [r["staleness/lag_mean"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert steps[1]["proximal/ewma_beta"] == 0.0  # step 1 had lag 0: the live weights
    assert steps[2]["proximal/ewma_beta"] == pytest.approx(lag_beta(1.0, 1)) == 0.5  # not max_staleness's 2/3


@pytest.mark.parametrize("every", [0.0, 1e9])
def test_output_that_is_not_a_terminal_gets_plain_step_lines_never_wrapped(tmp_path, addition_model_dir, capsys, every):
    """stdout captured (not a terminal) with the progress bar asked for: a plain line per step (log_every_s=0) or
    only the first and last steps' (a long interval), and a message longer than 80 columns printed on one line."""
    config = tiny_config(tmp_path, addition_model_dir, "trainer.steps=3", "trainer.progress=true", "rollout.top_p=0.9",
                         "algorithm.correction.sampler_distribution=truncated", f"trainer.log_every_s={every}")
    run(config)
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("step ") and "/3" in line.split()[1]]
    assert [line.split()[1] for line in steps] == (["1/3", "2/3", "3/3"] if every == 0 else ["1/3", "3/3"])
    assert all("reward " in line and "cut " in line and "len " in line for line in steps)
    warning = next(line for line in out if "sampler_distribution=truncated compares" in line)
    assert len(warning) > 200 and warning.endswith("(docs/three-policies.md)")  # whole, on one line
