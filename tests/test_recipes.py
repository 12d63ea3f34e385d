"""The recipes of docs/architecture.md, checked: a loss, a rejection rule (one per level: a sequence rule that reads
a per-row reduction, a token rule that reads the (B, T) tokens) and a π_old strategy, each added from outside the
package — here, in this module, as a user's own module would — through its one door (``register_loss``,
``register_rule``, ``proximal.register``), and each picked up by every consumer it applies to:

    toy                     rollcorr train   rollcorr analyze   verl drop-in                   fused correction
    loss toy_clipped_pg     2 steps          does not apply     toy_mode, rollcorr_<name>      does not apply
    rule toy_max_abs_...    2 steps          explained          in the drop-in's correction    its row max; = default
    rule toy_token_abs_...  2 steps          explained          in the drop-in's correction    its tokens; = default
    π_old counting_...      2 steps          does not apply     does not apply                 does not apply

Where an extension point does not apply to a consumer:
- a loss and ``rollcorr analyze``: analyze applies a correction config to a dump (weights, rejection,
  metrics); no loss is computed there. The fused path is the correction's, and the loss runs after it.
- a π_old strategy and analyze, the verl drop-in, the fused path: π_old is an input of all three (a dump's
  ``old_log_probs``, the ``old_log_prob`` verl's actor recomputed), ready before the correction runs; only the
  trainer asks a strategy for it.

Regression cases of fixed defects: a loss registered with ``verl_name="toy_mode"`` is computed by its own
function in the verl drop-in (the drop-in's dispatch fell through to verl's "dro") and importing the drop-in
after the registration works (its hand list of modes raised KeyError); analyze explains an outside token-level
rule (it crashed: size mismatch); whether a config rejects is read from ``RULES`` (an outside rule makes
analyze's report say "would be masked out"). The fourth, one reading of an override (``rs_thresholds=1.5_3``
is the window [1.5, 3.0] in train and analyze alike), is tests/test_overrides.py. The engine recipe
(``register_sampler``) is tests/test_plugins.py; the four from a plugin named in the config, in every process of
a run, tests/test_plugins_config.py.

A rule from outside is on only where a config names it (``CorrectionConfig.rules``, with its options), never by
being registered: each test names its toy rule, and ``test_a_registered_rule_is_off_until_a_config_names_it``
checks the switch.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import sys

import pytest
import torch
from torch import Tensor

from conftest import on_default_path
from rollcorr import proximal
from rollcorr.analyze.analysis import analyze
from rollcorr.analyze.cli import sample_dump_path
from rollcorr.cli import main
from rollcorr.config import CorrectionConfig
from rollcorr.correction import compute_correction
from rollcorr.correction.rejection import (
    RULES,
    Rule,
    RuleOutcome,
    declared_reductions,
    register_rule,
    rejects,
)
from rollcorr.dumps import read_dump
from rollcorr.losses import LOSSES, LossConfig, LossSpec, policy_loss, register_loss
from rollcorr.losses.common import clamped_ratio, masked_mean
from rollcorr.proximal import ProximalStrategy
from rollcorr.train.config import ConfigError, load_config
from test_correction_perf_fused import _assert_close, _batch, _exact  # tests/ is on sys.path (pytest rootdir)

TRAIN = [
    "task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
    "task.eval_prompts=0", "trainer.steps=2", "trainer.progress=false", "trainer.plot=false",
    "trainer.tensorboard=false", "trainer.checkpoint_every=0", "trainer.mini_batches=1",
]


def train(tmp_path, model_dir, *overrides: str) -> list[dict]:
    """``rollcorr train`` (the command, in this process) for 2 steps; the steps' metrics."""
    assert main(["train", *TRAIN, f"model.path={model_dir}", f"trainer.out={tmp_path / 'run'}", *overrides]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward/mean" in r]
    assert len(steps) == 2
    return steps


def clamped_log_ratio(old: Tensor, rollout: Tensor, mask: Tensor) -> Tensor:
    """ℓ = log π_old − log μ clamped to ±20 (the rules' statistics read it so), 0 on padding; float64."""
    return torch.where(mask.bool(), (old.double() - rollout.double()).clamp(-20, 20), 0.0)


# ---- a loss ------------------------------------------------------------------------------------------------
TOY_LOSS = "toy_clipped_pg"


def toy_loss(inputs, config):
    """L = −A · sg(clip(r, 1 − ε_lo, 1 + ε_hi)) · log π_θ · w (a CISPO-like toy), per token (B, T)."""
    _, ratio = clamped_ratio(inputs.log_prob, inputs.old_log_prob)
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high).detach()
    loss = -inputs.advantages * clipped * inputs.log_prob
    if inputs.weights is not None:
        loss = loss * inputs.weights
    return loss, {"actor/toy_clip_share": masked_mean((clipped != ratio).float(), inputs.kept_mask).detach()}


@pytest.fixture
def toy_loss_registered():
    """The toy loss with its own ε and aggregation, and a verl loss mode of its own."""
    spec = register_loss(LossSpec(TOY_LOSS, toy_loss, clip_low=0.05, clip_high=0.1, agg="seq-mean-token-mean",
                                  verl_name="toy_mode"))
    yield spec
    del LOSSES[TOY_LOSS]


def loss_batch(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = log_prob + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return log_prob, old.clamp(max=0), adv, mask


def test_loss_through_policy_loss(toy_loss_registered):
    log_prob, old, adv, mask = loss_batch()
    config = LossConfig(name=TOY_LOSS)
    assert (config.eps_low, config.eps_high, config.agg_mode) == (0.05, 0.1, "seq-mean-token-mean")
    w = torch.rand_like(log_prob)
    lp = log_prob.clone().requires_grad_()
    loss, metrics = policy_loss(config, lp, old, adv, mask, weights=w)
    loss.backward()
    # by hand: seq-mean-token-mean of −A·clip(r)·log π·w
    clipped = torch.exp(log_prob - old).clamp(0.95, 1.1)
    per_token = -adv[:, None] * clipped * log_prob * w
    m = mask.double()
    torch.testing.assert_close(loss.detach(), ((per_token * m).sum(-1) / m.sum(-1)).mean())
    torch.testing.assert_close(lp.grad, -adv[:, None] * clipped * w * m / m.sum(-1, keepdim=True) / 4)
    assert "actor/toy_clip_share" in metrics and metrics["actor/kept_token_fraction"] == 1.0
    with pytest.raises(ValueError, match="needs old_log_prob"):
        policy_loss(config, lp, None, adv, mask)


@pytest.mark.usefixtures("alternating_rewards")
def test_loss_in_rollcorr_train(tmp_path, addition_model_dir, toy_loss_registered):
    config = load_config(None, [f"algorithm.loss={TOY_LOSS}"])
    assert config.algorithm.resolved("aggregation") == "seq-mean-token-mean"  # the toy's own default
    steps = train(tmp_path, addition_model_dir, f"algorithm.loss={TOY_LOSS}", "optim.lr=1e-3")
    assert all("actor/toy_clip_share" in s for s in steps)  # the toy's own metric: its function ran
    assert all(s["loss/grad_norm"] > 0 for s in steps)  # and moved the weights


def test_loss_in_the_verl_drop_in(toy_loss_registered):
    """Registered before the drop-in is imported: verl's loss mode ``toy_mode`` and ``rollcorr_toy_clipped_pg``
    compute the toy's own loss, through ``compute_policy_loss_toy_mode`` and ``POLICY_LOSS_REGISTRY`` alike."""
    from rollcorr.compat.verl_losses import policy_loss_by_mode, verl_modes

    sys.modules.pop("rollcorr.compat.verl", None)
    try:
        verl = importlib.import_module("rollcorr.compat.verl")  # imported after the registration
        assert "toy_mode" in verl_modes()
        log_prob, old, adv, mask = loss_batch()
        advantages = adv[:, None].expand_as(log_prob)
        want, _ = policy_loss(LossConfig(name=TOY_LOSS, clip_low=0.05, clip_high=0.1, agg="token-mean"), log_prob,
                              old, advantages, mask)
        got, metrics = policy_loss_by_mode("toy_mode", old, log_prob, advantages, mask, "token-mean",
                                           clip_ratio_low=0.05, clip_ratio_high=0.1)
        assert torch.allclose(got, want) and "actor/toy_clip_share" in metrics
        actor = {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1}
        for fn in (verl.compute_policy_loss_toy_mode, verl.get_policy_loss_fn("toy_mode"),
                   verl.POLICY_LOSS_REGISTRY[f"rollcorr_{TOY_LOSS}"]):
            loss, _ = fn(old, log_prob, advantages, mask, "token-mean", actor)
            assert torch.allclose(loss, want), fn
        assert "toy_mode" in verl.POLICY_LOSS_REGISTRY.keys()
    finally:
        sys.modules.pop("rollcorr.compat.verl", None)
        importlib.import_module("rollcorr.compat.verl")


def test_loss_registered_after_the_verl_drop_in_was_imported():
    """The drop-in reads the catalogue when asked, so a loss registered later is served too."""
    from rollcorr.compat import verl

    assert "toy_mode" not in verl.POLICY_LOSS_REGISTRY
    spec = register_loss(LossSpec(TOY_LOSS, toy_loss, clip_low=0.05, clip_high=0.1, verl_name="toy_mode"))
    try:
        log_prob, old, adv, mask = loss_batch(seed=1)
        advantages = adv[:, None].expand_as(log_prob)
        want, _ = policy_loss(LossConfig(name=TOY_LOSS, clip_low=0.05, clip_high=0.1, agg="token-mean"), log_prob,
                              old, advantages, mask)
        actor = {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1}
        for name in ("toy_mode", f"rollcorr_{TOY_LOSS}"):
            loss, _ = verl.get_policy_loss_fn(name)(old, log_prob, advantages, mask, "token-mean", actor)
            assert torch.allclose(loss, want), name
    finally:
        del LOSSES[spec.name]
    assert "toy_mode" not in verl.POLICY_LOSS_REGISTRY and f"rollcorr_{TOY_LOSS}" not in verl.POLICY_LOSS_REGISTRY


# ---- a rejection rule -------------------------------------------------------------------------------------
SEQ_RULE, SEQ_LIMIT = "toy_max_abs_log_ratio", 1.04  # drop a row with a |ℓ_t| > log 1.04
TOKEN_RULE, TOKEN_LIMIT = "toy_token_abs_log_ratio", 1.0142  # drop a token with |ℓ_t| > log 1.0142


def drop_far_rows(name, limit, stats, context):
    """Sequence level: keep a row iff max_t ½ℓ_t² ≤ ½ (log limit)², i.e. every |ℓ_t| ≤ log limit."""
    row_max_k2 = stats.row_max("k2")  # (B,), from the statistics pass (or the compiled kernel)
    bound = 0.5 * math.log(limit) ** 2
    return RuleOutcome(name, None, row_max_k2 <= bound, row_max_k2, None, bound, limit)


def drop_far_tokens(name, limit, stats, context):
    """Token level: keep a token iff ½ℓ_t² ≤ ½ (log limit)²; ``token_keep`` (B, T)."""
    k2 = stats.token("k2")  # (B, T), 0 on padding
    bound = 0.5 * math.log(limit) ** 2
    return RuleOutcome(name, k2 <= bound, None, k2, None, bound, limit)


def seq_rule_metrics(outcomes, rows):
    (o,) = outcomes
    return {"toy_seq_fraction": rows.over_rows((~o.row_keep & rows.valid).to(rows.dtype))}


def token_rule_metrics(outcomes, rows):
    (o,) = outcomes  # padding has k2 = 0: only valid tokens can be rejected
    return {"toy_token_rows": rows.over_rows((~o.token_keep).any(-1).to(rows.dtype))}


def limit_option(default: float):
    """The toy rules' one option, ``limit`` (> 1), from the config's ``rules.<name>`` mapping."""

    def parse(options):
        limit = float(options.get("limit", default))
        if not limit > 1:
            raise ValueError(f"limit must be > 1, got {limit}")
        return limit

    return parse


TOY_RULES = {
    "sequence": Rule(SEQ_RULE, options=limit_option(SEQ_LIMIT),
                     reductions=lambda name, limit: frozenset({"max_k2"}),  # what the statistics pass must compute
                     apply=drop_far_rows, metrics=seq_rule_metrics),
    "token": Rule(TOKEN_RULE, options=limit_option(TOKEN_LIMIT),
                  reductions=lambda name, limit: None,  # reads the (B, T) tokens (built on first use)
                  apply=drop_far_tokens, metrics=token_rule_metrics),
}
METRIC = {"sequence": "rollout_corr/toy_seq_fraction", "token": "rollout_corr/toy_token_rows"}
NAMED = {"sequence": {SEQ_RULE: {"limit": SEQ_LIMIT}}, "token": {TOKEN_RULE: {}}}  # the token rule: its default


@pytest.fixture(params=["sequence", "token"])
def toy_rule(request):
    """One toy rule, registered for the test only (on where a config names it: ``CorrectionConfig.rules``)."""
    rule = register_rule(TOY_RULES[request.param])
    yield request.param
    RULES.remove(rule)


def named(level: str) -> str:
    """The toy rule of ``level`` named with its options, as a ``rules=`` override's value."""
    ((name, options),) = NAMED[level].items()
    return f"{{{name}: {{{', '.join(f'{k}: {v}' for k, v in options.items())}}}}}"


def kept_by_hand(level: str, old: Tensor, rollout: Tensor, mask: Tensor) -> Tensor:
    """The toy rule's keep, (B, T) bool, from its definition."""
    far = clamped_log_ratio(old, rollout, mask).abs() > math.log(SEQ_LIMIT if level == "sequence" else TOKEN_LIMIT)
    if level == "sequence":
        far = far.any(-1, keepdim=True)
    return mask.bool() & ~far


def test_rule_in_compute_correction_eager_and_fused(toy_rule, kernel_calls, monkeypatch):
    """With the fused statistics warmed (the kernel run eagerly, conftest.kernel_calls): the sequence rule reads the
    kernel's row maxima, the token rule the (B, T) tokens built beside it; either way the result is the default
    path's, and the rule's keep is its definition."""
    config = CorrectionConfig(is_level="token", rules=NAMED[toy_rule])  # token IS and the toy, the only rule
    old, roll, mask, _, _ = _batch(noise=0.02)
    got = compute_correction(old, roll, mask, config)
    want = on_default_path(monkeypatch, compute_correction, old, roll, mask, config)
    assert len(kernel_calls) == 1  # the kernel served the statistics
    assert declared_reductions(config) == ({"max_k2"} if toy_rule == "sequence" else set())
    _assert_close(got, want, _exact(monkeypatch, compute_correction, old, roll, mask, config))
    keep = kept_by_hand(toy_rule, old, roll, mask)
    assert torch.equal(want.kept_mask, keep)
    assert keep[mask].any() and not keep[mask].all()  # the rule drops some, not all
    if toy_rule == "sequence":
        valid = mask.any(-1)
        share = (valid & ~keep.any(-1)).sum().item() / valid.sum().item()
        assert want.metrics[METRIC["sequence"]].item() == pytest.approx(share)
    else:
        assert METRIC["token"] in want.metrics


def test_rule_makes_a_config_reject(toy_rule):
    """Whether a config rejects is read from the rules (``RULES[*].active``), not from a list of fields: an outside
    rule counts, so analyze's "would be masked out" line and its all-rejected check see it."""
    from rich.console import Console

    from rollcorr.analyze.render import describe, render

    config = CorrectionConfig(is_level="token", rules=NAMED[toy_rule])  # no rs, veto, TRM or OPSM field set
    assert rejects(config) and not rejects(CorrectionConfig(is_level="token"))
    name, limit = (SEQ_RULE, SEQ_LIMIT) if toy_rule == "sequence" else (TOKEN_RULE, TOKEN_LIMIT)
    assert f"{name} {limit:.4g}" in describe(config)  # the rule named in the config's one-line summary
    console = Console(record=True, width=200)
    render(analyze(read_dump(sample_dump_path()), config), console)
    assert "would be masked out" in console.export_text()


def test_rule_in_rollcorr_analyze(toy_rule, tmp_path):
    """``rollcorr analyze`` (the command) explains the rule on its level, with the counts of its definition, and
    its explanation matches the correction's mask."""
    out = tmp_path / "analysis.json"
    assert main(["analyze", str(sample_dump_path()), "--preset", "decoupled_token_is", "--set",
                 f"rules={named(toy_rule)}", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (summary,) = [r for r in report["rules"] if r["rule"] in (SEQ_RULE, TOKEN_RULE)]
    dump = read_dump(sample_dump_path())
    mask = dump.response_mask.bool()
    keep = kept_by_hand(toy_rule, dump.learner_log_prob, dump.rollout_log_prob, mask)
    assert summary["level"] == toy_rule
    if toy_rule == "sequence":
        assert summary["sequences"] == int((mask.any(-1) & ~keep.any(-1)).sum()) > 0
    else:
        assert summary["tokens"] == int((mask & ~keep).sum()) > 0
    assert report["rejected_tokens"] == int((mask & ~keep).sum())  # the toy is the preset's only rule
    assert not any("does not match" in note for note in report["notes"])


def test_rule_in_the_verl_drop_in(toy_rule):
    """verl's ``compute_rollout_correction_and_rejection_mask`` (the drop-in) applies the rule: its mask is
    verl's rejection (none set here) AND the rule's keep."""
    from rollcorr.compat.verl import compute_rollout_correction_and_rejection_mask as verl_correction

    old, roll, mask, _, _ = _batch(noise=0.02)
    _, kept_mask, _ = verl_correction(old, roll, mask.float(), rollout_is="token", rollout_is_threshold=2.0,
                                      rules=NAMED[toy_rule])
    keep = kept_by_hand(toy_rule, old, roll, mask)
    assert kept_mask.dtype == torch.float32 and torch.equal(kept_mask.bool(), keep)
    assert keep[mask].any() and not keep[mask].all()


@pytest.mark.usefixtures("alternating_rewards")
def test_rule_in_rollcorr_train(toy_rule, tmp_path, addition_model_dir):
    """The training step's correction applies the rule: its metric is logged each step (how much it drops
    depends on the sampler's numerics, not asserted)."""
    steps = train(tmp_path, addition_model_dir, "algorithm.correction.preset=decoupled_token_is",
                  f"algorithm.correction.rules={named(toy_rule)}")
    assert all(0.0 <= s[METRIC[toy_rule]] <= 1.0 for s in steps)


def test_a_registered_rule_is_off_until_a_config_names_it(toy_rule):
    """Registering a rule makes its name known; only ``rules`` turns it on (as ``algorithm.loss`` chooses a
    loss): the same correction without it equals the one with no rule registered at all, and a name no rule
    answers to, a built-in rule's kind, or options the rule refuses are one ValueError each."""
    old, roll, mask, _, _ = _batch(noise=0.02)
    plain = CorrectionConfig(is_level="token")
    off = compute_correction(old, roll, mask, plain)
    assert torch.equal(off.kept_mask, mask.bool()) and not any("toy" in key for key in off.metrics)
    on = compute_correction(old, roll, mask, plain.replace(rules=NAMED[toy_rule]))
    assert not torch.equal(on.kept_mask, mask.bool()) and METRIC[toy_rule] in on.metrics
    name = SEQ_RULE if toy_rule == "sequence" else TOKEN_RULE
    for rules, said in (({"toy_misspelt": {}}, "rules: 'toy_misspelt' is no registered rule; rules registered from "
                                               f"outside: ['{name}']"),
                        ({"rs": {}}, "rules: 'rs' is a built-in rule, set by its own fields"),
                        ({name: {"limit": 0.5}}, f"rules.{name}: limit must be > 1, got 0.5")):
        with pytest.raises(ValueError, match=re.escape(said)):
            compute_correction(old, roll, mask, plain.replace(rules=rules))
        with pytest.raises(ConfigError, match="^" + re.escape(f"algorithm.correction.{said}")):  # the key first
            load_config(None, [f"algorithm.correction.rules={rules}".replace("'", "")])


# ---- a π_old strategy -------------------------------------------------------------------------------------
class CountingRecompute(ProximalStrategy):
    """An outside π_old strategy: the learner's log-probs before the update, as recompute computes them, with a
    call counter."""

    name = "counting_recompute"

    def __init__(self, temperature: float = 1.0, max_staleness: int = 1, measure_error: bool = False):
        super().__init__(temperature, max_staleness, measure_error)
        self.calls = 0

    def _old_log_prob(self, rollout, learner, current_version: int) -> Tensor:
        self.calls += 1
        out = learner.log_prob(rollout, temperature=self.temperature, grad=False)
        return out[0] if isinstance(out, tuple) else out

    def metrics(self) -> dict[str, float]:
        return {"counting_calls": float(self.calls)}


@pytest.fixture
def toy_strategy():
    proximal.register(CountingRecompute)
    yield CountingRecompute
    proximal.STRATEGIES.pop(CountingRecompute.name, None)


def test_strategy_in_rollcorr_train(tmp_path, addition_model_dir, toy_strategy):
    steps = train(tmp_path, addition_model_dir, "algorithm.proximal.name=counting_recompute")
    assert [s["proximal/counting_calls"] for s in steps] == [1.0, 2.0]  # asked once a step, by the trainer


def test_strategy_options_are_checked_and_names_are_unique(toy_strategy):
    with pytest.raises(ConfigError, match=r"^algorithm.proximal: strategy 'counting_recompute' has no option"):
        load_config(None, ["algorithm.proximal={name: counting_recompute, beta: 0.5}"])
    with pytest.raises(ValueError, match="exists already"):
        proximal.register(type("Again", (CountingRecompute,), {}))
