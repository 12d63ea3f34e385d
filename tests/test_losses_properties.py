"""Property tests (hypothesis) tying the loss variants together."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcorr.losses import LossConfig, policy_loss


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is far faster than two on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SETTINGS = settings(deadline=None, max_examples=25)


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    noise = draw(st.floats(0.0, 2.0))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mu = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 4
    old = mu + noise * torch.randn(b, t, generator=gen, dtype=torch.float64)
    logp = old + noise * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    return logp, old, mu, adv, mask


def loss_and_grad(cfg, logp, *args, **kwargs):
    logp = logp.clone().requires_grad_()
    loss, _ = policy_loss(cfg, logp, *args, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad


agg_modes = st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])


@SETTINGS
@given(batches(), agg_modes, st.sampled_from(["vanilla_is", "tis", "areal"]))
def test_identical_policies_make_decoupled_equal_plain_ppo(batch, agg, name):
    logp, _, _, adv, mask = batch
    same = logp.detach()
    decoupled = loss_and_grad(LossConfig(name=name, agg=agg), logp, same, adv, mask, rollout_log_prob=same)
    plain = loss_and_grad(LossConfig(name="ppo_clip", agg=agg), logp, same, adv, mask)
    torch.testing.assert_close(decoupled, plain)


@SETTINGS
@given(batches(), agg_modes)
def test_bypass_ppo_clip_equals_decoupled_when_old_is_rollout(batch, agg):
    logp, _, mu, adv, mask = batch
    bypass = loss_and_grad(LossConfig(name="ppo_clip", agg=agg), logp, mu, adv, mask)
    decoupled = loss_and_grad(
        LossConfig(name="vanilla_is", agg=agg), logp, mu, adv, mask, rollout_log_prob=mu
    )
    ppo_is = loss_and_grad(LossConfig(name="ppo_is", agg=agg), logp, None, adv, mask, rollout_log_prob=mu)
    torch.testing.assert_close(bypass, decoupled)
    torch.testing.assert_close(bypass, ppo_is)


@SETTINGS
@given(batches(), st.sampled_from(["kept", "original", "batch"]))
def test_untruncated_token_is_reinforce_has_gradient_of_is_objective(batch, denominator):
    logp, _, mu, adv, mask = batch
    kept = mask.clone()
    kept[:, 0] = False  # some rejection, so the denominator policy matters
    cfg = LossConfig(name="reinforce", denominator=denominator)
    w = torch.exp(logp - mu).detach()
    _, grad = loss_and_grad(cfg, logp, mu, adv, kept, weights=w, denominator_mask=mask)
    # reference: autograd of −A·π_θ/μ aggregated the same way (token-mean, same denominator)
    ref_logp = logp.clone().requires_grad_()
    objective = -adv * torch.exp(ref_logp - mu)
    n = (kept if denominator == "kept" else mask).sum().clamp_min(1)
    (torch.where(kept, objective, torch.zeros_like(objective)).sum() / n).backward()
    torch.testing.assert_close(grad, ref_logp.grad)


@SETTINGS
@given(
    batches(), st.sampled_from(["ppo_clip", "tis", "reinforce", "cispo", "gspo", "gmpo", "dppo_tv", "areal"])
)
def test_rejected_tokens_have_zero_gradient(batch, name):
    logp, old, mu, adv, mask = batch
    gen = torch.Generator().manual_seed(int(mask.sum()))
    kept = mask & (torch.rand(mask.shape, generator=gen) < 0.6)
    _, grad = loss_and_grad(
        LossConfig(name=name, denominator="original"),
        logp,
        old,
        adv,
        kept,
        rollout_log_prob=mu,
        denominator_mask=mask,
    )
    assert torch.equal(grad[~kept], torch.zeros_like(grad[~kept]))
    assert torch.isfinite(grad).all()


@SETTINGS
@given(
    batches(),
    st.sampled_from(["ppo_clip", "tis", "reinforce", "cispo", "gspo", "gmpo", "dppo_tv", "areal", "ppo_is"]),
    st.sampled_from([1e4, -1e4]),
)
def test_extreme_log_ratios_give_finite_loss_and_grad(batch, name, shift):
    logp, old, mu, adv, mask = batch
    logp = old + shift
    loss, grad = loss_and_grad(LossConfig(name=name), logp, old, adv, mask, rollout_log_prob=old - shift)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
