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
    config: LossConfig, old_log_prob: Tensor, rollout_log_prob: Tensor, kept_mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached weight w (B, T) of `config.name` (vanilla_is, tis or areal; 0 off the mask), its metrics.

    vanilla_is: w = ρ;  tis: w = clamp(ρ, tis_floor, tis_cap);  areal: w = ρ·1[ρ ≤ areal_cap].
    """
    tok = make_tokens(
        old_log_prob, rollout_log_prob, kept_mask, bound=LOG_RATIO_CLAMP, verl=False, validate=False
    )
    rho, _ = raw_weights(tok, "token", LOG_RATIO_CLAMP)
    metrics: dict[str, Tensor] = {}
    if config.name == "tis":
        w = apply_threshold(rho, tok.mask_f, "truncate", config.tis_cap, config.tis_floor)
    elif config.name == "areal":
        w = apply_threshold(rho, tok.mask_f, "mask", config.areal_cap, None)
        metrics["actor/areal_capped_fraction"] = masked_mean((rho > config.areal_cap).to(rho.dtype), tok.mask)
    elif config.name == "vanilla_is":
        w = rho
    else:
        raise ValueError(f"loss {config.name!r} is not an IS-weighted loss (vanilla_is, tis, areal)")
    metrics["actor/is_weight_mean"] = masked_mean(w, tok.mask)
    return w, metrics


def _is_weighted_ppo(i: LossInputs, c: LossConfig) -> LossResult:
    """ppo_clip (anchor π_old) times the loss's own weight from π_old/μ."""
    w, metrics = is_loss_weights(c, i.old_log_prob, i.rollout_log_prob, i.kept_mask)
    loss, m = ppo_clip_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                            clip_high=c.eps_high, clip_c=c.clip_c, weights=w)  # fmt: skip
    return loss, {**metrics, **m}


# ---- the catalogue entries (rollcorr.losses.registry) ------------------------------------------------
for _name, _options in (
    ("vanilla_is", {}),
    ("tis", {"tis_cap": 2.0, "tis_floor": None}),
    ("areal", {"areal_cap": 5.0}),
):
    register_loss(LossSpec(
        _name, _is_weighted_ppo, options=_options, needs_rollout_log_prob=True, takes_weights=False,
        builds_own_weights=True,
    ))  # fmt: skip
