"""The IS-weighted PPO losses: ppo_clip times a detached token weight built from ρ by the correction module.

  vanilla_is   ppo_clip · ρ                  tis   ppo_clip · clamp(ρ, floor, cap)
  areal        ppo_clip · ρ·1[ρ ≤ cap]       (token kept in the denominator)

ρ = exp(clamp(log π_old − log μ, ±20)). The weight is the correction's token-level weight (correction/weights.py:
`raw_weights` at level `token`, then `apply_threshold` — truncate for tis, mask for areal); nothing here re-derives
a ratio or a cap.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.correction.ratios import make_tokens
from rollcorr.correction.weights import apply_threshold, raw_weights
from rollcorr.losses.common import LOG_RATIO_CLAMP, masked_mean
from rollcorr.losses.ppo import ppo_clip_loss
from rollcorr.losses.registry import LossConfig, LossInputs, LossResult, LossSpec, register_loss


@torch.no_grad()
def is_loss_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    kept_mask: Tensor,
    mode: str | None,
    cap: float | None = None,
    floor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The detached weight w (B, T) (0 off the mask) and the raw ρ: ``mode`` None → w = ρ; "truncate" →
    clamp(ρ, floor, cap); "mask" → ρ·1[ρ ≤ cap] — the correction's own ``raw_weights`` / ``apply_threshold``."""
    tok = make_tokens(
        old_log_prob, rollout_log_prob, kept_mask, bound=LOG_RATIO_CLAMP, verl=False, validate=False
    )
    rho, _ = raw_weights(tok, "token", LOG_RATIO_CLAMP)
    w = rho if mode is None else apply_threshold(rho, tok.mask_f, mode, cap, floor)
    return w, rho


def _is_weighted_ppo(mode: str | None, cap_field: str | None = None, floor_field: str | None = None):
    """The loss function of an IS-weighted PPO loss: ppo_clip (anchor π_old) times its own weight from
    π_old/μ (``is_loss_weights`` with the cap / floor read from the named ``LossConfig`` fields)."""

    def compute(i: LossInputs, c: LossConfig) -> LossResult:
        cap = None if cap_field is None else getattr(c, cap_field)
        floor = None if floor_field is None else getattr(c, floor_field)
        w, rho = is_loss_weights(i.old_log_prob, i.rollout_log_prob, i.kept_mask, mode, cap, floor)
        mask = i.kept_mask.bool()
        metrics = {}
        if mode == "mask":  # areal: the share of tokens whose weight the cap zeroed
            metrics["actor/areal_capped_fraction"] = masked_mean((rho > cap).to(rho.dtype), mask)
        metrics["actor/is_weight_mean"] = masked_mean(w, mask)
        loss, m = ppo_clip_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                                clip_high=c.eps_high, clip_c=c.clip_c, weights=w)
        return loss, {**metrics, **m}

    return compute


# ---- the catalogue entries (rollcorr.losses.registry) ------------------------------------------------
_OWN_WEIGHT = dict(needs_rollout_log_prob=True, takes_weights=False, builds_own_weights=True)
register_loss(LossSpec("vanilla_is", _is_weighted_ppo(None), **_OWN_WEIGHT))
register_loss(LossSpec("tis", _is_weighted_ppo("truncate", "tis_cap", "tis_floor"),
                       options={"tis_cap": 2.0, "tis_floor": None}, **_OWN_WEIGHT))
register_loss(LossSpec("areal", _is_weighted_ppo("mask", "areal_cap"), options={"areal_cap": 5.0},
                       **_OWN_WEIGHT))
