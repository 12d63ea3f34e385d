"""A KL term to a frozen reference policy π_ref (TRL's ``beta``, verl's ``use_kl_loss`` / ``use_kl_in_reward``).

Per token, with Δ = log π − log π_ref (Schulman, "Approximating KL divergence", 2020; verl's ``kl_penalty``):

    kl / k1       Δ
    abs           |Δ|
    mse / k2      ½ Δ²
    low_var_kl/k3 clamp(e^{−Δ'} + Δ' − 1, ±10),  Δ' = clamp(Δ, ±20)   (TRL's per-token KL without the clamps)

A trailing ``+`` (``k3+``) keeps the value and takes k2's gradient (straight-through). In the loss (verl
``kl_loss_type``, TRL ``beta``) the term is ``coef`` times the estimate of π_θ against π_ref, aggregated like the
policy loss over the kept tokens (``kl_loss``); in the reward (verl ``use_kl_in_reward``) a sequence's reward loses
``coef`` times the sum of the estimates of π_old against π_ref over its tokens (``kl_reward_penalty``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.losses.aggregation import aggregate

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

__all__ = ["KL_PENALTIES", "check_kl_estimator", "kl_loss", "kl_penalty", "kl_reward_penalty"]


def check_kl_estimator(name: str) -> str:
    """``name`` (optionally with a trailing +) if it is an estimator of ``KL_PENALTIES``, else ValueError."""
    if not isinstance(name, str) or (name[:-1] if name.endswith("+") else name) not in KL_PENALTIES:
        raise ValueError(f"unknown kl_penalty {name!r}; choose one of {KL_PENALTIES} (optionally with +)")
    return name


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's per-token KL estimate of log π − log π_ref (module docstring). (B, T) in, (B, T) out; verl's argument
    names (``logprob``, ``ref_logprob``, ``kl_penalty``)."""
    base = check_kl_estimator(kl_penalty).removesuffix("+")
    delta = logprob - ref_logprob
    if base in ("kl", "k1"):
        value = delta
    elif base == "abs":
        value = delta.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * delta.square()
    else:
        kl = torch.clamp(-delta, min=-20, max=20)
        value = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if not kl_penalty.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * delta.square()
    return k2 - k2.detach() + value.detach()


def kl_loss(log_prob: Tensor, ref_log_prob: Tensor, kept_mask: Tensor, estimator: str, agg: str, *,
            per_sequence: bool = False, denominator: str = "kept", denominator_mask: Tensor | None = None,
            norm_constant: float | None = None) -> Tensor:
    """The KL term's loss (before ``coef``): per-token ``kl_penalty(π_θ, π_ref)`` aggregated as the policy loss is
    (``agg``, the denominator policy), so its parts add up over micro-batches and ranks as the loss's do. A loss
    with one value per sequence (``per_sequence``) gets each sequence's token mean, averaged over sequences."""
    kept = kept_mask.bool()  # both zeroed off the kept tokens: padding's NaN never reaches a gradient
    values = kl_penalty(torch.where(kept, log_prob, torch.zeros_like(log_prob)),
                        torch.where(kept, ref_log_prob, torch.zeros_like(ref_log_prob)), estimator)
    if per_sequence:
        agg = "seq-mean-token-mean"
    return aggregate(values, kept_mask, agg, denominator=denominator, denominator_mask=denominator_mask,
                     norm_constant=norm_constant)


def kl_reward_penalty(old_log_prob: Tensor, ref_log_prob: Tensor, response_mask: Tensor, estimator: str) -> Tensor:
    """(B,) Σ_t kl_penalty(π_old, π_ref) over each response's valid tokens: what ``coef`` times leaves its reward
    (verl's ``apply_kl_penalty``: token-level scores minus β·kl, summed by an outcome estimator)."""
    valid = response_mask.bool()
    old, ref = (torch.where(valid, x, torch.zeros_like(x)) for x in (old_log_prob, ref_log_prob))
    return torch.where(valid, kl_penalty(old, ref, estimator), torch.zeros_like(old)).sum(-1)
