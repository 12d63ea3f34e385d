"""PPO-style clipped losses: ppo_clip (+ dual clip), clip_cov and kl_cov (covariance-selected tokens).

ppo_clip     L = max(−A·r, −A·clip(r, 1−ε_lo, 1+ε_hi)); dual clip (A<0): min(L, −A·c); times w
clip_cov     PPO clip (no dual clip) with the loss of a few random high-covariance tokens zeroed; · w
kl_cov       L = −A·r · w, + ppo_kl_coef·|Δ| on the top-k tokens by covariance
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollcorr.config.correction import LOG_RATIO_CLAMP
from rollcorr.losses.common import clamped_ratio, detached, masked_mean, ppo_surrogates
from rollcorr.losses.registry import (
    LossConfig,
    LossInputs,
    LossResult,
    LossSpec,
    VerlCall,
    VerlResult,
    register_loss,
)


def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip (+ dual clip), times detached weights w. Returns per-token loss (B, T) and metrics.

    L1 = −A·r, L2 = −A·clip(r, 1−ε_lo, 1+ε_hi), L = max(L1, L2); for A<0 and c given: min(L, −A·c).
    """
    delta, ratio = clamped_ratio(log_prob, old_log_prob)
    loss1, loss2 = ppo_surrogates(advantages, ratio, clip_low, clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss = clipped
    lower = torch.zeros_like(clipped, dtype=torch.bool)
    if clip_c is not None:
        loss3 = -advantages * clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss3, clipped), clipped)
        lower = (clipped > loss3) & (advantages < 0)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss2 > loss1).to(delta.dtype), kept_mask),
        "actor/ppo_kl": masked_mean(-delta, kept_mask),
        "actor/pg_clipfrac_lower": masked_mean(lower.to(delta.dtype), kept_mask),
    }
    return loss, detached(metrics)


def _smallest_k(keys: Tensor, k: Tensor) -> Tensor:
    """(B, T) bool: the ``k`` (0-d integer tensor) positions with the smallest keys; no host sync."""
    flat = keys.flatten()
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(flat.numel(), device=flat.device)
    return (rank < k).view_as(keys)


def _covariance(advantages: Tensor, log_prob: Tensor, mask: Tensor, count_eps: float = 0.0) -> Tensor:
    """cov_t = (A_t − mean A)·(log π_θ,t − mean log π_θ), means Σ v·m / (Σ m + count_eps) over valid
    tokens, the eps added in the dtype of Σ m (verl's masked_mean: 1e-8); detached (B, T)."""
    lp = log_prob.detach()
    if not count_eps:
        valid = mask.bool()
        return (advantages - masked_mean(advantages, valid)) * (lp - masked_mean(lp, valid))
    count = mask.sum()
    count = (count if count.is_floating_point() else count.to(torch.get_default_dtype())) + count_eps

    def mean(v: Tensor) -> Tensor:
        return torch.where(mask.bool(), v, torch.zeros_like(v)).sum() / count.to(v.dtype)

    return (advantages - mean(advantages)) * (lp - mean(lp))


def _log_ratio(log_prob: Tensor, old_log_prob: Tensor, clamp: float | None) -> tuple[Tensor, Tensor]:
    """(Δ = log π − log π_old, clamped to ±clamp unless None, exp(Δ))."""
    if clamp == LOG_RATIO_CLAMP:
        return clamped_ratio(log_prob, old_log_prob)
    delta = log_prob - old_log_prob
    delta = delta if clamp is None else torch.clamp(delta, -clamp, clamp)
    return delta, torch.exp(delta)


def _count_share(mask: Tensor, share: float) -> Tensor:
    """max(⌊share · Σ m⌋, 1) as a 0-d int64 tensor (float64 product, as Python's int(share · n))."""
    n = mask.sum().to(torch.float64)
    return torch.floor(n * share).clamp_min(1).to(torch.int64)


def clip_cov_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    weights: Tensor | None = None,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
    count_eps: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl `clip_cov`).

    L_t = max(−A·r, −A·clip(r, 1−ε_lo, 1+ε_hi))·corr_t·w     (no dual clip)
    corr_t = 0 for k = max(⌊ratio·N⌋, 1) tokens drawn uniformly without replacement among the valid tokens
    that PPO did not clip and whose cov_t = (A − mean A)(log π_θ − mean sg(log π_θ)) lies in (lb, ub);
    all of them when fewer qualify. N = number of valid tokens. corr is detached: those tokens get no gradient.
    The draw uses ``generator`` (default: torch's global RNG, as verl); it is sync-free (a sort of uniform keys)
    so it is the same distribution as verl's randperm but not the same stream.
    Metrics (verl): pg_clipfrac = share of valid tokens zeroed by the draw, ppo_kl.
    Δ is clamped to ±``log_ratio_clamp`` before exp (verl: None, unclamped); ``count_eps`` is added to the
    token count of cov's means (verl: 1e-8).
    """
    mask = kept_mask.bool()
    delta, r = _log_ratio(log_prob, old_log_prob, log_ratio_clamp)
    loss1, loss2 = ppo_surrogates(advantages, r, clip_low, clip_high)
    with torch.no_grad():
        cov = _covariance(advantages, log_prob, kept_mask, count_eps)
        candidate = mask & ~(loss2 > loss1) & (cov > cov_lb) & (cov < cov_ub)
        device = cov.device if generator is None else generator.device
        uniform = torch.rand(cov.shape, generator=generator, device=device).to(cov.device)  # float32 keys
        keys = torch.where(candidate, uniform, 2.0)  # non-candidates sort last
        zeroed = candidate & _smallest_k(keys, _count_share(mask, ratio))
    loss = torch.maximum(loss1, loss2) * (~zeroed).to(r.dtype)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean(zeroed.to(delta.dtype), kept_mask),
        "actor/ppo_kl": masked_mean(-delta, kept_mask),
    }
    return loss, detached(metrics)


def kl_cov_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    ratio: float = 2e-4,
    kl_coef: float = 0.1,
    weights: Tensor | None = None,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025; verl `kl_cov`). No clipping; a |Δ| penalty on the highest-covariance tokens.

    L_t = (−A·r + kl_coef·|Δ|·1[t ∈ top-k cov])·w,   k = max(⌊ratio·N⌋, 1) valid tokens by
    cov_t = (A − mean A)(log π_θ − mean log π_θ) (means over valid tokens, detached).
    Deterministic (ties broken by position). Metric (verl): ppo_kl = mean |Δ| over valid tokens.
    r uses Δ clamped to ±``log_ratio_clamp`` (verl: None, unclamped); |Δ| is not clamped.
    """
    mask = kept_mask.bool()
    raw_delta = log_prob - old_log_prob
    _, r = _log_ratio(log_prob, old_log_prob, log_ratio_clamp)
    with torch.no_grad():
        cov = _covariance(advantages, log_prob, mask)
        keys = torch.where(mask, -cov, torch.full_like(cov, math.inf))
        top = mask & _smallest_k(keys, _count_share(mask, ratio))
    loss = -advantages * r + kl_coef * raw_delta.abs() * top.to(r.dtype)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {"actor/ppo_kl": masked_mean(raw_delta.abs(), kept_mask)}
    return loss, detached(metrics)


# ---- the catalogue entries (rollcorr.losses.registry) ------------------------------------------------
# PPO / DAPO ε = 0.2 (verl's ActorConfig clip_ratio), token-mean.
def _vanilla_as_verl(v: VerlCall) -> VerlResult:
    """verl's ``vanilla``: always the dual clip, ``clip_ratio_c`` > 1."""
    if not v.clip_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual clip), got {v.clip_c}")
    loss, metrics = ppo_clip_loss(v.log_prob, v.old_log_prob, v.advantages, v.response_mask, clip_low=v.clip_low,
                                  clip_high=v.clip_high, clip_c=v.clip_c, weights=v.weights)
    return loss, metrics, None, "kept"


register_loss(LossSpec(
    "ppo_clip",
    lambda i, c: ppo_clip_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                               clip_high=c.eps_high, clip_c=c.clip_c, weights=i.weights),
    verl_name="vanilla", verl_loss=_vanilla_as_verl,
))
register_loss(LossSpec(
    "ppo_is",  # ppo_clip with r = π_θ/μ and no weight (bypass: π_old := μ)
    lambda i, c: ppo_clip_loss(i.log_prob, i.rollout_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                               clip_high=c.eps_high, clip_c=c.clip_c),
    needs_old_log_prob=False, needs_rollout_log_prob=True, takes_weights=False, builds_own_weights=True,
))


def _clip_cov(i: LossInputs, c: LossConfig) -> LossResult:
    generator = i.generator
    if generator is None and c.clip_cov_seed is not None:
        generator = torch.Generator(device=i.log_prob.device).manual_seed(c.clip_cov_seed)
    return clip_cov_loss(
        i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low, clip_high=c.eps_high,
        ratio=c.clip_cov_ratio, cov_lb=c.clip_cov_lb, cov_ub=c.clip_cov_ub, generator=generator,
        weights=i.weights,
    )


def _clip_cov_as_verl(v: VerlCall) -> VerlResult:
    """verl's ``clip_cov``: its ratio / bounds fields; the draw from ``generator`` (verl: the global RNG)."""
    loss, metrics = clip_cov_loss(
        v.log_prob, v.old_log_prob, v.advantages, v.response_mask, clip_low=v.clip_low, clip_high=v.clip_high,
        ratio=v.options["clip_cov_ratio"], cov_lb=v.options["clip_cov_lb"], cov_ub=v.options["clip_cov_ub"],
        generator=v.generator, log_ratio_clamp=v.clamp, count_eps=1e-8, weights=v.weights,
    )
    return loss, metrics, None, "kept"


def _kl_cov_as_verl(v: VerlCall) -> VerlResult:
    loss, metrics = kl_cov_loss(v.log_prob, v.old_log_prob, v.advantages, v.response_mask,
                                ratio=v.options["kl_cov_ratio"], kl_coef=v.options["ppo_kl_coef"], weights=v.weights,
                                log_ratio_clamp=v.clamp)
    return loss, metrics, None, "kept"


# clip_cov / kl_cov: verl's ActorConfig / PolicyLossConfig defaults (ε unused by kl_cov)
register_loss(LossSpec(
    "clip_cov", _clip_cov, verl_name="clip_cov", verl_loss=_clip_cov_as_verl,
    options={"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "clip_cov_seed": None},
))
register_loss(LossSpec(
    "kl_cov",
    lambda i, c: kl_cov_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, ratio=c.kl_cov_ratio,
                             kl_coef=c.kl_cov_coef, weights=i.weights),
    clip_low=0.0, clip_high=0.0, options={"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1}, verl_name="kl_cov",
    verl_loss=_kl_cov_as_verl,
))
