"""verl's policy losses under verl's calling convention, backed by `rollcorr.losses`.

`compute_policy_loss` reproduces verl (core_algos, newest snapshot) on
`tests/data/verl_vectors.json` (verl's own outputs, docs/spec.md §9) — loss, metrics and d loss / d log_prob — for the loss modes
`vanilla`, `gspo`, `cispo`, `geo_mean` and the bypass `reinforce` loss. verl details kept on purpose:

- `vanilla` always applies the dual clip with `clip_ratio_c` (default 3.0, must be > 1);
- `gspo` forces `seq-mean-token-mean` whatever `loss_agg_mode` says;
- `geo_mean` ignores `loss_agg_mode`: plain mean over all B rows (fully-masked rows included);
- `reinforce` reads `old_log_prob` as the rollout log-prob (bypass sets π_old := μ) for its `ppo_kl` metric;
- `seq-mean-*` divide by the number of non-empty rows; `seq-mean-token-sum-norm` divides by that and by T;
- metrics are Python floats under verl's names (`actor/pg_clipfrac`, `actor/ppo_kl`,
  `actor/pg_clipfrac_lower`).

The other registered verl modes (`sapo`, `gpg`, `clip_cov`, `kl_cov`, `dppo_tv`, `dppo_kl`, `dro`) follow
verl's formulas (checked against hand-written float64 references in `tests/test_losses_verl_extra.py`; there
are no verl vectors for them): `sapo` forces `seq-mean-token-mean`; `gpg` returns no metric; `dppo_*` use
verl's value −A·sg(min(r, clip_ratio_c))·log π_θ·keep; `clip_cov` draws its tokens with ``generator``
(verl: the global RNG, so only the distribution of the draw can match, not the draw itself).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollcorr.losses import (
    aggregate,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    gmpo_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)

__all__ = ["LOSS_MODES", "compute_policy_loss"]

LOSS_MODES = (
    "vanilla",
    "gspo",
    "cispo",
    "geo_mean",
    "reinforce",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "dro",
)
_VERL_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


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
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    dro_beta: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's `compute_policy_loss_<mode>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_is_weights)` with the config fields passed directly (defaults: verl's ActorConfig /
    PolicyLossConfig; `dro_beta` 0.1 is rollcorr's choice). Returns (scalar loss, metrics)."""
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"unsupported loss_mode {loss_mode!r}; choose one of {LOSS_MODES}")
    for name, value in (("old_log_prob", old_log_prob), ("advantages", advantages), ("mask", response_mask)):
        if value.shape != log_prob.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(log_prob.shape)}")
    if rollout_is_weights is not None and rollout_is_weights.shape != log_prob.shape:
        raise ValueError(
            f"rollout_is_weights has shape {tuple(rollout_is_weights.shape)}, expected {tuple(log_prob.shape)}"
        )
    positive = {"clip_cov": ("clip_cov_ratio", clip_cov_ratio), "kl_cov": ("kl_cov_ratio", kl_cov_ratio)}
    positive["dro"] = ("dro_beta", dro_beta)
    if loss_mode in positive and not positive[loss_mode][1] > 0:  # verl asserts these
        raise ValueError(f"{positive[loss_mode][0]} must be > 0, got {positive[loss_mode][1]}")
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
    elif loss_mode == "reinforce":
        loss, metrics = reinforce_loss(
            log_prob, advantages, response_mask, weights=rollout_is_weights, ref_log_prob=old_log_prob
        )
    elif loss_mode == "sapo":
        loss, metrics = sapo_loss(
            log_prob, old_log_prob, advantages, response_mask,
            tau_pos=tau_pos, tau_neg=tau_neg, weights=rollout_is_weights,
        )  # fmt: skip
        loss_agg_mode = "seq-mean-token-mean"
    elif loss_mode == "gpg":
        loss, metrics = reinforce_loss(log_prob, advantages, response_mask, weights=rollout_is_weights)
    elif loss_mode == "clip_cov":
        loss, metrics = clip_cov_loss(
            log_prob, old_log_prob, advantages, response_mask, ratio=clip_cov_ratio, cov_lb=clip_cov_lb,
            cov_ub=clip_cov_ub, generator=generator, **kwargs,
        )  # fmt: skip
    elif loss_mode == "kl_cov":
        loss, metrics = kl_cov_loss(
            log_prob, old_log_prob, advantages, response_mask,
            ratio=kl_cov_ratio, kl_coef=ppo_kl_coef, weights=rollout_is_weights,
        )  # fmt: skip
    elif loss_mode in ("dppo_tv", "dppo_kl"):
        fn = dppo_tv_loss if loss_mode == "dppo_tv" else dppo_kl_loss
        loss, metrics = fn(
            log_prob, old_log_prob, advantages, response_mask, cap=clip_ratio_c, verl_value=True, **kwargs
        )
        metrics = {k: v for k, v in metrics.items() if k in _VERL_METRICS}
    else:
        loss, metrics = dro_loss(
            log_prob, old_log_prob, advantages, response_mask, beta=dro_beta, weights=rollout_is_weights
        )
    total = aggregate(loss, response_mask, loss_agg_mode, denominator=denominator)
    return total, {k: float(v) for k, v in metrics.items()}
