"""IS weights, rejection rules, bypass mode, counts and diagnostics of compute_correction, on hand examples."""

import math

import pytest
import torch

from conftest import assert_as_accurate, metric_floor
from rollcorr.config import PRESETS, CorrectionConfig, preset
from rollcorr.correction import compute_correction, metrics_to_floats, mismatch_stats


def batch(rho, mask=None, base=-6.0, dtype=torch.float64):
    """(old, rollout, mask) with ρ = π_old/μ given per token."""
    rho = torch.as_tensor(rho, dtype=dtype)
    if rho.dim() == 1:
        rho = rho[None]
    roll = torch.full_like(rho, base) + 0.1 * torch.arange(rho.shape[1], dtype=dtype).neg()
    old = roll + rho.log()
    m = torch.ones_like(rho) if mask is None else torch.as_tensor(mask, dtype=dtype).reshape(rho.shape)
    return old, roll, m


def run(rho, mask=None, **cfg):
    old, roll, m = batch(rho, mask)
    res = compute_correction(old, roll, m, CorrectionConfig(**cfg))
    return res, metrics_to_floats(res.metrics)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=tol, atol=tol)


RHO = [0.3, 0.9, 1.2, 4.0, 7.0]  # the worked example of docs/importance-sampling.md


# ---- IS --------------------------------------------------------------------------------------------
def test_token_tis_icepop_and_batch_norm_worked_example():
    res, _ = run(RHO, is_level="token", is_upper=2.0)
    close(res.is_weights[0], [0.3, 0.9, 1.2, 2.0, 2.0])
    res, m = run(RHO, is_level="token", is_mode="mask", is_lower=0.5, is_upper=5.0)
    close(res.is_weights[0], [0.0, 0.9, 1.2, 4.0, 0.0])  # IcePop keeps ρ inside the band
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.4)
    assert res.kept_mask.sum() == 5  # IcePop zeroes weights, not the mask
    res, m = run(RHO, is_level="token", is_upper=2.0, batch_normalize=True)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.28)
    close(res.is_weights[0], torch.tensor([0.3, 0.9, 1.2, 2.0, 2.0], dtype=torch.float64) / 1.28)


def test_truncation_lower_bound_keeps_padding_zero():
    res, _ = run(RHO, mask=[1, 1, 1, 1, 0], is_level="token", is_upper=2.0, is_lower=0.5)
    close(res.is_weights[0], [0.5, 0.9, 1.2, 2.0, 0.0])


def test_untruncated_token_is():
    res, _ = run(RHO, is_level="token", is_upper=None)
    close(res.is_weights[0], RHO)


def test_sequence_and_geometric_levels():
    prod = math.prod(RHO)  # 9.07
    res, m = run(RHO, is_level="sequence", is_upper=2.0)
    close(res.is_weights[0], [2.0] * 5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(prod)  # verl: the unclamped row weight
    res, _ = run(RHO, is_level="sequence", is_upper=None)
    close(res.is_weights[0], [prod] * 5)
    res, _ = run(RHO, mask=[1, 1, 1, 0, 0], is_level="geometric", is_upper=None)
    geo = (0.3 * 0.9 * 1.2) ** (1 / 3)
    close(res.is_weights[0], [geo, geo, geo, 0, 0])


def test_seq_mis_keeps_rho_below_c_zeroes_above():
    rho = [[1.1, 1.2, 1.0], [2.0, 1.5, 1.0], [0.1, 0.2, 1.0]]
    res, _ = run(rho, is_level="sequence", is_mode="mask", is_upper=2.0)
    close(res.is_weights[:, 0], [1.32, 0.0, 0.02])  # no lower bound: tiny ρ(y) is kept, as written
    res, _ = run(rho, is_level="sequence", is_mode="mask", is_upper=2.0, is_lower=0.5)
    close(res.is_weights[:, 0], [1.32, 0.0, 0.0])


def test_sequence_batch_norm_averages_rows_not_tokens():
    rho = [[2.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]]
    res, m = run(
        rho, mask=[[1, 1, 1, 1], [1, 0, 0, 0]], is_level="sequence", is_upper=None, batch_normalize=True
    )
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.25)  # (2 + 0.5) / 2 rows
    close(res.is_weights, [[1.6, 1.6, 1.6, 1.6], [0.4, 0, 0, 0]])


def test_bypass_ppo_clip_measures_but_applies_no_weights():
    old, roll, m = batch(RHO)
    with pytest.raises(ValueError, match="log_prob"):
        compute_correction(None, roll, m, preset("bypass_pg_is"))
    res = compute_correction(None, roll, m, CorrectionConfig(mode="bypass", is_level="token"), log_prob=old)
    assert res.is_weights is None and "rollout_corr/rollout_is_mean" in res.metrics
    res = compute_correction(roll, roll, m, preset("bypass_pg_token_icepop"), log_prob=old)
    close(res.is_weights[0], [0.0, 0.9, 1.2, 4.0, 0.0])  # ratio π_θ/μ from log_prob, old_log_prob ignored


def test_weights_are_detached_and_mask_dtype_kept():
    old, roll, m = batch(RHO, dtype=torch.float32)
    old.requires_grad_(True)
    for mask in (m.bool(), m.long(), m):
        res = compute_correction(old, roll, mask, preset("decoupled_seq_is_rs", rs_threshold="0.1_2.0"))
        assert not res.is_weights.requires_grad and res.is_weights.dtype == torch.float32
        assert res.kept_mask.dtype == mask.dtype
        assert all(not v.requires_grad and v.dim() == 0 for v in res.metrics.values())
    res = compute_correction(old.detach().bfloat16(), roll.bfloat16(), m, preset("tis"))
    assert res.is_weights.dtype == torch.float32


def test_padding_values_are_ignored_even_nan():
    old, roll, m = batch([[1.5, 0.5, 1.0]], mask=[[1, 1, 0]])
    old[0, 2], roll[0, 2] = math.nan, math.inf
    res = compute_correction(old, roll, m, preset("decoupled_seq_is", threshold=10.0))
    f = metrics_to_floats(res.metrics)
    assert all(math.isfinite(v) for v in f.values())
    close(res.is_weights[0], [0.75, 0.75, 0.0])


# ---- rejection --------------------------------------------------------------------------------------
LR = torch.tensor([[0.1, -0.2, 0.05, 0.0], [0.6, 0.0, 0.0, 0.0], [-0.05, 0.02, -0.01, 0.03], [0.3, -0.4, 0.0, 0.0]],
                  dtype=torch.float64)
LR_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)


def _reference_keep(option, threshold):
    """Independent reference for one RS option (ratio convention for K1)."""
    lr, m = LR, LR_MASK.bool()
    stat = {"k1": -lr, "k2": 0.5 * lr**2, "k3": lr.exp() - 1 - lr}[option[-2:]]
    kind = option[:-3]
    if option.endswith("k1"):
        lo, hi = threshold
        in_band = lambda s: (s >= -math.log(hi)) & (s <= -math.log(lo))  # noqa: E731
    else:
        in_band = lambda s: s <= threshold  # noqa: E731
    if kind == "token":
        return in_band(stat) & m
    stat = torch.where(m, stat, torch.nan)
    row = {"seq_sum": stat.nansum(-1), "seq_mean": stat.nanmean(-1),
           "seq_max": torch.where(m, stat, -torch.inf).amax(-1)}[kind]
    return in_band(row)[:, None] & m


@pytest.mark.parametrize(
    "option, threshold",
    [("token_k1", (0.7, 1.2)), ("token_k2", 0.02), ("token_k3", 0.02), ("seq_sum_k1", (0.8, 1.5)),
     ("seq_sum_k2", 0.05), ("seq_sum_k3", 0.05), ("seq_mean_k1", (0.9, 1.1)), ("seq_mean_k2", 0.02),
     ("seq_mean_k3", 0.02), ("seq_max_k2", 0.05), ("seq_max_k3", 0.05)],
)
def test_every_rs_option_matches_reference(option, threshold):
    roll = torch.full_like(LR, -2.0)
    res = compute_correction(
        roll + LR, roll, LR_MASK, CorrectionConfig(rs=(option,), rs_thresholds=(threshold,))
    )
    expected = _reference_keep(option, threshold)
    assert torch.equal(res.kept_mask.bool(), expected), option
    f = metrics_to_floats(res.metrics)
    assert f["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        1 - expected.sum().item() / LR_MASK.sum().item()
    )
    assert f"rollout_corr/rollout_rs_{option}_mean" in f and f"rollout_corr/rollout_rs_{option}_seq_max" in f


def test_rs_options_combine_with_and():
    roll = torch.full_like(LR, -2.0)
    options, thresholds = ("token_k1", "seq_max_k2"), ((0.7, 1.2), 0.05)
    res = compute_correction(roll + LR, roll, LR_MASK, CorrectionConfig(rs=options, rs_thresholds=thresholds))
    expected = _reference_keep(*zip(options, thresholds).__next__()) & _reference_keep(
        options[1], thresholds[1]
    )
    assert torch.equal(res.kept_mask.bool(), expected)


def test_veto_drops_whole_sequence_and_outlier_ceiling():
    rho = [[1.0, 5e-5, 1.0], [1.0, 1.0, 1.0], [1.0, 150.0, 1.0]]
    res, m = run(rho, veto_threshold=1e-4)
    assert res.kept_mask.sum(-1).tolist() == [0, 3, 3]
    assert m["rollout_corr/veto_seq_fraction"] == pytest.approx(1 / 3)
    res, _ = run(rho, veto_threshold=1e-4, veto_upper=100.0)
    assert res.kept_mask.sum(-1).tolist() == [0, 3, 0]
    res, _ = run(rho, mask=[[1, 0, 1], [1, 1, 1], [1, 1, 1]], veto_threshold=1e-4)  # vetoed token is padding
    assert res.kept_mask.sum(-1).tolist() == [2, 3, 3]


def test_trm_max_k2_and_mean_k3():
    # row 0: one spike (max k2 = 0.5·0.4² = 0.08) but small mean; row 1: moderate everywhere
    lr = torch.tensor([[0.4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.15] * 8], dtype=torch.float64)
    res, m = run(lr.exp(), trm_max_k2=0.05)
    assert res.kept_mask.sum(-1).tolist() == [0, 8]
    res, _ = run(lr.exp(), trm_mean_k3=0.0116)
    assert res.kept_mask.sum(-1).tolist() == [8, 0]  # mean k3: row 0 = 0.0918/8 = 0.01148, row 1 = 0.01183
    res, m = run(lr.exp(), trm_max_k2=0.05, trm_mean_k3=0.0116)
    assert res.kept_mask.sum().item() == 0 and m["rollout_corr/all_rejected"] == 1.0


def test_opsm_drops_negative_advantage_divergent_rows():
    old, roll, m = batch([[0.5, 0.5], [0.5, 0.5], [1.0, 1.0]])
    log_prob = old.clone()  # π_θ = π_old: mean(log μ − log π_θ) = log 2 on rows 0 and 1
    cfg = CorrectionConfig(opsm_delta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        compute_correction(old, roll, m, cfg, log_prob=log_prob)
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    res = compute_correction(old, roll, m, cfg, log_prob=log_prob, advantages=adv)
    assert res.kept_mask.sum(-1).tolist() == [0, 2, 2]
    res = compute_correction(old, roll, m, cfg, advantages=adv[:, None].expand(3, 2))  # (B, T), π_θ := π_old
    assert res.kept_mask.sum(-1).tolist() == [0, 2, 2]


def test_counts_for_the_denominator_and_all_rejected_is_not_nan():
    res, m = run([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]], mask=[[1, 1, 0], [1, 1, 1]],
                 rs=("token_k1",), rs_thresholds=(2.0,), denominator="original")
    assert (m["rollout_corr/num_tokens"], m["rollout_corr/num_kept_tokens"]) == (5, 4)
    assert (
        m["rollout_corr/num_seqs"],
        m["rollout_corr/num_valid_seqs"],
        m["rollout_corr/num_kept_seqs"],
    ) == (2, 2, 2)
    assert m["rollout_corr/all_rejected"] == 0.0
    res, m = run([[5.0, 5.0]], is_level="token", rs=("token_k1",), rs_thresholds=(2.0,))
    assert res.kept_mask.sum() == 0 and m["rollout_corr/all_rejected"] == 1.0
    assert all(math.isfinite(v) for v in m.values())


def test_full_sampler_distribution_uses_kept_mass():
    old, roll, m = batch([[1.0, 1.0]])
    kept = torch.full_like(roll, math.log(0.8))  # top-p kept 80 %: μ_truncated = μ_full / 0.8
    cfg = CorrectionConfig(is_level="token", is_upper=None, sampler_distribution="full")
    with pytest.raises(ValueError, match="log_kept_mass"):
        compute_correction(old, roll, m, cfg)
    res = compute_correction(old, roll, m, cfg, log_kept_mass=kept)
    close(res.is_weights, [[1.25, 1.25]])  # π_old / μ_full = π_old / (0.8 μ_truncated)
    with pytest.raises(ValueError, match="log_kept_mass"):
        compute_correction(old, roll, m, cfg, log_kept_mass=-kept)


# ---- diagnostics ------------------------------------------------------------------------------------
def test_divergence_extras():
    rho = torch.tensor([[0.5, 2.0, 1.0]], dtype=torch.float64)
    _, m = run(rho)
    lr = rho.log()
    assert m["rollout_corr/gen_kl"] == pytest.approx(m["rollout_corr/k3_kl"])
    assert m["rollout_corr/policy_kl"] == pytest.approx((rho * lr - rho + 1).mean().item())
    js = 0.5 * (rho * lr - (1 + rho) * ((1 + rho) / 2).log())
    assert m["rollout_corr/js_divergence"] == pytest.approx(js.mean().item())
    assert 0 < m["rollout_corr/js_divergence"] < math.log(2)
    assert m["rollout_corr/token_mult_prob_error"] == pytest.approx((2 + 2 + 1) / 3)
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx(0.0, abs=1e-12)  # the signed mean hides …
    assert m["rollout_corr/log_ratio_abs_mean"] == pytest.approx(2 * math.log(2) / 3)  # … the absolute one


def test_mismatch_stats_hand_example():
    p_old = torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.0]])
    p_mu = torch.tensor([[0.5, 0.26, 0.7], [0.3005, 0.32, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    s = metrics_to_floats(mismatch_stats(p_old, p_mu, mask, log_space=False))
    assert s["prob_diff_max"] == pytest.approx(0.2)
    assert s["prob_diff_seq_max_mean"] == pytest.approx((0.2 + 0.02) / 2)
    assert s["prob_diff_seq_mean_mean"] == pytest.approx((0.26 / 3 + 0.0205 / 2) / 2)
    assert s["prob_diff_frac_lt_1e-3"] == pytest.approx(2 / 5)
    assert s["prob_diff_frac_ge_0.01"] == pytest.approx(3 / 5)
    assert s["prob_diff_frac_ge_0.05"] == pytest.approx(2 / 5)
    assert s["prob_diff_frac_ge_0.1"] == pytest.approx(1 / 5)
    a, b = torch.tensor([0.5, 0.2, 0.9, 0.3, 0.3]), torch.tensor([0.5, 0.26, 0.7, 0.3005, 0.32])
    # float32 Pearson r of 5 pairs, two implementations: each as close to the float64 value as torch.corrcoef's
    # (conftest.assert_as_accurate; floor: metric_floor of a 5-term reduction)
    exact = torch.corrcoef(torch.stack([a, b]).double())[0, 1].item()
    assert_as_accurate(s["prob_pearson"], torch.corrcoef(torch.stack([a, b]))[0, 1].item(), exact,
                       floor=metric_floor(exact, 5), what="prob_pearson")
    logs = metrics_to_floats(mismatch_stats(p_old.clamp_min(1e-9).log(), p_mu.clamp_min(1e-9).log(), mask))
    # 0.9 − 0.7 through a float32 log and exp each (≤ 2 ulps of 0.9 per side): ≤ 4 ε₃₂ · 0.9 / 0.2 ≈ 2e-6 relative
    assert logs["prob_diff_max"] == pytest.approx(0.2, rel=1e-5)
    with pytest.raises(ValueError, match="shape"):
        mismatch_stats(p_old, p_mu[:, :2], mask)


def test_staleness_and_decomposition():
    old, roll, m = batch([[1.2, 0.9, 1.0]], mask=[[1, 1, 0]])
    version = torch.tensor([[3, 5, 0]])
    log_prob = old + 0.1
    res = compute_correction(
        old, roll, m, CorrectionConfig(), log_prob=log_prob, version=version, current_version=6
    )
    f = metrics_to_floats(res.metrics)
    assert (f["rollout_corr/staleness_mean"], f["rollout_corr/staleness_max"]) == (2.0, 3.0)
    assert f["rollout_corr/drift_k3"] == pytest.approx(math.exp(0.1) - 1.1)
    assert f["rollout_corr/discrepancy_k3"] == pytest.approx(f["rollout_corr/k3_kl"])
    with pytest.raises(ValueError, match="current_version"):
        compute_correction(old, roll, m, CorrectionConfig(), version=version)


def test_validate_false_skips_the_check_but_keeps_padding_safe():
    old, roll, m = batch([[1.5, 0.5, 1.0]], mask=[[1, 1, 0]])
    old[0, 2] = math.nan
    res = compute_correction(old, roll, m, preset("tis"), validate=False)
    close(res.is_weights[0], [1.5, 0.5, 0.0])


def test_metrics_to_floats():
    assert metrics_to_floats({}) == {}
    out = metrics_to_floats({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor(3.0, dtype=torch.float64),
                             "d": torch.tensor(4), "e": torch.tensor(True), "f": torch.tensor([0.1]),
                             "g": torch.tensor(0.1, requires_grad=True)})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0, "d": 4.0, "e": 1.0, "f": float(torch.tensor(0.1)),
                   "g": float(torch.tensor(0.1))}
    assert all(type(v) is float for v in out.values())
    from rollcorr.correction.metrics import _read_at_once  # the path of device tensors: one sync, same floats

    values = {"a": torch.tensor(1.5), "b": 2, "c": torch.tensor(0.1, dtype=torch.float64), "d": torch.tensor(4),
              "f": torch.tensor([0.1]), "g": torch.tensor(0.1, requires_grad=True)}
    assert _read_at_once(values) == metrics_to_floats(values)


def test_rs_seq_masked_fraction_counts_valid_rows_only():
    old, roll, m = batch([[3.0, 1.0], [1.0, 1.0], [1.0, 1.0]], mask=[[1, 1], [1, 1], [0, 0]])
    f = metrics_to_floats(
        compute_correction(old, roll, m, CorrectionConfig(rs=("token_k1",), rs_thresholds=(2.0,))).metrics
    )
    assert f["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)  # verl: 1 / 3
    from rollcorr.compat.verl_correction import compute_rollout_correction_and_rejection_mask as verl

    _, _, v = verl(old, roll, m, rollout_rs="token_k1", rollout_rs_threshold=2.0)
    assert v["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_runs_end_to_end(name):
    g = torch.Generator().manual_seed(1)
    roll = -torch.rand(6, 12, generator=g) * 3 - 0.01
    old = (roll + 0.3 * torch.randn(6, 12, generator=g)).clamp(max=-1e-3)
    mask = torch.arange(12)[None] < torch.tensor([12, 3, 7, 0, 12, 1])[:, None]
    config = preset(name)
    res = compute_correction(
        old, roll, mask, config, log_prob=old - 0.01, advantages=torch.randn(6, generator=g)
    )
    assert (res.is_weights is not None) == config.applies_weights
    if res.is_weights is not None:
        assert torch.isfinite(res.is_weights).all() and (res.is_weights[~mask] == 0).all()
    assert not (res.kept_mask & ~mask).any()  # rejection only removes tokens
    assert all(math.isfinite(v) for v in metrics_to_floats(res.metrics).values())
