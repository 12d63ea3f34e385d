"""verl's remaining policy losses (sapo, gpg, clip_cov, kl_cov, dppo_tv with its cap, dppo_kl, dro) and the
binary-KL rejection option, each against a float64 reference written here from verl's formula (verl core_algos.py,
core_algos.py) — loss value and d loss / d log_prob — plus edge cases and config errors."""

from __future__ import annotations

import math

import pytest
import torch

from rollcorr.compat.verl_losses import LOSS_MODES
from rollcorr.compat.verl_losses import policy_loss_by_mode as compute_policy_loss
from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.dialects import from_verl
from rollcorr.correction.api import compute_correction
from rollcorr.losses import LossConfig, policy_loss

NEW = ("sapo", "gpg", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro")


def make_batch(seed: int = 0, noise: float = 0.6, b: int = 5, t: int = 8):
    """float64 (B, T): old = log p_old with p_old ∈ (0.05, 0.95), log_prob = −|old + noise| − 1e-4,
    per-row advantages of both signs, ragged right padding, weights in (0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.empty(b, t, dtype=torch.float64).uniform_(0.05, 0.95, generator=g).log()
    logp = -(old + noise * torch.randn(b, t, generator=g, dtype=torch.float64)).abs() - 1e-4  # no ties
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    adv[0] = adv[0].abs() + 0.1
    adv[1] = -adv[1].abs() - 0.1
    lengths = torch.tensor([t, t - 3, 2, t - 1, 1, t // 2, t - 2, 3][:b])
    mask = torch.arange(t)[None] < lengths[:, None]
    w = torch.empty(b, t, dtype=torch.float64).uniform_(0.5, 1.5, generator=g)
    return logp, old, adv, mask, w


def token_mean(loss, mask):
    return torch.where(mask, loss, 0).sum() / mask.sum()


def seq_mean_token_mean(loss, mask):
    m = mask.double()
    rows = torch.where(mask, loss, 0).sum(-1) / (m.sum(-1) + 1e-8)
    return (rows * (m.sum(-1) > 0)).sum() / (m.sum(-1) > 0).sum()


def value_and_grad(fn, logp):
    x = logp.clone().requires_grad_()
    out = fn(x)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), x.grad, (out[1] if isinstance(out, tuple) else None)


def check(ours, ref, logp, rtol=1e-7, atol=1e-10):
    v1, g1, metrics = value_and_grad(ours, logp)
    v2, g2, _ = value_and_grad(ref, logp)
    torch.testing.assert_close(v1, v2, rtol=rtol, atol=atol)
    torch.testing.assert_close(g1, g2, rtol=rtol, atol=atol)
    return metrics


# ---- references (verl's formulas, written out) --------------------------------------------------------


def ref_sapo(lp, old, adv, mask, w, tau_pos=1.0, tau_neg=1.05):
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return seq_mean_token_mean(-gate * adv * w, mask)


def ref_dppo(lp, old, adv, mask, w, kind, lo=0.2, hi=0.2, cap=3.0):
    """verl: −A·sg(min(r, c))·log π·valid·w, valid from TV or binary KL."""
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    truncated = torch.clamp(ratio, max=cap).detach()
    p, p_old = torch.exp(lp).detach(), torch.exp(old)
    if kind == "tv":
        valid = torch.where(adv > 0, (p - p_old) <= hi, (p - p_old) >= -lo)
    else:
        bkl = p_old * (old - lp.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        valid = torch.where(adv > 0, (bkl <= hi) | (p <= p_old), (bkl <= lo) | (p >= p_old))
    return token_mean(-adv * truncated * lp * valid.double() * w, mask), valid, ratio.detach()


def ref_kl_cov(lp, old, adv, mask, w, ratio=2e-4, coef=0.1):
    """verl: flatten the valid tokens, cov with plain means, torch.topk, add coef·|Δ| there."""
    delta = lp - old
    loss = -adv * torch.exp(delta)
    loss_kl = loss + coef * delta.abs()
    idx = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    a, lps = adv[mask].reshape(-1), lp.detach()[mask].reshape(-1)
    cov = (a - a.mean()) * (lps - lps.mean())
    k = max(1, int(len(cov) * ratio))
    top = idx[torch.topk(cov, k).indices]
    rows, cols = top // lp.shape[1], top % lp.shape[1]
    sel = torch.zeros_like(mask)
    sel[rows, cols] = True
    return token_mean(torch.where(sel, loss_kl, loss) * w, mask), sel


def ref_clip_cov_candidates(lp, old, adv, mask, lb=1.0, ub=5.0, eps=0.2):
    """verl's candidate set: valid, not clipped by PPO, lb < cov < ub (masked means with +1e-8)."""
    m = mask.double()
    ratio = torch.exp(lp - old)
    clipped = (-adv * torch.clamp(ratio, 1 - eps, 1 + eps)) > (-adv * ratio)
    mean_a = (adv * m).sum() / (m.sum() + 1e-8)
    mean_l = (lp * m).sum() / (m.sum() + 1e-8)
    cov = (adv - mean_a) * (lp - mean_l)
    return mask & ~clipped & (cov > lb) & (cov < ub)


def ref_clip_cov(lp, old, adv, mask, w, zeroed, eps=0.2):
    ratio = torch.exp(lp - old)
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps))
    return token_mean(loss * (~zeroed).double() * w, mask)


# ---- losses vs references -------------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
def test_sapo_matches_verl(weighted):
    logp, old, adv, mask, w = make_batch(1)
    w = w if weighted else None
    ones = torch.ones_like(logp)
    cfg = LossConfig(name="sapo", sapo_tau_pos=0.9, sapo_tau_neg=1.3)
    m = check(
        lambda x: policy_loss(cfg, x, old, adv, mask, weights=w),
        lambda x: ref_sapo(x, old, adv, mask, ones if w is None else w, 0.9, 1.3),
        logp,
    )
    assert m["actor/pg_clipfrac"] == 0 and m["actor/pg_clipfrac_lower"] == 0
    # verl forces seq-mean-token-mean whatever loss_agg_mode says
    check(
        lambda x: compute_policy_loss("sapo", old, x, adv, mask, "token-mean", rollout_is_weights=w),
        lambda x: ref_sapo(x, old, adv, mask, ones if w is None else w),
        logp,
    )


def test_sapo_gradient_is_ppo_gradient_at_ratio_one():
    _, old, adv, mask, _ = make_batch(2)
    _, g, _ = value_and_grad(
        lambda x: policy_loss(LossConfig(name="sapo", agg="token-mean"), x, old, adv, mask), old
    )
    torch.testing.assert_close(g, torch.where(mask, -adv, 0) / mask.sum())  # 4σ'(0) = 1


def test_gpg_matches_verl():
    logp, old, adv, mask, w = make_batch(3)
    metrics = check(
        lambda x: policy_loss(LossConfig(name="gpg"), x, None, adv, mask, weights=w),
        lambda x: token_mean(-x * adv * w, mask),
        logp,
    )
    assert set(metrics) == {"actor/pg_loss", "actor/kept_token_fraction", "actor/all_rejected"}
    _, verl_metrics = compute_policy_loss("gpg", old, logp, adv, mask, "seq-mean-token-sum")
    assert verl_metrics == {}


@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dro_matches_verl(beta):
    logp, old, adv, mask, w = make_batch(4, noise=1.0)
    check(
        lambda x: policy_loss(LossConfig(name="dro", dro_beta=beta), x, old, adv, mask, weights=w),
        lambda x: token_mean(-(x * adv - 0.5 * beta * (x - old) ** 2) * w, mask),
        logp,
    )
    check(
        lambda x: compute_policy_loss("dro", old, x, adv, mask, dro_beta=beta, rollout_is_weights=w),
        lambda x: token_mean(-(x * adv - 0.5 * beta * (x - old) ** 2) * w, mask),
        logp,
    )


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_matches_verl_value_and_gradient(kind):
    logp, old, adv, mask, w = make_batch(5, noise=1.2)
    mode = f"dppo_{kind}"
    lo, hi = (0.15, 0.25) if kind == "tv" else (0.05, 0.08)
    _, valid, ratio = ref_dppo(logp.clone().requires_grad_(), old, adv, mask, w, kind, lo, hi, cap=1.5)
    assert (mask & ~valid).any() and (mask & valid).any(), "the batch must exercise the trust region"
    assert (mask & valid & (ratio > 1.5)).any(), "and the cap"
    metrics = check(
        lambda x: compute_policy_loss(
            mode, old, x, adv, mask, "token-mean", lo, hi, clip_ratio_c=1.5, rollout_is_weights=w
        ),
        lambda x: ref_dppo(x, old, adv, mask, w, kind, lo, hi, cap=1.5)[0],
        logp,
    )
    n = mask.sum().item()
    assert metrics["actor/pg_clipfrac"] == pytest.approx((mask & ~valid).sum().item() / n)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(
        (mask & valid & (ratio > 1.5)).sum().item() / n
    )
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}

    # rollcorr's value form −A·min(r, c)·keep·w has the same gradient
    cfg = LossConfig(name=mode, clip_low=lo, clip_high=hi, clip_c=1.5)
    v, g, _ = value_and_grad(lambda x: policy_loss(cfg, x, old, adv, mask, weights=w), logp)
    _, g_ref, _ = value_and_grad(lambda x: ref_dppo(x, old, adv, mask, w, kind, lo, hi, cap=1.5)[0], logp)
    torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(v, token_mean(-adv * ratio.clamp(max=1.5) * valid * w, mask))


def test_dppo_kl_keeps_moves_away_from_the_advantage_direction():
    """verl's binary-KL region only bounds moves in the advantage's direction: p_θ ≤ p_old is always kept
    for A > 0, p_θ ≥ p_old for A ≤ 0, however large the divergence."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    logp = torch.log(torch.tensor([[0.01, 0.99, 0.01, 0.99]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    _, m = policy_loss(LossConfig(name="dppo_kl", clip_low=0.05, clip_high=0.05), logp, old, adv, mask)
    assert m["actor/dppo_masked_high"].item() == 0.25 and m["actor/dppo_masked_low"].item() == 0.25


def test_dppo_tv_without_cap_is_unchanged():
    """clip_c=None keeps prime-rl's value −A·r·keep (the pre-existing rollcorr behaviour)."""
    logp, old, adv, mask, _ = make_batch(6, noise=1.2)
    ones = torch.ones_like(logp)
    _, valid, ratio = ref_dppo(logp.clone().requires_grad_(), old, adv, mask, ones, "tv", cap=math.inf)
    v, g, m = value_and_grad(lambda x: policy_loss(LossConfig(name="dppo_tv"), x, old, adv, mask), logp)
    torch.testing.assert_close(v, token_mean(-adv * ratio * valid, mask))
    torch.testing.assert_close(g, torch.where(mask & valid, -adv * ratio, 0) / mask.sum())
    assert m["actor/pg_clipfrac_lower"] == 0


@pytest.mark.parametrize(("ratio", "coef"), [(2e-4, 0.1), (0.1, 1.0)])
def test_kl_cov_matches_verl(ratio, coef):
    logp, old, adv, mask, w = make_batch(7, b=6, t=40)
    _, sel = ref_kl_cov(logp.clone().requires_grad_(), old, adv, mask, w, ratio, coef)
    assert sel.sum() == max(1, int(mask.sum().item() * ratio))
    cfg = LossConfig(name="kl_cov", kl_cov_ratio=ratio, kl_cov_coef=coef)
    metrics = check(
        lambda x: policy_loss(cfg, x, old, adv, mask, weights=w),
        lambda x: ref_kl_cov(x, old, adv, mask, w, ratio, coef)[0],
        logp,
    )
    assert metrics["actor/ppo_kl"].item() == pytest.approx(((logp - old).abs()[mask]).mean().item())
    check(
        lambda x: compute_policy_loss(
            "kl_cov", old, x, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef, rollout_is_weights=w
        ),
        lambda x: ref_kl_cov(x, old, adv, mask, w, ratio, coef)[0],
        logp,
    )


def _clip_cov_batch():
    """Advantages spread enough that many tokens have covariance in (1, 5)."""
    logp, old, adv, mask, w = make_batch(8, noise=0.1, b=6, t=40)
    adv = adv * 4
    cand = ref_clip_cov_candidates(logp, old, adv, mask)
    assert cand.sum() >= 10
    return logp, old, adv, mask, w, cand


def test_clip_cov_zeroes_every_candidate_when_few_qualify():
    """With clip_num ≥ #candidates verl's draw is deterministic: every candidate's loss is zeroed."""
    logp, old, adv, mask, w, cand = _clip_cov_batch()
    cfg = LossConfig(name="clip_cov", clip_cov_ratio=1.0)
    metrics = check(
        lambda x: policy_loss(cfg, x, old, adv, mask, weights=w),
        lambda x: ref_clip_cov(x, old, adv, mask, w, cand),
        logp,
    )
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(cand.sum().item() / mask.sum().item())


def test_clip_cov_draw_is_a_reproducible_subset_of_the_candidates():
    logp, old, adv, mask, w, cand = _clip_cov_batch()
    n = mask.sum().item()
    ratio = 4.5 / n  # clip_num = 4 < #candidates
    cfg = LossConfig(name="clip_cov", clip_cov_ratio=ratio, clip_cov_seed=3)
    zeroed_sets = []
    for seed in (3, 3, 4):
        gen = torch.Generator().manual_seed(seed)
        _, m = policy_loss(cfg, logp, old, adv, mask, weights=w, generator=gen)
        assert m["actor/pg_clipfrac"].item() == pytest.approx(4 / n)
        # recover the zeroed set: the tokens whose gradient vanished although they are valid
        x = logp.clone().requires_grad_()
        policy_loss(cfg, x, old, adv, mask, weights=w, generator=torch.Generator().manual_seed(seed))[
            0
        ].backward()
        ppo_clipped = mask & ~ref_clip_cov_candidates(logp, old, adv, mask, lb=-math.inf, ub=math.inf)
        zeroed = mask & (x.grad == 0) & ~ppo_clipped
        assert zeroed.sum() == 4 and not (zeroed & ~cand).any()
        check(
            lambda y, s=seed: policy_loss(
                cfg, y, old, adv, mask, weights=w, generator=torch.Generator().manual_seed(s)
            ),
            lambda y, z=zeroed: ref_clip_cov(y, old, adv, mask, w, z),
            logp,
        )
        zeroed_sets.append(zeroed)
    assert torch.equal(zeroed_sets[0], zeroed_sets[1])
    assert not torch.equal(zeroed_sets[0], zeroed_sets[2])
    # clip_cov_seed alone (no generator) is reproducible too
    a = policy_loss(cfg, logp, old, adv, mask)[0]
    b = policy_loss(cfg, logp, old, adv, mask)[0]
    assert a.item() == b.item()


def test_compat_clip_cov_and_modes():
    logp, old, adv, mask, w, cand = _clip_cov_batch()
    loss, metrics = compute_policy_loss(
        "clip_cov", old, logp, adv, mask, clip_cov_ratio=1.0, rollout_is_weights=w
    )
    torch.testing.assert_close(loss, ref_clip_cov(logp, old, adv, mask, w, cand))
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl"}
    assert set(NEW) <= set(LOSS_MODES)
    for mode, key in (("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio"), ("dro", "dro_beta")):
        with pytest.raises(ValueError, match=key):
            compute_policy_loss(mode, old, logp, adv, mask, **{key: 0.0})


# ---- edge cases -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW)
def test_all_masked_gives_zero_loss_and_zero_gradient(name):
    logp, old, adv, mask, w = make_batch(9)
    x = logp.clone().requires_grad_()
    empty = torch.zeros_like(mask)
    loss, metrics = policy_loss(LossConfig(name=name), x, old, adv, empty, weights=w)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
    assert metrics["actor/all_rejected"].item() == 1.0


@pytest.mark.parametrize("name", NEW)
def test_nan_on_padding_never_leaks_and_nan_on_valid_tokens_raises(name):
    logp, old, adv, mask, w = make_batch(10)
    bad = old.clone()
    bad[~mask] = float("nan")
    x = logp.clone().requires_grad_()
    loss, _ = policy_loss(LossConfig(name=name), x, bad, adv, mask, weights=w)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))
    if name == "gpg":  # gpg does not read old_log_prob: corrupt log_prob instead
        bad_lp = logp.clone()
        bad_lp[0, 0] = float("nan")
        with pytest.raises(ValueError, match="log_prob has NaN"):
            policy_loss(LossConfig(name=name), bad_lp, old, adv, mask)
        return
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="old_log_prob has NaN"):
        policy_loss(LossConfig(name=name), logp, bad, adv, mask)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sapo_tau_pos", 0.0),
        ("sapo_tau_neg", -1.0),
        ("sapo_tau_pos", math.inf),
        ("dro_beta", 0.0),
        ("kl_cov_coef", -0.1),
        ("clip_cov_ratio", 0.0),
        ("clip_cov_ratio", 1.5),
        ("kl_cov_ratio", 0.0),
        ("clip_cov_lb", 6.0),
        ("clip_cov_ub", math.nan),
        ("clip_cov_seed", 1.5),
        ("clip_cov_seed", True),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
        LossConfig(name="clip_cov", **{field: value})


def test_config_defaults_follow_verl():
    assert LossConfig(name="sapo").agg_mode == "seq-mean-token-mean"
    assert (LossConfig(name="dppo_kl").eps_low, LossConfig(name="dppo_kl").eps_high) == (0.2, 0.2)
    c = LossConfig(name="clip_cov")
    assert (c.eps_low, c.clip_cov_ratio, c.clip_cov_lb, c.clip_cov_ub) == (0.2, 2e-4, 1.0, 5.0)
    k, s = LossConfig(name="kl_cov"), LossConfig(name="sapo")  # each loss's own options, from its LossSpec
    assert (k.kl_cov_ratio, k.kl_cov_coef, s.sapo_tau_pos, s.sapo_tau_neg) == (2e-4, 0.1, 1.0, 1.05)
    assert LossConfig(name="dro").dro_beta == 0.1 and c.kl_cov_ratio is None  # not a clip_cov option


# ---- binary-KL rejection ---------------------------------------------------------------------------------


def ref_binary_kl(log_p, log_q, eps=1e-8):
    p, q = log_p.exp().clamp(eps, 1 - eps), log_q.exp().clamp(eps, 1 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _between(values):
    """A threshold halfway between the two middle values: some kept, some rejected, none on the edge."""
    v = values.sort().values
    i = len(v) // 2
    return ((v[i - 1] + v[i]) / 2).item()


@pytest.mark.parametrize("level", ["token", "seq_sum", "seq_mean", "seq_max"])
def test_binary_kl_rejection_matches_areal(level):
    _, old, _, mask, _ = make_batch(11, b=6, t=10)
    roll = (
        old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    ).clamp(max=-1e-6)
    stat = torch.maximum(ref_binary_kl(old, roll), ref_binary_kl(roll, old))
    stat = torch.where(mask, stat, 0)
    if level == "token":
        u = _between(stat[mask])
        keep = stat <= u
    else:
        n = mask.sum(-1)
        row = {
            "seq_sum": stat.sum(-1),
            "seq_mean": stat.sum(-1) / n.clamp_min(1),
            "seq_max": torch.where(mask, stat, -math.inf).amax(-1).clamp_min(0),
        }[level]
        u = _between(row)
        keep = (row <= u)[:, None].expand_as(mask)
    expected = mask & keep
    assert (mask & ~expected).any() and expected.any()
    res = compute_correction(old, roll, mask, CorrectionConfig(rs=(f"{level}_binary_kl",), rs_thresholds=u))
    assert torch.equal(res.kept_mask.bool(), expected)
    m = res.metrics
    key = f"rollout_rs_{level}_binary_kl"
    assert m[f"rollout_corr/{key}_masked_fraction"].item() == pytest.approx(
        (mask & ~expected).sum().item() / mask.sum().item()
    )
    if level == "token":
        assert m[f"rollout_corr/{key}_max"].item() == pytest.approx(stat[mask].max().item())


def test_binary_kl_is_zero_for_equal_policies_and_finite_near_probability_one():
    old = torch.tensor([[0.0, -1e-9, -0.5, -3.0], [-2.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    res = compute_correction(
        old, old.clone(), mask, CorrectionConfig(rs=("token_binary_kl",), rs_thresholds=1e-12)
    )
    assert torch.equal(res.kept_mask, mask)
    roll = old - 0.3 * mask  # a token of probability 1 under π_old, 0.74 under μ: finite statistic
    res = compute_correction(old, roll, mask, CorrectionConfig(rs=("seq_max_binary_kl",), rs_thresholds=10.0))
    assert all(math.isfinite(v.item()) for v in res.metrics.values())
    assert torch.equal(res.kept_mask, mask)


def test_binary_kl_config():
    c = CorrectionConfig(rs="token_k1,seq_mean_binary_kl", rs_thresholds="2.0,0.02")
    assert c.rs_thresholds == ((0.5, 2.0), 0.02)
    with pytest.raises(ValueError, match="single upper bound"):
        CorrectionConfig(rs=("token_binary_kl",), rs_thresholds=("0.1_0.2",))
    with pytest.raises(ValueError, match="rs option"):
        CorrectionConfig(rs=("seq_min_binary_kl",), rs_thresholds=(0.1,))
    with pytest.raises(ValueError, match="not verl options"):
        from_verl({"rollout_rs": "token_binary_kl", "rollout_rs_threshold": 0.1})


def test_binary_kl_rejects_if_either_direction_exceeds_the_bound():
    """p_old = 0.999, μ = 0.5: KL_b(p_old‖μ) = 0.685 but KL_b(μ‖p_old) = 2.76; and the mirror case."""
    old = torch.tensor([[0.999, 0.5, 0.6]], dtype=torch.float64).log()
    roll = torch.tensor([[0.5, 0.999, 0.62]], dtype=torch.float64).log()
    mask = torch.ones_like(old, dtype=torch.bool)
    assert ref_binary_kl(old, roll)[0, 0] < 1.0 < ref_binary_kl(roll, old)[0, 0]
    res = compute_correction(old, roll, mask, CorrectionConfig(rs=("token_binary_kl",), rs_thresholds=1.0))
    assert res.kept_mask.tolist() == [[False, False, True]]
