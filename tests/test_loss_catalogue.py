"""The loss catalogue (rollcorr.losses.registry): one declaration per loss, read by policy_loss, LossConfig,
the trainer's validation and the verl drop-in; a loss registered from outside the package works everywhere."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from rollcorr.losses import LOSSES, LossConfig, LossSpec, loss_spec, policy_loss, register_loss
from rollcorr.losses.common import clamped_ratio, masked_mean

TOY = "toy_clipped_pg"


def toy_loss(inputs, config):
    """L = −A · sg(clip(r, 1 − ε_lo, 1 + ε_hi)) · log π_θ · w (a CISPO-like toy)."""
    _, ratio = clamped_ratio(inputs.log_prob, inputs.old_log_prob)
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high).detach()
    loss = -inputs.advantages * clipped * inputs.log_prob
    if inputs.weights is not None:
        loss = loss * inputs.weights
    return loss, {"actor/toy_clip_share": masked_mean((clipped != ratio).float(), inputs.kept_mask).detach()}


@pytest.fixture
def toy_registered():
    spec = register_loss(LossSpec(TOY, toy_loss, clip_low=0.05, clip_high=0.1, agg="seq-mean-token-mean"))
    yield spec
    del LOSSES[TOY]


def batch(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = log_prob + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return log_prob, old.clamp(max=0), adv, mask


def test_a_loss_registered_outside_runs_through_policy_loss(toy_registered):
    log_prob, old, adv, mask = batch()
    config = LossConfig(name=TOY)
    assert (config.eps_low, config.eps_high, config.agg_mode) == (0.05, 0.1, "seq-mean-token-mean")
    w = torch.rand_like(log_prob)
    lp = log_prob.clone().requires_grad_()
    loss, metrics = policy_loss(config, lp, old, adv, mask, weights=w)
    loss.backward()
    # by hand: seq-mean-token-mean of −A·clip(r)·log π·w
    clipped = torch.exp(log_prob - old).clamp(0.95, 1.1)
    per_token = -adv[:, None] * clipped * log_prob * w
    m = mask.double()
    expected = ((per_token * m).sum(-1) / m.sum(-1)).mean()
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(lp.grad, -adv[:, None] * clipped * w * m / m.sum(-1, keepdim=True) / 4)
    assert "actor/toy_clip_share" in metrics and metrics["actor/kept_token_fraction"] == 1.0
    with pytest.raises(ValueError, match="needs old_log_prob"):
        policy_loss(config, lp, None, adv, mask)


def test_catalogue_refuses_duplicates_and_unknown_options():
    with pytest.raises(ValueError, match="already registered"):
        register_loss(LossSpec("ppo_clip", toy_loss))
    with pytest.raises(ValueError, match="not LossConfig fields"):
        LossSpec("toy_bad", toy_loss, options={"alpha": 1.0})
    with pytest.raises(ValueError, match="unknown aggregation"):
        LossSpec("toy_bad", toy_loss, agg="mean")
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        LossConfig(name="nope")


def test_one_default_per_option():
    """A loss's own options are declared by its spec only: LossConfig and the trainer read them there."""
    from rollcorr.train.config import AlgorithmConfig, loss_arg_readers

    assert loss_spec("oapl").options["oapl_beta"] == 0.3  # the shipped default (docs/results.md, study 4)
    assert LossConfig(name="oapl").oapl_beta == AlgorithmConfig().oapl_beta == 0.3
    assert LossConfig(name="tis").tis_cap == 2.0 and LossConfig(name="ppo_clip").tis_cap is None
    readers = loss_arg_readers()
    for key, names in readers.items():
        assert all(key in loss_spec(n).options for n in names)
    assert readers["dppo_kl_coef"] == ("dppo_tv", "dppo_kl") and readers["dro_beta"] == ("dro",)


def test_policy_loss_dispatches_through_the_table():
    """No name comparison left in policy_loss: what a loss needs comes from its spec."""
    import rollcorr.losses.dispatch as dispatch

    source = inspect.getsource(dispatch)
    assert "name ==" not in source and "name in (" not in source
    assert all(isinstance(spec, LossSpec) for spec in LOSSES.values())


def test_verl_drop_in_reads_the_catalogue():
    from rollcorr.compat import verl
    from rollcorr.compat.verl_losses import LOSS_MODES

    assert set(LOSS_MODES) == {s.verl_name for s in LOSSES.values() if s.verl_name}
    assert "vanilla" in LOSS_MODES and "geo_mean" in LOSS_MODES
    for name in verl.EXTRA_LOSSES:
        assert f"rollcorr_{name}" in verl.POLICY_LOSS_REGISTRY
    assert not {"tis", "oapl"} & set(verl.EXTRA_LOSSES)


@pytest.mark.usefixtures("alternating_rewards")
def test_a_loss_registered_outside_trains_two_steps(tmp_path, addition_model_dir, toy_registered):
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    config = load_config(None, [
        "task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "optim.lr=1e-3", "trainer.mini_batches=1", "trainer.steps=2", f"algorithm.loss={TOY}",
        f"model.path={addition_model_dir}", f"trainer.out={tmp_path / 'run'}",
    ])  # fmt: skip
    assert config.algorithm.resolved("aggregation") == "seq-mean-token-mean"  # the toy's own default
    result = run(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/toy_clip_share" in r]
    assert len(steps) == 2, result
    assert all(r["loss/grad_norm"] > 0 for r in steps)  # the toy loss moved the weights


def test_a_loss_with_a_verl_name_registered_outside_is_a_verl_loss_mode():
    """A loss registered from outside with verl_name="toy_mode" is served by the verl drop-in under that name —
    through its own computation, not another loss's (the drop-in's hand-written dispatch used to fall through to
    verl's "dro" loss), and importing the drop-in afterwards works (its hand list of names raised KeyError)."""
    import importlib
    import sys

    from rollcorr.compat.verl_losses import policy_loss_by_mode, verl_modes

    spec = register_loss(LossSpec("toy_verl", toy_loss, clip_low=0.05, clip_high=0.1, verl_name="toy_mode"))
    try:
        assert "toy_mode" in verl_modes()
        log_prob, old, adv, mask = batch()
        advantages = adv[:, None].expand_as(log_prob)
        got, metrics = policy_loss_by_mode("toy_mode", old, log_prob, advantages, mask, "token-mean",
                                           clip_ratio_low=0.05, clip_ratio_high=0.1)  # fmt: skip
        want, _ = policy_loss(LossConfig(name="toy_verl", clip_low=0.05, clip_high=0.1, agg="token-mean"), log_prob,
                              old, advantages, mask)  # fmt: skip
        assert torch.allclose(got, want) and "actor/toy_clip_share" in metrics
        sys.modules.pop("rollcorr.compat.verl", None)
        verl = importlib.import_module("rollcorr.compat.verl")  # imported after the registration
        assert "toy_mode" in verl.POLICY_LOSS_REGISTRY and verl.get_policy_loss_fn("toy_mode") is not None
        fn = verl.compute_policy_loss_toy_mode
        loss, _ = fn(old, log_prob, advantages, mask, "token-mean", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1})
        assert torch.allclose(loss, want)
    finally:
        del LOSSES[spec.name]
        sys.modules.pop("rollcorr.compat.verl", None)
        importlib.import_module("rollcorr.compat.verl")
