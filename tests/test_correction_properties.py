"""Property tests (hypothesis): invariants of the correction on random batches."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcorr.config import CorrectionConfig
from rollcorr.config.correction import RS_OPTIONS
from rollcorr.correction import compute_correction, metrics_to_floats

SETTINGS = settings(deadline=None, max_examples=25)


@st.composite
def batches(draw, lr_range=3.0, min_lp=-12.0):
    """(old, rollout, mask): float64 (B, T) log-probs ≤ 0, a mask with at least one valid token."""
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    floats = st.floats(min_lp, -0.01, allow_nan=False)
    roll = torch.tensor(draw(st.lists(floats, min_size=b * t, max_size=b * t)), dtype=torch.float64).view(
        b, t
    )
    deltas = st.floats(-lr_range, lr_range, allow_nan=False)
    delta = torch.tensor(draw(st.lists(deltas, min_size=b * t, max_size=b * t)), dtype=torch.float64).view(
        b, t
    )
    old = (roll + delta).clamp(max=0.0)
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    if max(lengths) == 0:
        lengths[0] = 1
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    return old, roll, mask


LEVELS = st.sampled_from(["token", "sequence", "geometric"])


@SETTINGS
@given(batches(), LEVELS, st.sampled_from(["truncate", "mask"]), st.booleans())
def test_identical_log_probs_mean_no_correction(data, level, mode, normalise):
    _, roll, mask = data
    rs = RS_OPTIONS
    thresholds = tuple((0.5, 2.0) if o.endswith("k1") else 0.01 for o in rs)
    cfg = CorrectionConfig(
        is_level=level, is_mode=mode, is_lower=0.5, is_upper=2.0, batch_normalize=normalise,
        rs=rs, rs_thresholds=thresholds, veto_threshold=1e-4, veto_upper=100.0, trm_max_k2=1e-6, trm_mean_k3=1e-6,
    )
    res = compute_correction(roll.clone(), roll, mask, cfg)
    assert torch.equal(res.is_weights, mask.to(res.is_weights.dtype))
    assert torch.equal(res.kept_mask, mask)
    m = metrics_to_floats(res.metrics)
    for key in ("kl", "k3_kl", "gen_kl", "policy_kl", "js_divergence", "chi2_token", "chi2_seq", "log_ppl_diff",
                "log_ppl_abs_diff", "prob_diff_max", "log_ratio_abs_mean", "rollout_rs_masked_fraction"):
        assert abs(m[f"rollout_corr/{key}"]) < 1e-12, key
    assert m["rollout_corr/token_mult_prob_error"] == 1.0 and m["rollout_corr/ppl_ratio"] == 1.0
    assert m["rollout_corr/rollout_is_eff_sample_size"] > 1 - 1e-6
    assert m["rollout_corr/prob_pearson"] > 1 - 1e-9 or m["rollout_corr/num_tokens"] == 1


@SETTINGS
@given(batches())
def test_sequence_weight_is_product_of_token_weights(data):
    old, roll, mask = data
    token = compute_correction(old, roll, mask, CorrectionConfig(is_level="token", is_upper=None)).is_weights
    seq = compute_correction(old, roll, mask, CorrectionConfig(is_level="sequence", is_upper=None)).is_weights
    prod = torch.where(mask, token, 1.0).prod(dim=-1, keepdim=True)
    expected = torch.where(mask, prod.expand_as(token), 0.0)
    torch.testing.assert_close(seq, expected, rtol=1e-9, atol=0)


@SETTINGS
@given(
    batches(),
    LEVELS,
    st.sampled_from([(None, 2.0, "truncate"), (0.5, 1.5, "mask"), (None, None, "truncate")]),
)
def test_batch_normalised_weights_have_mean_one(data, level, bounds):
    old, roll, mask = data
    lower, upper, mode = bounds
    cfg = CorrectionConfig(is_level=level, is_mode=mode, is_lower=lower, is_upper=upper, batch_normalize=True)
    res = compute_correction(old, roll, mask, cfg)
    w = res.is_weights
    factor = metrics_to_floats(res.metrics)["rollout_corr/rollout_is_batch_norm_factor"]
    if level == "token":
        mean = w[mask].mean().item()
    else:
        rows = mask.any(-1)
        mean = (w.sum(-1)[rows] / mask.sum(-1)[rows]).mean().item()
    if factor == 1.0 and mean == 0.0:  # everything masked out by IcePop: normalisation is a no-op
        return
    assert math.isclose(mean, 1.0, rel_tol=1e-9)


@SETTINGS
@given(batches(lr_range=0.0), st.sampled_from([1e4, -1e4]), LEVELS)
def test_extreme_log_ratios_stay_finite(data, extreme, level):
    old, roll, mask = data
    old, roll = old.float(), roll.float()
    if extreme > 0:  # π_old ≫ μ: μ tiny
        roll = torch.where(mask, torch.full_like(roll, -extreme), roll)
        old = torch.where(mask, torch.full_like(old, -0.5), old)
    else:  # π_old ≪ μ
        old = torch.where(mask, torch.full_like(old, extreme), old)
    roll = torch.where(mask, roll, -math.inf)  # −inf rollout log-probs on padding are ignored
    cfg = CorrectionConfig(is_level=level, is_upper=None, rs=("seq_sum_k3", "token_k1"), rs_thresholds=(1.0, 2.0),
                           veto_threshold=1e-4, trm_mean_k3=0.1)
    res = compute_correction(old, roll, mask, cfg)
    assert torch.isfinite(res.is_weights).all()
    for key, value in metrics_to_floats(res.metrics).items():
        assert math.isfinite(value), key
