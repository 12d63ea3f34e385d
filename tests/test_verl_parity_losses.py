"""rollcorr.compat.verl_losses reproduces verl's policy losses on tests/data/verl_vectors.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollcorr.compat.verl_losses import policy_loss_by_mode as compute_policy_loss


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is far faster than two on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# verl's own outputs (docs/spec.md §9) ship with the tests, so CI checks parity on a clean checkout
VECTORS = Path(__file__).resolve().parent / "data" / "verl_vectors.json"
CASES = [c for c in json.loads(VECTORS.read_text())["cases"] if c["kind"] == "loss"]
RTOL = 1e-6


def _t(case, key):
    return torch.tensor(case[key], dtype=torch.float64)


def _run(case):
    params = case["params"]
    kwargs = {"clip_ratio_low": params["clip_ratio_low"], "clip_ratio_high": params["clip_ratio_high"]}
    if "clip_ratio_c" in params:
        kwargs["clip_ratio_c"] = params["clip_ratio_c"]
    weights = None if case["rollout_is_weights"] is None else _t(case, "rollout_is_weights")
    log_prob = _t(case, "log_prob").requires_grad_()
    loss, metrics = compute_policy_loss(
        case["loss_mode"],
        _t(case, "old_log_prob"),
        log_prob,
        _t(case, "advantages"),
        _t(case, "response_mask"),
        case["loss_agg_mode"],
        rollout_is_weights=weights,
        **kwargs,
    )
    loss.backward()
    return loss, metrics, log_prob.grad


def test_vectors_cover_the_required_modes():
    assert {c["loss_mode"] for c in CASES} >= {"vanilla", "gspo", "cispo", "geo_mean"}
    assert len(CASES) >= 8


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_loss_metrics_and_gradient_match_verl(case):
    loss, metrics, grad = _run(case)
    assert loss.item() == pytest.approx(case["loss"], rel=RTOL, abs=1e-12)
    expected_grad = torch.tensor(case["grad_log_prob"], dtype=torch.float64)
    torch.testing.assert_close(grad, expected_grad, rtol=RTOL, atol=RTOL * expected_grad.abs().max().item())
    assert set(case["metrics"]) <= set(metrics)
    for key, value in case["metrics"].items():
        assert metrics[key] == pytest.approx(value, rel=RTOL, abs=1e-9), key


def test_reinforce_bypass_loss_is_weighted_log_prob():
    case = next(c for c in CASES if c["rollout_is_weights"] is not None)
    log_prob = _t(case, "log_prob").requires_grad_()
    rollout, adv, mask, w = (
        _t(case, k) for k in ("old_log_prob", "advantages", "response_mask", "rollout_is_weights")
    )
    loss, metrics = compute_policy_loss(
        "reinforce", rollout, log_prob, adv, mask, "token-mean", rollout_is_weights=w
    )
    loss.backward()
    torch.testing.assert_close(loss, (-adv * log_prob * w * mask).sum() / mask.sum())
    torch.testing.assert_close(log_prob.grad, -adv * w * mask / mask.sum())
    expected_kl = ((rollout - log_prob) * mask).sum() / mask.sum()
    assert metrics["actor/ppo_kl"] == pytest.approx(expected_kl.item())


def test_geo_mean_ignores_agg_mode():  # gspo follows loss_agg_mode since verl 0.9.1 (tests/test_verl_live.py)
    by_mode = {c["loss_mode"]: c for c in CASES}
    for mode in ("geo_mean",):
        case = by_mode[mode]
        loss, _, _ = _run(case)
        other = dict(case, loss_agg_mode="token-sum")
        loss_other, _, _ = _run(other)
        assert loss_other.item() == pytest.approx(loss.item(), rel=1e-12)


def test_unknown_mode_and_bad_dual_clip_raise():
    case = CASES[0]
    args = (_t(case, "old_log_prob"), _t(case, "log_prob"), _t(case, "advantages"), _t(case, "response_mask"))
    with pytest.raises(ValueError, match="unsupported loss_mode"):
        compute_policy_loss("no_such_mode", *args)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss("vanilla", *args, clip_ratio_c=1.0)
