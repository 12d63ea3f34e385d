"""One rule list, two sources of statistics: every rejection rule runs through ``rejection.RULES`` on the default
plain-torch statistics or on the fused kernel's (once warmed), and each entry point of a run (compute_correction,
the training step, the verl drop-in) takes the warmed kernel. The kernel function runs eagerly here (``_row_pass``
is pure; compiling changes the summation order, not the formulas; tests/test_correction_perf_fused.py compiles it
for real), on small batches; the documented tolerance is float rounding: each path's error against the default
path on float64 copies of the inputs (conftest.assert_as_accurate). A rule registered from outside the package,
on every path and in every consumer: tests/test_recipes.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import EPS32, assert_as_accurate, assert_metrics_as_accurate, on_default_path
from rollcorr.config import CorrectionConfig, preset
from rollcorr.correction import compute_correction
from test_correction_perf_fused import _assert_close, _batch, _exact  # tests/ is on sys.path (pytest rootdir)

# ---- every fusable rule, per rule --------------------------------------------------------------------------
PER_RULE = {
    "seq_sum_k1": CorrectionConfig(rs=("seq_sum_k1",), rs_thresholds=("0.2_5.0",)),
    "seq_mean_k1": CorrectionConfig(rs=("seq_mean_k1",), rs_thresholds=("0.9_1.1",)),
    "seq_sum_k2": CorrectionConfig(rs=("seq_sum_k2",), rs_thresholds=(0.5,)),
    "seq_mean_k2": CorrectionConfig(rs=("seq_mean_k2",), rs_thresholds=(0.03,)),
    "seq_max_k2": CorrectionConfig(rs=("seq_max_k2",), rs_thresholds=(0.1,)),
    "seq_sum_k3": CorrectionConfig(rs=("seq_sum_k3",), rs_thresholds=(0.5,)),
    "seq_mean_k3": CorrectionConfig(rs=("seq_mean_k3",), rs_thresholds=(0.03,)),
    "seq_max_k3": CorrectionConfig(rs=("seq_max_k3",), rs_thresholds=(0.1,)),
    "trm_max_k2": CorrectionConfig(trm_max_k2=0.1),
    "trm_mean_k3": CorrectionConfig(trm_mean_k3=0.02),
    "trm_both_token_is": CorrectionConfig(trm_max_k2=0.1, trm_mean_k3=0.02, is_level="token"),
}


@pytest.mark.parametrize(
    ("name", "verl"), [(n, v) for n in PER_RULE for v in (False, True) if not (v and n.startswith("trm"))]
)  # verl mode (verl_compat: verl's K1 windows, +1e-8 means, all rows) for verl's own rules
def test_each_fusable_rule_matches_the_default_path(name, verl, kernel_calls, monkeypatch):
    config = dataclasses.replace(PER_RULE[name], verl_compat=verl)
    old, roll, mask, lp, kept = _batch(noise=0.3, seed=3)
    got = compute_correction(old, roll, mask, config)
    assert len(kernel_calls) == 1
    want = on_default_path(monkeypatch, compute_correction, old, roll, mask, config)
    _assert_close(got, want, _exact(monkeypatch, compute_correction, old, roll, mask, config))
    assert not torch.equal(want.kept_mask, mask) and want.kept_mask.any()  # rejects some rows, not all


def test_version_lag_and_decomposition_take_the_fused_path(kernel_calls, monkeypatch):
    """The training step passes version and π_θ: the lag and the discrepancy/staleness split are computed
    beside the kernel."""
    config = preset("decoupled_geo_rs_token_tis")
    old, roll, mask, lp, kept = _batch(noise=0.3)
    version = torch.randint(0, 4, mask.shape, generator=torch.Generator().manual_seed(1))
    kw = dict(log_prob=lp, version=version, current_version=4)
    got = compute_correction(old, roll, mask, config, **kw)
    assert len(kernel_calls) == 1
    want = on_default_path(monkeypatch, compute_correction, old, roll, mask, config, **kw)
    _assert_close(got, want, _exact(monkeypatch, compute_correction, old, roll, mask, config, **kw))
    for key in ("staleness_mean", "staleness_max", "discrepancy_k3", "drift_k3", "total_k3"):
        assert f"rollout_corr/{key}" in got.metrics


def test_the_training_step_takes_the_fused_path(kernel_calls, monkeypatch):
    from rollcorr.rollout import Rollout
    from rollcorr.train import step
    from rollcorr.train.build import build_step_config
    from rollcorr.train.config import load_config

    algo = build_step_config(load_config(None, ["algorithm.correction.preset=decoupled_geo_rs_token_tis"]))
    old, roll, mask, lp, kept = _batch(noise=0.3)
    b, t = mask.shape
    rollout = Rollout(
        prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.bool),
        response_ids=torch.zeros(b, t, dtype=torch.long), response_mask=mask, rollout_log_prob=roll,
        version=torch.full((b, t), 2), group_ids=torch.arange(b), old_log_prob=old,
    )
    got, metrics = step.attach_correction(rollout, algo, lp)
    assert len(kernel_calls) == 1
    want, want_metrics = on_default_path(monkeypatch, step.attach_correction, rollout, algo, lp)
    exact, _ = _exact(monkeypatch, step.attach_correction, rollout, algo, lp)
    assert torch.equal(got.kept_mask, want.kept_mask)
    # token weights under a sequence-level rejection: the floor of a length-T row reduction (metric_floor's rule)
    floor = t * EPS32 * float(exact.is_weights.norm())
    assert_as_accurate(got.is_weights, want.is_weights, exact.is_weights, floor=floor, what="is_weights")
    assert metrics.keys() == want_metrics.keys() and "rollout_corr/discrepancy_k3" in metrics
    # the version lag is the Rollout's to log, once per step, not the correction's
    assert "rollout_corr/staleness_mean" not in metrics and rollout.lag_metrics(3)["staleness/lag_mean"] == 1.0


def test_the_verl_drop_in_takes_the_fused_path(kernel_calls, monkeypatch):
    from rollcorr.compat.verl import compute_rollout_correction_and_rejection_mask as helper

    old, roll, mask, lp, kept = _batch(noise=0.3)
    kw = dict(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.95_1.05",
    )
    weights, kept_mask, metrics = helper(old, roll, mask.float(), **kw)
    assert len(kernel_calls) == 1
    want_w, want_mask, want = on_default_path(monkeypatch, helper, old, roll, mask.float(), **kw)
    exact_w, _, exact = _exact(monkeypatch, helper, old, roll, mask.float(), **kw)
    assert torch.equal(kept_mask, want_mask) and kept_mask.dtype == torch.float32
    w, w_eager, w_exact = (x.batch["rollout_is_weights"] for x in (weights, want_w, exact_w))
    assert_as_accurate(w, w_eager, w_exact, floor=mask.shape[-1] * EPS32 * float(w_exact.norm()), what="weights")
    assert metrics.keys() == want.keys()
    assert_metrics_as_accurate(metrics, want, exact, n=mask.numel())
