"""Policy losses, aggregation and the denominator policy (rollcorr.losses)."""

from __future__ import annotations

import math

import pytest
import torch

from rollcorr.losses import (
    AGG_MODES,
    LOSS_NAMES,
    LossConfig,
    aggregate,
    gspo_loss,
    oapl_loss,
    policy_loss,
    ppo_clip_loss,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is far faster than two on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


B, T = 6, 9


def make_batch(seed: int = 0, dtype=torch.float64, noise: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 5, 1, 7, 3, 8])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rollout = -torch.rand(B, T, generator=gen, dtype=dtype) * 3 - 0.05
    old = rollout + noise * torch.randn(B, T, generator=gen, dtype=dtype)
    logp = (old + noise * torch.randn(B, T, generator=gen, dtype=dtype)).clamp(max=-1e-3)
    adv = torch.randn(B, generator=gen, dtype=dtype)[:, None].expand(B, T).clone()
    rewards = torch.randint(0, 2, (B,), generator=gen).to(dtype)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    return logp, old, rollout, adv, mask, rewards, groups


def call(name: str, logp, old, rollout, adv, mask, rewards, groups, **config):
    cfg = LossConfig(name=name, **config)
    return policy_loss(cfg, logp, old, adv, mask, rollout_log_prob=rollout, rewards=rewards, group_ids=groups)


# ----------------------------------------------------------------------------------------------- aggregation


def test_aggregation_modes_match_hand_formulas():
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(B, T, generator=gen, dtype=torch.float64)
    _, _, _, _, mask, _, _ = make_batch()
    m = mask.double()
    rows = (loss * m).sum(-1)
    n_rows = (m.sum(-1) > 0).sum()
    expected = {
        "token-mean": rows.sum() / m.sum(),
        "token-sum": rows.sum(),
        "seq-mean-token-sum": rows.sum() / n_rows,
        "seq-mean-token-mean": (rows / m.sum(-1)).sum() / n_rows,
        "seq-mean-token-sum-norm": rows.sum() / n_rows / T,
    }
    assert set(expected) == set(AGG_MODES)
    for mode, value in expected.items():
        torch.testing.assert_close(aggregate(loss, mask, mode), value, msg=mode)
    torch.testing.assert_close(
        aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=4.0), rows.sum() / n_rows / 4.0
    )


def test_denominator_policies_after_rejection():
    gen = torch.Generator().manual_seed(2)
    loss = torch.randn(B, T, generator=gen, dtype=torch.float64)
    _, _, _, _, original, _, _ = make_batch()
    kept = original.clone()
    kept[1] = False  # a rejected sequence
    kept[0, 4:] = False  # rejected tokens
    m, m0 = kept.double(), original.double()
    num = (loss * m).sum()
    got = {
        d: aggregate(loss, kept, "token-mean", denominator=d, denominator_mask=original)
        for d in ("kept", "original", "batch")
    }
    torch.testing.assert_close(got["kept"], num / m.sum())
    torch.testing.assert_close(got["original"], num / m0.sum())
    torch.testing.assert_close(got["batch"], num / m0.sum())
    rows = (loss * m).sum(-1)
    seq = {
        d: aggregate(loss, kept, "seq-mean-token-sum", denominator=d, denominator_mask=original)
        for d in ("kept", "original", "batch")
    }
    torch.testing.assert_close(seq["kept"], rows.sum() / 5)
    torch.testing.assert_close(seq["original"], rows.sum() / 6)
    torch.testing.assert_close(seq["batch"], rows.sum() / B)
    per_row = aggregate(loss, kept, "seq-mean-token-mean", denominator="original", denominator_mask=original)
    torch.testing.assert_close(per_row, (rows / m0.sum(-1)).sum() / 6)
    # an all-padding row counts for `batch` only
    padded_kept, padded_orig = kept.clone(), original.clone()
    padded_kept[2] = padded_orig[2] = False
    both = [
        aggregate(loss, padded_kept, "seq-mean-token-sum", denominator=d, denominator_mask=padded_orig)
        for d in ("original", "batch")
    ]
    rows = (loss * padded_kept.double()).sum(-1).sum()
    torch.testing.assert_close(both[0], rows / 5)
    torch.testing.assert_close(both[1], rows / 6)


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("denominator", ["kept", "original", "batch"])
def test_everything_rejected_gives_exact_zero_and_zero_grad(name, denominator):
    logp, old, rollout, adv, mask, rewards, groups = make_batch()
    logp = logp.clone().requires_grad_()
    kept = torch.zeros_like(mask)
    cfg = LossConfig(name=name, denominator=denominator)
    loss, metrics = policy_loss(
        cfg,
        logp,
        old,
        adv,
        kept,
        rollout_log_prob=rollout,
        denominator_mask=mask,
        rewards=rewards,
        group_ids=groups,
    )
    loss.backward()
    assert loss.item() == 0.0 and not math.isnan(loss.item())
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert metrics["actor/all_rejected"].item() == 1.0
    assert metrics["actor/kept_token_fraction"].item() == 0.0


# ----------------------------------------------------------------------------------------------- formulas


def test_ppo_clip_matches_textbook_formula_with_dual_clip():
    logp, old, _, adv, mask, _, _ = make_batch(noise=0.6)
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    r = torch.exp(logp - old)
    expected = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.28))
    expected = torch.where(adv < 0, torch.minimum(expected, -adv * 3.0), expected)
    torch.testing.assert_close(loss, expected)
    clipped = ((-adv * r.clamp(0.8, 1.28)) > (-adv * r)) & mask
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(clipped.sum().item() / mask.sum().item())
    assert 0 < metrics["actor/pg_clipfrac"].item() < 1


def test_tis_vanilla_is_and_areal_weights():
    logp, old, rollout, adv, mask, rewards, groups = make_batch(noise=0.8)
    rho = torch.exp(old - rollout)
    plain, _ = ppo_clip_loss(logp, old, adv, mask)
    m = mask.double()

    def mean(x):
        return (x * m).sum() / m.sum()

    vanilla, _ = call("vanilla_is", logp, old, rollout, adv, mask, rewards, groups)
    torch.testing.assert_close(vanilla, mean(plain * rho))
    tis, _ = call("tis", logp, old, rollout, adv, mask, rewards, groups, tis_cap=1.5)
    torch.testing.assert_close(tis, mean(plain * rho.clamp(max=1.5)))
    assert (rho[mask] > 1.5).any() and (rho[mask] < 1.0).any()  # the test exercises both sides
    areal, metrics = call("areal", logp, old, rollout, adv, mask, rewards, groups, areal_cap=1.5)
    w = torch.where(rho <= 1.5, rho, torch.zeros_like(rho))
    torch.testing.assert_close(areal, mean(plain * w))  # capped tokens stay in the denominator
    assert metrics["actor/areal_capped_fraction"].item() == pytest.approx(
        ((rho > 1.5) & mask).sum().item() / mask.sum().item()
    )
    ppo_is, _ = call("ppo_is", logp, old, rollout, adv, mask, rewards, groups)
    plain_mu, _ = ppo_clip_loss(logp, rollout, adv, mask)
    torch.testing.assert_close(ppo_is, mean(plain_mu))


def test_cispo_gradient_is_clipped_ratio_times_advantage():
    logp, old, _, adv, mask, rewards, groups = make_batch(noise=0.7)
    logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(LossConfig(name="cispo", clip_low=0.2, clip_high=0.2), logp, old, adv, mask)
    loss.backward()
    r = torch.exp(logp.detach() - old).clamp(0.8, 1.2)
    expected = torch.where(mask, -r * adv, torch.zeros_like(r)) / mask.sum()
    torch.testing.assert_close(logp.grad, expected)
    assert metrics["actor/pg_clipfrac"].item() > 0


def test_gspo_forward_value_is_sequence_ratio_and_default_aggregation():
    logp, old, _, adv, mask, _, _ = make_batch(noise=0.01)
    loss_mat, _ = gspo_loss(logp, old, adv, mask, clip_low=1.0, clip_high=1.0)  # wide clip: no clipping
    m = mask.double()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    torch.testing.assert_close(loss_mat, -adv * s[:, None])
    assert LossConfig(name="gspo").agg_mode == "seq-mean-token-mean"
    assert (LossConfig(name="gspo").eps_low, LossConfig(name="gspo").eps_high) == (3e-4, 4e-4)


def test_gmpo_per_sequence_geometric_mean():
    logp, old, _, adv, mask, rewards, groups = make_batch(noise=0.1)
    loss, _ = call("gmpo", logp, old, None, adv, mask, rewards, groups, clip_low=10.0, clip_high=10.0)
    m = mask.double()
    ratio = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    per_seq = -adv[:, 0] * ratio
    torch.testing.assert_close(loss, per_seq.mean(), rtol=1e-7, atol=1e-9)


def test_dppo_tv_masks_by_probability_difference():
    logp, old, _, adv, mask, _, _ = make_batch(noise=0.9)
    logp = logp.clone().requires_grad_()
    cfg = LossConfig(name="dppo_tv", clip_low=0.05, clip_high=0.05)
    loss, metrics = policy_loss(cfg, logp, old, adv, mask)
    loss.backward()
    dp = torch.exp(logp.detach()) - torch.exp(old)
    masked = ((adv > 0) & (dp > 0.05)) | ((adv <= 0) & (dp < -0.05))
    assert (masked & mask).any() and (~masked & mask).any()
    r = torch.exp(logp.detach() - old)
    expected = torch.where(mask & ~masked, -adv * r, torch.zeros_like(r)) / mask.sum()
    torch.testing.assert_close(logp.grad, expected)
    assert metrics["actor/dppo_masked_fraction"].item() == pytest.approx(
        (masked & mask).sum().item() / mask.sum().item()
    )


def _oapl_reference(logp, mu, rewards, groups, mask, beta, beta1):
    """OAPL written out with Python loops, independently of rollcorr."""
    losses = []
    for i in range(len(rewards)):
        members = [j for j in range(len(rewards)) if groups[j] == groups[i]]
        value = beta1 * math.log(sum(math.exp(float(rewards[j]) / beta1) for j in members) / len(members))
        log_ratio = sum(logp[i, t] - mu[i, t] for t in range(logp.shape[1]) if mask[i, t])
        losses.append((beta * log_ratio - (float(rewards[i]) - value)) ** 2)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("beta,beta1", [(0.1, None), (0.05, 0.5), (1.0, 2.0)])
def test_oapl_loss_and_gradient_match_independent_formula(beta, beta1):
    logp, _, mu, _, mask, rewards, groups = make_batch(seed=3)
    rewards = rewards + torch.linspace(0, 0.3, B, dtype=rewards.dtype)
    a = logp.clone().requires_grad_()
    b = logp.clone().requires_grad_()
    loss, metrics = policy_loss(
        LossConfig(name="oapl", oapl_beta=beta, oapl_beta1=beta1),
        a,
        None,
        None,
        mask,
        rollout_log_prob=mu,
        rewards=rewards,
        group_ids=groups,
    )
    ref = _oapl_reference(b, mu, rewards, groups, mask, beta, beta if beta1 is None else beta1)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(a.grad, b.grad)
    assert a.grad.abs().sum() > 0


def test_oapl_soft_value_limits():
    logp, _, mu, _, mask, _, groups = make_batch(seed=4)
    rewards = torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, -1.0], dtype=torch.float64)
    # β₁ → inf: plain mean; tiny β₁: max. Pred = 0 when log π = log μ, so ℓ = target².
    _, m_inf = oapl_loss(mu, mu, rewards, groups, mask, beta=1.0, beta1=math.inf)
    torch.testing.assert_close(m_inf["actor/oapl_value_mean"], torch.tensor(0.75, dtype=torch.float64))
    _, m_max = oapl_loss(mu, mu, rewards, groups, mask, beta=1.0, beta1=1e-4)
    torch.testing.assert_close(
        m_max["actor/oapl_value_mean"], torch.tensor(1.5, dtype=torch.float64), atol=1e-3, rtol=0
    )  # β₁·log(count of maxima / n) ≈ 1e-4 below the max


# ----------------------------------------------------------------------------------------------- robustness


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_padding_garbage_never_leaks_and_rejected_tokens_get_zero_grad(name):
    logp, old, rollout, adv, mask, rewards, groups = make_batch(seed=5)
    kept = mask.clone()
    kept[0, 2:5] = False
    kept[3] = False
    logp = torch.where(mask, logp, torch.full_like(logp, float("nan"))).requires_grad_()
    old = torch.where(mask, old, torch.full_like(old, -float("inf")))
    loss, _ = policy_loss(
        LossConfig(name=name, denominator="original"),
        logp,
        old,
        adv,
        kept,
        rollout_log_prob=rollout,
        denominator_mask=mask,
        rewards=rewards,
        group_ids=groups,
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[~kept], torch.zeros_like(logp.grad[~kept]))
    assert logp.grad[kept].abs().sum() > 0


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_log_ratios_stay_finite(name, sign):
    logp, old, rollout, adv, mask, rewards, groups = make_batch(seed=6)
    logp = (old + sign * 1e4 * torch.ones_like(old)).requires_grad_()
    rollout = old - sign * 1e4
    loss, metrics = call(name, logp, old, rollout, adv, mask, rewards, groups, oapl_beta=1e-3)
    loss.backward()
    assert torch.isfinite(loss), name
    assert torch.isfinite(logp.grad).all(), name
    assert all(torch.isfinite(v).all() for v in metrics.values()), name


def test_config_validation_names_the_field():
    for kwargs, field in [
        ({"name": "ppo"}, "name"),
        ({"agg": "mean"}, "agg"),
        ({"denominator": "all"}, "denominator"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": float("nan")}, "clip_high"),
        ({"clip_c": 1.0}, "clip_c"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"oapl_beta": 0.0}, "oapl_beta"),
        ({"norm_constant": -1.0}, "norm_constant"),
    ]:
        with pytest.raises(ValueError, match=field):
            LossConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown field"):
        LossConfig.from_dict({"name": "tis", "cap": 2})
    assert LossConfig.from_dict({"name": "tis", "tis_cap": 3.0}).tis_cap == 3.0


def test_bad_inputs_raise_clear_errors():
    logp, old, rollout, adv, mask, _, _ = make_batch()
    cfg = LossConfig()
    with pytest.raises(ValueError, match="old_log_prob has shape"):
        policy_loss(cfg, logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="NaN"):
        policy_loss(cfg, torch.full_like(logp, float("nan")), old, adv, mask)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        policy_loss(LossConfig(name="tis"), logp, old, adv, mask)
    with pytest.raises(ValueError, match="do not pass weights"):
        policy_loss(
            LossConfig(name="tis"),
            logp,
            old,
            adv,
            mask,
            rollout_log_prob=rollout,
            weights=torch.ones_like(logp),
        )
    with pytest.raises(ValueError, match="rewards"):
        policy_loss(LossConfig(name="oapl"), logp, old, None, mask, rollout_log_prob=rollout)
    with pytest.raises(ValueError, match="denominator_mask"):
        policy_loss(cfg, logp, old, adv, mask, denominator_mask=torch.zeros_like(mask))


def test_one_dimensional_advantages_broadcast():
    logp, old, _, adv, mask, _, _ = make_batch()
    full, _ = policy_loss(LossConfig(), logp, old, adv, mask)
    per_seq, _ = policy_loss(LossConfig(), logp, old, adv[:, 0], mask)
    torch.testing.assert_close(full, per_seq)
