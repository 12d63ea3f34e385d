"""Shared pieces of the loss functions: the clamped ratio, masked mean and detached metrics."""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.config.correction import LOG_RATIO_CLAMP


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ values·mask / max(Σ mask, 1); 0 for an empty mask. Scalar."""
    mask = mask.to(values.dtype)
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum() / mask.sum().clamp_min(1)


def clamped_ratio(log_prob: Tensor, ref_log_prob: Tensor) -> tuple[Tensor, Tensor]:
    """(Δ = clamp(log π − log ref, ±20), exp(Δ))."""
    delta = torch.clamp(log_prob - ref_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return delta, torch.exp(delta)


def ppo_surrogates(
    advantages: Tensor, ratio: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's two surrogates (B, T): L1 = −A·r, L2 = −A·clip(r, 1−ε_lo, 1+ε_hi); the clipped loss is max(L1, L2)."""
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)


def detached(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """The metrics with their autograd history dropped (they are logged, never differentiated)."""
    return {k: v.detach() for k, v in metrics.items()}
