"""OAPL: a per-sequence squared regression of β·Σ_t log(π_θ/μ) on the reward minus a soft group value.

oapl         ℓ_b = (β · Σ_t (log π_θ − log μ) − (r_b − V̂(x)))²
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.advantages import oapl_value
from rollcorr.losses.common import detached, masked_mean
from rollcorr.losses.registry import LossSpec, register_loss


def value_temperature(beta: float, beta1: float | None) -> float:
    """OAPL's β₁, the temperature of the soft value V̂: β when not set (None)."""
    return beta if beta1 is None else beta1


def oapl_loss(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    kept_mask: Tensor,
    *,
    beta: float = 0.3,
    beta1: float | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """OAPL squared regression, per sequence (B,).

    ℓ_b = (β · Σ_t m·(log π_θ − log μ) − (r_b − V̂(x)))²,  V̂(x) = β₁ · log mean_{j∈group} exp(r_j / β₁)
    β₁ = β when None; β₁ = inf → plain group mean. Token log-ratios are *summed* over the sequence; no IS,
    no clipping. `keep` (B,) removes rows from V̂ (default: rows with at least one kept token).
    """
    mask = kept_mask.bool()
    if keep is None:
        keep = mask.any(-1)
    value = oapl_value(rewards, group_ids, beta1=value_temperature(beta, beta1), keep=keep)
    target = rewards.to(log_prob.dtype) - value.to(log_prob.dtype)
    diff = torch.where(mask, log_prob - rollout_log_prob, torch.zeros_like(log_prob))
    pred = beta * diff.sum(-1)
    loss = (pred - target) ** 2
    metrics = {
        "actor/oapl_value_mean": masked_mean(value.to(log_prob.dtype), keep),
        "actor/oapl_target_mean": masked_mean(target, keep),
        "actor/oapl_pred_mean": masked_mean(pred, keep),
        "actor/ppo_kl": masked_mean(rollout_log_prob - log_prob, mask),
    }
    return loss, detached(metrics)


# ---- the catalogue entry (rollcorr.losses.registry) --------------------------------------------------
# β = 0.3: measured on the built-in model, where 0.01 and 0.1 collapse and 0.3 learns (docs/training.md).
register_loss(LossSpec(
    "oapl",
    lambda i, c: oapl_loss(i.log_prob, i.rollout_log_prob, i.rewards, i.group_ids, i.kept_mask,
                           beta=c.oapl_beta, beta1=c.oapl_beta1),
    clip_low=0.0, clip_high=0.0, options={"oapl_beta": 0.3, "oapl_beta1": None},
    needs_old_log_prob=False, needs_advantages=False, needs_rollout_log_prob=True, needs_rewards=True,
    takes_weights=False, per_sequence=True, regresses_on_rollout=True,
))
