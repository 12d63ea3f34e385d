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
from rollcorr.losses.registry import LossConfig

IS_WEIGHTED = ("vanilla_is", "tis", "areal")


@torch.no_grad()
def is_loss_weights(
    config: LossConfig, old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached weight w (B, T) of `config.name` ∈ IS_WEIGHTED (0 off the mask) and its metrics.

    vanilla_is: w = ρ;  tis: w = clamp(ρ, tis_floor, tis_cap);  areal: w = ρ·1[ρ ≤ areal_cap].
    """
    tok = make_tokens(
        old_log_prob, rollout_log_prob, response_mask, bound=LOG_RATIO_CLAMP, verl=False, validate=False
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
        raise ValueError(f"loss {config.name!r} is not one of the IS-weighted losses {IS_WEIGHTED}")
    metrics["actor/is_weight_mean"] = masked_mean(w, tok.mask)
    return w, metrics
