"""`policy_loss(LossConfig, ...)`: validate the inputs, run the configured loss, aggregate it."""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.correction.ratios import check_binary_mask
from rollcorr.losses.aggregation import aggregate
from rollcorr.losses.is_weighted import IS_WEIGHTED, is_loss_weights
from rollcorr.losses.oapl import oapl_loss
from rollcorr.losses.ppo import clip_cov_loss, kl_cov_loss, ppo_clip_loss
from rollcorr.losses.registry import LossConfig
from rollcorr.losses.reinforce import cispo_loss, dro_loss, reinforce_loss
from rollcorr.losses.sequence import gmpo_loss, gspo_loss
from rollcorr.losses.trust_region import dppo_kl_loss, dppo_tv_loss, sapo_loss


def _validate(
    log_prob: Tensor, response_mask: Tensor, denominator_mask: Tensor | None, check_values: bool, **named
) -> None:
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be (B, T), got shape {tuple(log_prob.shape)}")
    if not log_prob.is_floating_point():
        raise ValueError(f"log_prob must be floating point, got {log_prob.dtype}")
    shape = tuple(log_prob.shape)
    for name, value in {
        "response_mask": response_mask,
        "denominator_mask": denominator_mask,
        **named,
    }.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    if not check_values:
        return
    check_binary_mask("response_mask", response_mask)
    if denominator_mask is not None:
        check_binary_mask("denominator_mask", denominator_mask)
    mask = response_mask.bool()
    for name, value in {"log_prob": log_prob, **named}.items():
        if value is not None and value.is_floating_point() and not torch.isfinite(value.detach()[mask]).all():
            raise ValueError(f"{name} has NaN or ±inf on valid tokens")
    if denominator_mask is not None and (mask & ~denominator_mask.bool()).any():
        raise ValueError("response_mask keeps tokens that denominator_mask (pre-rejection) does not have")


def policy_loss(
    config: LossConfig,
    log_prob: Tensor,
    old_log_prob: Tensor | None,
    advantages: Tensor | None,
    response_mask: Tensor,
    *,
    weights: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
    denominator_mask: Tensor | None = None,
    rewards: Tensor | None = None,
    group_ids: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Compute `config.name`'s loss and aggregate it. Returns (scalar loss, detached metrics).

    response_mask: kept tokens (after rejection); denominator_mask: valid tokens before rejection (default
    response_mask). advantages: (B, T) or (B,) (broadcast). weights: detached correction weights w (B, T)
    for ppo_clip (decoupled), reinforce, cispo, gspo, gmpo and the verl losses (dppo_tv, dppo_kl, sapo, gpg,
    clip_cov, kl_cov, dro). rollout_log_prob (μ) is needed by
    ppo_is, vanilla_is, tis, areal and oapl; oapl also needs rewards (B,) and group_ids (B,) (advantages
    unused). If no token is kept the loss is exactly 0 with zero gradient and `actor/all_rejected` = 1.
    generator: clip_cov's random draw (default: a generator seeded with `clip_cov_seed` when that is set,
    else torch's global RNG). Pass one persistent generator per run for fresh, reproducible draws.
    """
    name = config.name
    if log_prob.dim() == 2:
        batch = log_prob.shape[0]
        for arg, value in (("advantages", advantages), ("rewards", rewards), ("group_ids", group_ids)):
            if value is not None and value.dim() == 1 and value.shape[0] != batch:
                raise ValueError(f"{arg} has shape {tuple(value.shape)}, expected ({batch},) for {batch} rows"
                                 + (f" or {tuple(log_prob.shape)}" if arg == "advantages" else ""))  # fmt: skip
    if advantages is not None and advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(log_prob)
    # fp16 / bf16 inputs are computed in float32 (as compute_correction does): exp of a log-ratio clamped to
    # ±20 is 4.9e8, beyond fp16's 65504, and bf16's 8-bit mantissa would round the ratios near 1
    if log_prob.dtype in (torch.float16, torch.bfloat16):
        log_prob = log_prob.float()
    old_log_prob, advantages, weights, rollout_log_prob = (
        x.float() if x is not None and x.dtype in (torch.float16, torch.bfloat16) else x
        for x in (old_log_prob, advantages, weights, rollout_log_prob)
    )
    _validate(
        log_prob,
        response_mask,
        denominator_mask,
        config.check_inputs,
        old_log_prob=old_log_prob,
        advantages=advantages,
        weights=weights,
        rollout_log_prob=rollout_log_prob,
    )
    # Zero every input outside the kept mask: padding may hold NaN / -inf, and a masked position must get
    # an exactly-zero gradient (0 · NaN in a backward would otherwise poison the parameters).
    kept_mask = response_mask.bool()

    def clean(value: Tensor | None) -> Tensor | None:
        return None if value is None else torch.where(kept_mask, value, torch.zeros_like(value))

    log_prob, old_log_prob, advantages = clean(log_prob), clean(old_log_prob), clean(advantages)
    weights, rollout_log_prob = clean(weights), clean(rollout_log_prob)
    needs_rollout = name in ("ppo_is", "vanilla_is", "tis", "areal", "oapl")
    if needs_rollout and rollout_log_prob is None:
        raise ValueError(f"loss {name!r} needs rollout_log_prob (log μ)")
    if name in ("ppo_is", "vanilla_is", "tis", "areal", "oapl") and weights is not None:
        raise ValueError(f"loss {name!r} builds its own weight (or none); do not pass weights")
    if name == "oapl":
        if rewards is None or group_ids is None:
            raise ValueError("loss 'oapl' needs rewards (B,) and group_ids (B,)")
    else:
        if advantages is None:
            raise ValueError(f"loss {name!r} needs advantages")
        if old_log_prob is None and name not in ("reinforce", "ppo_is", "gpg"):
            raise ValueError(f"loss {name!r} needs old_log_prob")

    lo, hi = config.eps_low, config.eps_high
    metrics: dict[str, Tensor] = {}
    if name in ("ppo_clip", "ppo_is", "vanilla_is", "tis", "areal"):
        anchor = rollout_log_prob if name == "ppo_is" else old_log_prob
        w = weights
        if name in IS_WEIGHTED:
            w, metrics = is_loss_weights(config, old_log_prob, rollout_log_prob, response_mask)
        loss, m = ppo_clip_loss(
            log_prob,
            anchor,
            advantages,
            response_mask,
            clip_low=lo,
            clip_high=hi,
            clip_c=config.clip_c,
            weights=w,
        )
    elif name == "reinforce":
        loss, m = reinforce_loss(
            log_prob, advantages, response_mask, weights=weights, ref_log_prob=old_log_prob
        )
    elif name == "cispo":
        loss, m = cispo_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi, weights=weights
        )
    elif name == "gspo":
        loss, m = gspo_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi, weights=weights
        )
    elif name == "gmpo":
        loss, m = gmpo_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi, weights=weights
        )
    elif name in ("dppo_tv", "dppo_kl"):
        fn = dppo_tv_loss if name == "dppo_tv" else dppo_kl_loss
        loss, m = fn(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi,
            cap=config.clip_c, kl_coef=config.dppo_kl_coef, weights=weights,
        )  # fmt: skip
    elif name == "sapo":
        loss, m = sapo_loss(
            log_prob, old_log_prob, advantages, response_mask,
            tau_pos=config.sapo_tau_pos, tau_neg=config.sapo_tau_neg, weights=weights,
        )  # fmt: skip
    elif name == "gpg":
        loss, m = reinforce_loss(log_prob, advantages, response_mask, weights=weights)
    elif name == "clip_cov":
        if generator is None and config.clip_cov_seed is not None:
            generator = torch.Generator(device=log_prob.device).manual_seed(config.clip_cov_seed)
        loss, m = clip_cov_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi,
            ratio=config.clip_cov_ratio, cov_lb=config.clip_cov_lb, cov_ub=config.clip_cov_ub,
            generator=generator, weights=weights,
        )  # fmt: skip
    elif name == "kl_cov":
        loss, m = kl_cov_loss(
            log_prob, old_log_prob, advantages, response_mask,
            ratio=config.kl_cov_ratio, kl_coef=config.kl_cov_coef, weights=weights,
        )  # fmt: skip
    elif name == "dro":
        loss, m = dro_loss(
            log_prob, old_log_prob, advantages, response_mask, beta=config.dro_beta, weights=weights
        )
    else:
        loss, m = oapl_loss(
            log_prob,
            rollout_log_prob,
            rewards,
            group_ids,
            response_mask,
            beta=config.oapl_beta,
            beta1=config.oapl_beta1,
        )
    metrics.update(m)
    total = aggregate(
        loss,
        response_mask,
        config.agg_mode,
        denominator=config.denominator,
        denominator_mask=denominator_mask,
        norm_constant=config.norm_constant,
    )
    kept = response_mask.bool().sum()
    valid = kept if denominator_mask is None else denominator_mask.bool().sum()
    dtype = log_prob.dtype
    metrics["actor/pg_loss"] = total.detach()
    metrics["actor/kept_token_fraction"] = (kept.to(dtype) / valid.to(dtype).clamp_min(1)).detach()
    metrics["actor/all_rejected"] = (kept == 0).to(dtype)
    return total, metrics
