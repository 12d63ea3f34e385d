"""Audit statistics on synthetic log-probs with answers computed by hand from the formulas."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcorr.audit.stats import audit_stats, check_inputs, position_profile, worst_tokens


def _known_batch():
    """Row 0: p_μ = (0.5, 0.9), p_old = (0.38, 0.9); row 1: 0.2 vs 0.27; row 2: padding only (garbage)."""
    p_mu = torch.tensor([[0.5, 0.9], [0.2, 0.5], [0.3, 0.3]], dtype=torch.float64)
    p_old = torch.tensor([[0.38, 0.9], [0.27, 0.5], [0.3, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    log_mu, log_old = p_mu.log(), p_old.log()
    log_old[2, 0] = float("nan")  # padding may hold anything
    log_mu[1, 1] = 5.0
    return log_mu, log_old, mask


def test_probability_table_and_per_response_known_values():
    s = audit_stats(*_known_batch())
    p = s["probability"]
    # |Δp| over valid tokens: 0.12, 0, 0.07
    assert s["n_tokens"] == 3 and s["n_responses"] == 2  # the all-padding row is not a response
    assert p["prob_diff_frac_lt_1e-3"] == pytest.approx(1 / 3)
    assert p["prob_diff_frac_ge_0.01"] == pytest.approx(2 / 3)
    assert p["prob_diff_frac_ge_0.05"] == pytest.approx(2 / 3)
    assert p["prob_diff_frac_ge_0.1"] == pytest.approx(1 / 3)
    assert p["prob_diff_max"] == pytest.approx(0.12)
    assert p["prob_diff_mean"] == pytest.approx(0.19 / 3)
    per = s["per_response"]
    assert per["max_abs_diff"]["max"] == pytest.approx(0.12)
    assert per["max_abs_diff"]["mean"] == pytest.approx((0.12 + 0.07) / 2)
    assert per["mean_abs_diff"]["mean"] == pytest.approx((0.06 + 0.07) / 2)
    assert p["prob_diff_seq_max_mean"] == pytest.approx(per["max_abs_diff"]["mean"])
    assert per["length"]["max"] == 2


def test_divergences_known_values():
    d = audit_stats(*_known_batch())["divergence"]
    rho = [0.38 / 0.5, 1.0, 0.27 / 0.2]
    lr = [math.log(r) for r in rho]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert d["log_ratio_mean"] == pytest.approx(mean(lr))
    assert d["log_ratio_abs_mean"] == pytest.approx(mean([abs(x) for x in lr]))
    assert d["kl"] == pytest.approx(-mean(lr))
    assert d["k3_kl"] == pytest.approx(mean([r - 1 - x for r, x in zip(rho, lr)]))
    assert d["policy_kl_k1"] == pytest.approx(mean([r * x for r, x in zip(rho, lr)]))
    assert d["policy_kl"] == pytest.approx(mean([1 - r + r * x for r, x in zip(rho, lr)]))
    assert d["chi2_token"] == pytest.approx(mean([r * r for r in rho]) - 1)
    js = [0.5 * (r * x - (1 + r) * math.log((1 + r) / 2)) for r, x in zip(rho, lr)]
    assert d["js_divergence"] == pytest.approx(mean(js))
    assert d["ess_token"] == pytest.approx(sum(rho) ** 2 / (3 * sum(r * r for r in rho)))
    w = [rho[0] * rho[1], rho[2]]  # sequence ratios of the two real rows
    assert d["chi2_seq"] == pytest.approx(mean([x * x for x in w]) - 1)
    assert d["ess_seq"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))


def test_identical_log_probs_mean_no_mismatch():
    log_p = -torch.rand(4, 6, dtype=torch.float64) * 3
    mask = torch.ones(4, 6, dtype=torch.bool)
    s = audit_stats(log_p, log_p.clone(), mask)
    assert s["probability"]["prob_diff_frac_lt_1e-3"] == 1.0
    assert s["probability"]["prob_diff_max"] == 0.0
    assert s["probability"]["prob_pearson"] == pytest.approx(1.0)
    d = s["divergence"]
    for key in (
        "log_ratio_mean",
        "kl",
        "k3_kl",
        "policy_kl",
        "policy_kl_k1",
        "js_divergence",
        "chi2_token",
        "chi2_seq",
    ):
        assert d[key] == pytest.approx(0.0, abs=1e-12)
    assert d["ess_token"] == pytest.approx(1.0) and d["ess_seq"] == pytest.approx(1.0)


def test_extreme_log_ratios_stay_finite():
    log_mu = torch.tensor([[-1e-4, -50.0]])
    log_old = torch.tensor([[-80.0, -1e-4]])
    d = audit_stats(log_mu, log_old, torch.ones(1, 2))["divergence"]
    assert all(math.isfinite(v) for v in d.values())
    assert d["log_ratio_min"] == -20.0 and d["log_ratio_max"] == 20.0  # clamped before exp (docs/spec.md §1)


def test_position_profile_buckets():
    log_mu = torch.zeros(2, 4)
    p_old = torch.tensor([[1.0, 0.9, 0.5, 1.0], [0.8, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    view = check_inputs(log_mu, p_old.log(), mask)
    prof = position_profile(view, n_buckets=2)
    assert prof["start"] == [0, 2] and prof["end"] == [2, 4]
    assert prof["count"] == [4, 3]
    assert prof["max"] == pytest.approx([0.2, 0.5])
    assert prof["mean"] == pytest.approx([(0.0 + 0.1 + 0.2 + 0.0) / 4, 0.5 / 3])


def test_worst_tokens_sorted_and_skip_padding():
    log_mu = torch.zeros(2, 3)
    p_old = torch.tensor([[0.9, 0.5, 0.7], [0.95, 0.1, 0.99]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)  # (1, 1) is padding: never listed
    worst = worst_tokens(check_inputs(log_mu, p_old.log(), mask), k=10)
    assert [(w["row"], w["position"]) for w in worst] == [(0, 1), (0, 2), (0, 0), (1, 0), (1, 2)]
    assert worst[0]["p_sampler"] == pytest.approx(1.0) and worst[0]["p_learner"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)), "shape mismatch"),
        ((torch.zeros(6), torch.zeros(6), torch.ones(6)), r"must be \(B, T\)"),
        ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3)), "floating-point"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)), "no valid token"),
        ((torch.full((2, 3), float("nan")), torch.zeros(2, 3), torch.ones(2, 3)), "NaN/inf"),
        ((torch.zeros(2, 3), torch.full((2, 3), 0.5), torch.ones(2, 3)), "positive log-prob"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.full((2, 3), 0.5)), "only 0 and 1"),
    ],
)
def test_bad_input_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        audit_stats(*args)


@settings(deadline=None, max_examples=25)
@given(
    st.integers(1, 4),
    st.integers(1, 8),
    st.floats(0.0, 3.0),
    st.integers(0, 2**31 - 1),
)
def test_invariants(b, t, scale, seed):
    g = torch.Generator().manual_seed(seed)
    log_mu = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    log_old = (log_mu + scale * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=0)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[0, 0] = True
    s = audit_stats(log_mu, log_old, mask)
    d, p = s["divergence"], s["probability"]
    assert d["k3_kl"] >= -1e-12 and d["policy_kl"] >= -1e-12
    assert 0 < d["ess_token"] <= 1 + 1e-12 and 0 < d["ess_seq"] <= 1 + 1e-12
    assert 1 >= p["prob_diff_frac_ge_0.01"] >= p["prob_diff_frac_ge_0.05"] >= p["prob_diff_frac_ge_0.1"] >= 0
    assert p["prob_diff_frac_lt_1e-3"] + p["prob_diff_frac_ge_0.01"] <= 1 + 1e-12
    assert s["per_response"]["max_abs_diff"]["max"] == pytest.approx(p["prob_diff_max"])
    assert s["n_tokens"] == int(mask.sum())
