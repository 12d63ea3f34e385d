"""verl's policy losses under verl's calling convention, backed by `rollcorr.losses`.

`compute_policy_loss` reproduces verl (core_algos, newest snapshot) on
`shared/reference/verl_vectors.json` — loss, metrics and d loss / d log_prob — for the loss modes
`vanilla`, `gspo`, `cispo`, `geo_mean` and the bypass `reinforce` loss. verl details kept on purpose:

- `vanilla` always applies the dual clip with `clip_ratio_c` (default 3.0, must be > 1);
- `gspo` forces `seq-mean-token-mean` whatever `loss_agg_mode` says;
- `geo_mean` ignores `loss_agg_mode`: plain mean over all B rows (fully-masked rows included);
- `reinforce` reads `old_log_prob` as the rollout log-prob (bypass sets π_old := μ) for its `ppo_kl` metric;
- `seq-mean-*` divide by the number of non-empty rows; `seq-mean-token-sum-norm` divides by that and by T;
- metrics are Python floats under verl's names (`actor/pg_clipfrac`, `actor/ppo_kl`,
  `actor/pg_clipfrac_lower`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rollcorr.losses import (
    aggregate,
    cispo_loss,
    gmpo_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
)

__all__ = ["LOSS_MODES", "compute_policy_loss"]

LOSS_MODES = ("vanilla", "gspo", "cispo", "geo_mean", "reinforce")


def compute_policy_loss(
    loss_mode: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's `compute_policy_loss_<mode>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_is_weights)` with the config fields passed directly. Returns (scalar loss, metrics)."""
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"unsupported loss_mode {loss_mode!r}; choose one of {LOSS_MODES}")
    for name, value in (("old_log_prob", old_log_prob), ("advantages", advantages), ("mask", response_mask)):
        if value.shape != log_prob.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(log_prob.shape)}")
    if rollout_is_weights is not None and rollout_is_weights.shape != log_prob.shape:
        raise ValueError(
            f"rollout_is_weights has shape {tuple(rollout_is_weights.shape)}, expected {tuple(log_prob.shape)}"
        )
    kwargs = {"clip_low": clip_ratio_low, "clip_high": clip_ratio_high, "weights": rollout_is_weights}
    denominator = "kept"
    if loss_mode == "vanilla":
        if not clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0 (dual clip), got {clip_ratio_c}")
        loss, metrics = ppo_clip_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_c=clip_ratio_c, **kwargs
        )
    elif loss_mode == "gspo":
        loss, metrics = gspo_loss(log_prob, old_log_prob, advantages, response_mask, **kwargs)
        loss_agg_mode = "seq-mean-token-mean"
    elif loss_mode == "cispo":
        loss, metrics = cispo_loss(log_prob, old_log_prob, advantages, response_mask, **kwargs)
    elif loss_mode == "geo_mean":
        loss, metrics = gmpo_loss(log_prob, old_log_prob, advantages, response_mask, **kwargs)
        denominator = "batch"
    else:
        loss, metrics = reinforce_loss(
            log_prob, advantages, response_mask, weights=rollout_is_weights, ref_log_prob=old_log_prob
        )
    total = aggregate(loss, response_mask, loss_agg_mode, denominator=denominator)
    return total, {k: float(v) for k, v in metrics.items()}
