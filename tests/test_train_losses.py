"""rollcorr train with every policy loss it accepts, algorithm.loss_args, and the losses it refuses.

The runs use the same kind of small model as tests/test_train_loop.py: a 2-layer Qwen2 fine-tuned here in a few
seconds on 1-digit addition. Its training batches are rewarded 1, 0, 1, 0, … by row (the ``alternating_rewards``
fixture), so every group's advantages — hence every gradient — are non-zero whatever tokens this CPU samples.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch

from conftest import assert_metrics_as_accurate
from rollcorr.checkpoint import latest_checkpoint, load_checkpoint
from rollcorr.config.presets import preset
from rollcorr.correction import compute_correction
from rollcorr.losses import LOSS_NAMES, LossConfig, policy_loss
from rollcorr.train.build import build_step_config, check_components
from rollcorr.train.config import REFUSED_LOSSES, ConfigError, accepted_losses, load_config, loss_arg_readers
from rollcorr.train.loop import Trainer, run

pytestmark = pytest.mark.usefixtures("alternating_rewards")

TINY = [
    "task.name=addition:1",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "task.eval_prompts=0",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.tensorboard=false",
    "optim.lr=1e-3",
    "trainer.mini_batches=1",
]
# clip_cov with a wide covariance band and a large share, so that its random draw zeroes tokens at every step
CLIP_COV_WIDE = [
    "algorithm.loss_args.clip_cov_ratio=0.3",
    "algorithm.loss_args.clip_cov_lb=-100",
    "algorithm.loss_args.clip_cov_ub=100",
]


def tiny_config(tmp_path, addition_model_dir, *overrides, name="run"):
    return load_config(
        None, [*TINY, f"model.path={addition_model_dir}", f"trainer.out={tmp_path / name}", *overrides]
    )


def step_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


def loss_overrides(loss: str) -> list[str]:
    if loss == "oapl":  # the oapl loss comes with its advantage; it regresses on log μ itself
        return ["algorithm.name=oapl", "algorithm.correction.preset=disabled"]
    return [f"algorithm.loss={loss}", *(CLIP_COV_WIDE if loss == "clip_cov" else [])]


# ---------------------------------------------------------------- every accepted loss trains


def test_every_loss_name_is_accepted_or_refused():
    assert set(accepted_losses()) | set(REFUSED_LOSSES) == set(LOSS_NAMES)
    assert not set(accepted_losses()) & set(REFUSED_LOSSES)
    assert all(set(losses) <= set(accepted_losses()) for losses in loss_arg_readers().values())


@pytest.mark.parametrize("loss", accepted_losses())
def test_every_accepted_loss_trains_two_steps(tmp_path, addition_model_dir, loss):
    config = tiny_config(tmp_path, addition_model_dir, *loss_overrides(loss), "trainer.steps=2", "trainer.mini_batches=2",
                         "trainer.micro_batch_size=3")
    trainer = Trainer(config)
    assert trainer.step_config.loss.name == loss
    before = {k: v.clone() for k, v in trainer.learner.model.state_dict().items()}
    result = trainer.run()
    assert result.steps == 2 and result.stopped is None
    steps = step_records(result.run_dir)
    assert len(steps) == 2
    for r in steps:
        assert r["train/applied_updates"] == 2.0 and r["train/skipped_updates"] == 0.0
        assert "actor/pg_loss" in r and r["loss/grad_norm"] > 0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    if loss == "clip_cov":  # the run's generator drew tokens to zero
        assert all(r["actor/pg_clipfrac"] > 0 for r in steps)
    after = trainer.learner.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_loss_args_reach_the_loss(tmp_path, addition_model_dir):
    """A sapo run with a different gate temperature trains on the same first batch to a different loss."""
    losses = []
    for tau in (1.0, 8.0):
        config = tiny_config(tmp_path, addition_model_dir, "algorithm.loss=sapo", f"algorithm.loss_args.sapo_tau_neg={tau}",
                             f"algorithm.loss_args.sapo_tau_pos={tau}", "trainer.steps=1", name=f"tau{tau}")
        assert build_step_config(config).loss.sapo_tau_pos == tau  # (a Trainer would take the run folder)
        losses.append(step_records(run(config).run_dir)[0]["loss/policy"])
    # on-policy the gate (4/τ)·σ(τ(r−1)) is 2/τ at r = 1: the loss value scales as 1/τ
    assert losses[0] == pytest.approx(8 * losses[1], rel=1e-4)


def test_clip_cov_draw_is_resumed_from_the_checkpoint(tmp_path, addition_model_dir):
    """The clip_cov generator is saved: a run resumed after step 1 draws what the uninterrupted run drew."""
    overrides = [*loss_overrides("clip_cov"), "rollout.prompts_per_step=8", "trainer.steps=2",
                 "trainer.checkpoint_every=1", "trainer.keep_checkpoints=3"]
    full = run(tiny_config(tmp_path, addition_model_dir, *overrides, name="full"))
    killed = tmp_path / "killed"
    shutil.copytree(full.run_dir, killed)
    shutil.rmtree(killed / "checkpoints" / "step_000002")
    run(load_config(killed / "config.yaml"), resume=killed)
    a, b = (load_checkpoint(latest_checkpoint(d)) for d in (full.run_dir, killed))
    assert torch.equal(a["loss_generator"], b["loss_generator"])  # the stream went on, not back to the seed
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    last = step_records(full.run_dir)[1]
    assert last["loss/policy"] != 0 and last["actor/pg_clipfrac"] > 0  # step 2's draw shaped its update
    assert step_records(killed)[1]["loss/policy"] == last["loss/policy"]


def test_per_sequence_loss_accumulates_micro_batches_by_sequences(tmp_path, addition_model_dir, float64_reference,
                                                                  monkeypatch):
    """gmpo is a mean over sequences: micro-batches of 3 give the loss and gradient of the whole mini-batch —
    in float32, as close to the whole mini-batch in float64 as the whole mini-batch in float32 is."""
    from transformers import AutoConfig

    from rollcorr.train import loop

    def config(micro, name):
        return tiny_config(tmp_path, addition_model_dir, "algorithm.loss=gmpo", "trainer.steps=1",
                           f"trainer.micro_batch_size={micro}", name=name)

    whole, micro = (step_records(run(config(m, f"micro{m}")).run_dir)[0] for m in (0, 3))
    # the reference: the whole mini-batch with the learner (and its AdamW) in float64, on the batch the fp32
    # sampler draws alike; π_old is stored as float32 (rollcorr.proximal.scoring.score), an input both share
    build = loop.build_learner

    def float64_learner(*args, **kwargs):
        learner, optimizer = build(*args, **kwargs)
        learner.model.double()  # in place: the optimizer holds the same (still stateless) parameters
        return learner, optimizer

    monkeypatch.setattr(loop, "build_learner", float64_learner)
    with float64_reference():
        exact = step_records(run(config(0, "float64")).run_dir)[0]
    # floors: the forward's longest dot product sets a log-prob's float32 rounding (conftest.metric_floor)
    model = AutoConfig.from_pretrained(addition_model_dir)
    assert_metrics_as_accurate(micro, whole, exact, n=max(model.hidden_size, model.intermediate_size),
                               keys=("loss/policy", "loss/grad_norm"), sanity_rel=1e-2)


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["algorithm.loss=nope"], "algorithm.loss", "unknown loss 'nope'"),
        (["algorithm.loss=sapo", "algorithm.loss_args.tau=1"], "algorithm.loss_args.tau", "sapo_tau_pos"),
        (["algorithm.loss=sapo", "algorithm.loss_args.sapo_tau_pos=-1"], "algorithm.loss_args.sapo_tau_pos",
         "> 0"),
        (["algorithm.loss=sapo", "algorithm.loss_args.sapo_tau_neg=.inf"], "algorithm.loss_args.sapo_tau_neg",
         "finite"),
        (["algorithm.loss=dro", "algorithm.loss_args.dro_beta=abc"], "algorithm.loss_args.dro_beta", "number"),
        (["algorithm.loss=kl_cov", "algorithm.loss_args.kl_cov_ratio=2"], "algorithm.loss_args.kl_cov_ratio",
         "(0, 1]"),
        (["algorithm.loss=clip_cov", "algorithm.loss_args.clip_cov_lb=6"], "algorithm.loss_args.clip_cov_lb",
         "clip_cov_lb < clip_cov_ub"),
        (["algorithm.loss_args.sapo_tau_pos=2"], "algorithm.loss_args.sapo_tau_pos", "algorithm.loss is 'ppo_clip'"),
        (["algorithm.loss=tis", "algorithm.loss_args.tis_cap=3"], "algorithm.loss", "preset=tis"),
        (["algorithm.loss=sapo", "algorithm.loss_args.clip_low=0.1"], "algorithm.loss_args.clip_low", "allowed"),
        (["algorithm.loss_args=3"], "algorithm.loss_args", "mapping"),
    ],
)
def test_config_errors_name_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(f"{key}: "), str(err.value)
    assert says in str(err.value)


@pytest.mark.parametrize("loss", sorted(REFUSED_LOSSES))
def test_refused_loss_names_settings_that_build(loss):
    with pytest.raises(ConfigError, match=r"^algorithm\.loss: ") as err:
        load_config(None, [f"algorithm.loss={loss}"])
    advice = REFUSED_LOSSES[loss].split(" (")[0].split()
    assert " ".join(advice) in str(err.value) and any("correction.preset=" in a for a in advice)
    algo, proximal, _ = check_components(load_config(None, advice))
    assert algo.loss.name == "ppo_clip"


def test_refused_losses_equal_ppo_clip_with_the_advised_correction():
    """The advice is exact: each refused loss equals ppo_clip with the correction's weights (or π_old := μ)."""
    g = torch.Generator().manual_seed(0)
    shape = (6, 5)
    mask = torch.rand(shape, generator=g) > 0.2
    rollout = -torch.rand(shape, generator=g) * 3
    old = (rollout + torch.randn(shape, generator=g) * 1.5).clamp(max=-1e-3)  # ρ far from 1: the caps bite
    log_prob = (old + torch.randn(shape, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(shape[0], generator=g)

    def loss_and_grad(config, old_log_prob, **kwargs):
        value, _ = policy_loss(config, log_prob, old_log_prob, adv, mask, denominator_mask=mask, **kwargs)
        return value.detach(), torch.autograd.grad(value, log_prob)[0]

    corrections = {
        "vanilla_is": dataclasses.replace(preset("tis"), is_upper=None),
        "tis": preset("tis"),
        "areal": preset("areal_decoupled_cap"),
    }
    for name, correction in corrections.items():
        weights = compute_correction(old, rollout, mask, correction).is_weights
        rho = (old - rollout).exp()
        assert (rho[mask] > {"vanilla_is": 0, "tis": 2, "areal": 5}[name]).any()  # the cap (if any) bites
        expected = loss_and_grad(LossConfig(name=name), old, rollout_log_prob=rollout)
        got = loss_and_grad(LossConfig(name="ppo_clip"), old, weights=weights)
        torch.testing.assert_close(got, expected, msg=name)
    expected = loss_and_grad(LossConfig(name="ppo_is"), old, rollout_log_prob=rollout)
    torch.testing.assert_close(loss_and_grad(LossConfig(name="ppo_clip"), rollout), expected)
