"""Sequence-level losses: the ratio is a per-sequence geometric mean.

gspo         r_t = exp(log π_θ − sg(log π_θ) + sg(mean_t Δ)), then PPO clip; times w
gmpo         Δ' = sgn(A)·min(sgn(A)·Δ, sgn(A)·clamp(Δ, −ε_lo, ε_hi)); L_b = −mean_t A · exp(mean_t Δ')
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.losses.common import LOG_RATIO_CLAMP, detached, masked_mean, ppo_surrogates
from rollcorr.losses.registry import LossSpec, VerlCall, VerlResult, register_loss


def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO token form. s_b = Σ_t m·Δ / max(Σ_t m, 1); log r_t = log π_θ − sg(log π_θ) + sg(s_b), ≤ 10.

    Forward value r_t = exp(s_b) (sequence ratio, geometric mean); gradient flows per token. PPO clip, no
    dual clip, times w. Aggregate with seq-mean-token-mean (GSPO's definition).
    """
    mask = kept_mask.to(log_prob.dtype)
    delta = log_prob - old_log_prob
    seq_log_ratio = (torch.where(mask > 0, delta, torch.zeros_like(delta))).sum(-1) / mask.sum(-1).clamp_min(
        1
    )
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    loss1, loss2 = ppo_surrogates(advantages, ratio, clip_low, clip_high)
    loss = torch.maximum(loss1, loss2)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss2 > loss1).to(delta.dtype), kept_mask),
        "actor/ppo_kl": masked_mean(-delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), kept_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), dtype=delta.dtype, device=delta.device),
    }
    return loss, detached(metrics)


def gmpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    weights: Tensor | None = None,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (verl `geo_mean`). Returns a per-sequence loss (B,) and metrics.

    Δ' = sgn(A)·min(sgn(A)·Δ, sgn(A)·clamp(Δ, −ε_lo, ε_hi))   (one-sided clip in log space)
    L_b = −(Σ m·A / n_b) · exp(Σ m·Δ' / n_b) · exp(Σ m·log(w + 1e-10) / n_b),   n_b = Σ m + 1e-8
    Δ is clamped to ±``log_ratio_clamp`` first (verl: None, unclamped), so extreme log-ratios stay finite.
    """
    mask = kept_mask.to(log_prob.dtype)
    delta = log_prob - old_log_prob
    if log_ratio_clamp is not None:
        delta = torch.clamp(delta, -log_ratio_clamp, log_ratio_clamp)
    sign = torch.sign(advantages)
    delta_clamped = torch.clamp(delta, -clip_low, clip_high)
    delta_min = sign * torch.minimum(sign * delta, sign * delta_clamped)
    count = kept_mask.sum(-1)  # verl adds its 1e-8 in the mask's sum dtype (float32 for bool/int)
    count = count if count.is_floating_point() else count.to(torch.get_default_dtype())
    n = (count + 1e-8).to(delta.dtype)
    zeros = torch.zeros_like(delta)
    ratio = torch.exp(torch.where(mask > 0, delta_min, zeros).sum(-1) / n)
    adv = torch.where(mask > 0, advantages, zeros).sum(-1) / n
    loss = -adv * ratio
    if weights is not None:
        log_w = torch.log(weights.detach() + 1e-10)
        loss = loss * torch.exp(torch.where(mask > 0, log_w, zeros).sum(-1) / n)
    clipped = (delta != delta_clamped).to(delta.dtype)
    metrics = {
        "actor/pg_clipfrac": masked_mean(clipped * (advantages > 0), kept_mask),
        "actor/ppo_kl": masked_mean(-delta, kept_mask),
        "actor/pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), kept_mask),
    }
    return loss, detached(metrics)


# ---- the catalogue entries (rollcorr.losses.registry) ------------------------------------------------
def _gspo_as_verl(v: VerlCall) -> VerlResult:
    """verl's ``gspo``; strict: its ``actor/ppo_kl`` leaves the log-ratio unclamped."""
    loss, metrics = gspo_loss(v.log_prob, v.old_log_prob, v.advantages, v.response_mask, clip_low=v.clip_low,
                              clip_high=v.clip_high, weights=v.weights)
    if v.strict:
        from rollcorr.losses.common import masked_mean

        metrics["actor/ppo_kl"] = masked_mean((v.old_log_prob - v.log_prob).detach(), v.response_mask)
    return loss, metrics, None, "kept"


def _geo_mean_as_verl(v: VerlCall) -> VerlResult:
    """verl's ``geo_mean``: a plain mean over the batch's sequences, whatever ``loss_agg_mode``."""
    loss, metrics = gmpo_loss(v.log_prob, v.old_log_prob, v.advantages, v.response_mask, clip_low=v.clip_low,
                              clip_high=v.clip_high, weights=v.weights, log_ratio_clamp=v.clamp)
    return loss, metrics, None, "batch"


register_loss(LossSpec(
    "gspo",  # the GSPO paper's ε = 3e-4 / 4e-4 and its per-sequence mean
    lambda i, c: gspo_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                           clip_high=c.eps_high, weights=i.weights),
    clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean", verl_name="gspo", verl_loss=_gspo_as_verl,
))
register_loss(LossSpec(
    "gmpo",  # the GMPO paper's ε = 0.4 (log space)
    lambda i, c: gmpo_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                           clip_high=c.eps_high, weights=i.weights),
    clip_low=0.4, clip_high=0.4, clip_low_at_most=None, per_sequence=True, verl_name="geo_mean",
    verl_loss=_geo_mean_as_verl,
))
