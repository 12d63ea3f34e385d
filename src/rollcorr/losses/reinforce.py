"""REINFORCE-family losses: the gradient is −A·(weight)·∇log π_θ with the weight never differentiated.

reinforce    L = −A · sg(w) · log π_θ       (gpg: the same without its metric)
cispo        L = −sg(clip(r, 1−ε_lo, 1+ε_hi)) · A · log π_θ · w
dro          L = −(A · log π_θ − ½β·Δ²) · w
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.losses.common import clamped_ratio, detached, masked_mean
from rollcorr.losses.registry import LossSpec, VerlCall, VerlResult, register_loss


def reinforce_loss(
    log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    weights: Tensor | None = None,
    ref_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE with detached weights: L = −A·sg(w)·log π_θ (B, T). ∇L = −A·w·∇log π_θ.

    `ref_log_prob` (μ in bypass) only feeds the `actor/ppo_kl` metric = mean(log ref − log π_θ).
    """
    loss = -advantages * log_prob
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {}
    if ref_log_prob is not None:
        metrics["actor/ppo_kl"] = masked_mean(ref_log_prob - log_prob, kept_mask)
    return loss, detached(metrics)


def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): L = −sg(clip(r, 1−ε_lo, 1+ε_hi))·A·log π_θ·w. Every token keeps a gradient."""
    delta, ratio = clamped_ratio(log_prob, old_log_prob)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = -clipped.detach() * advantages * log_prob
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio != clipped).to(delta.dtype), kept_mask),
        "actor/ppo_kl": masked_mean(-delta, kept_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), dtype=delta.dtype, device=delta.device),
    }
    return loss, detached(metrics)


def dro_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    beta: float = 0.1,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Richemond et al. 2024; Kimi k1.5; verl `dro`): REINFORCE with a quadratic trust region.

    L = −(A·log π_θ − ½β·(log π_θ − log π_old)²)·w,   ∇L = −(A − β·Δ)·∇log π_θ·w.   Δ is not clamped.
    """
    delta = log_prob - old_log_prob
    loss = -(log_prob * advantages - 0.5 * beta * delta.square())
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {"actor/ppo_kl": masked_mean(-delta, kept_mask)}
    return loss, detached(metrics)


# ---- the catalogue entries (rollcorr.losses.registry) ------------------------------------------------
def _reinforce_as_verl(v: VerlCall) -> VerlResult:
    """verl's ``reinforce`` (bypass: ``old_log_prob`` is μ, read only for ``actor/ppo_kl``)."""
    loss, metrics = reinforce_loss(v.log_prob, v.advantages, v.response_mask, weights=v.weights,
                                   ref_log_prob=v.old_log_prob)
    return loss, metrics, None, "kept"


def _gpg_as_verl(v: VerlCall) -> VerlResult:
    loss, metrics = reinforce_loss(v.log_prob, v.advantages, v.response_mask, weights=v.weights)
    return loss, metrics, None, "kept"


def _cispo_as_verl(v: VerlCall) -> VerlResult:
    loss, metrics = cispo_loss(v.log_prob, v.old_log_prob, v.advantages, v.response_mask, clip_low=v.clip_low,
                               clip_high=v.clip_high, weights=v.weights)
    return loss, metrics, None, "kept"


def _dro_as_verl(v: VerlCall) -> VerlResult:
    loss, metrics = dro_loss(v.log_prob, v.old_log_prob, v.advantages, v.response_mask, beta=v.options["dro_beta"],
                             weights=v.weights)
    return loss, metrics, None, "kept"


register_loss(LossSpec(
    "reinforce",  # old_log_prob (μ in bypass), when given, only feeds the actor/ppo_kl metric
    lambda i, c: reinforce_loss(i.log_prob, i.advantages, i.kept_mask, weights=i.weights,
                                ref_log_prob=i.old_log_prob),
    clip_low=0.0, clip_high=0.0, needs_old_log_prob=False, has_ratio=False, verl_name="reinforce",
    verl_loss=_reinforce_as_verl,
))
register_loss(LossSpec(
    "gpg",  # verl `gpg`: reinforce without its metric
    lambda i, c: reinforce_loss(i.log_prob, i.advantages, i.kept_mask, weights=i.weights),
    clip_low=0.0, clip_high=0.0, needs_old_log_prob=False, has_ratio=False, verl_name="gpg", verl_loss=_gpg_as_verl,
))
register_loss(LossSpec(
    "cispo",  # ε as AReaL recommends: ε_lo = 1 (no lower bound), ε_hi = 4
    lambda i, c: cispo_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                            clip_high=c.eps_high, weights=i.weights),
    clip_low=1.0, clip_high=4.0, verl_name="cispo", verl_loss=_cispo_as_verl,
))
register_loss(LossSpec(
    "dro",
    lambda i, c: dro_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, beta=c.dro_beta,
                          weights=i.weights),
    clip_low=0.0, clip_high=0.0, options={"dro_beta": 0.1}, verl_name="dro", verl_loss=_dro_as_verl,
))
