"""`policy_loss(LossConfig, ...)`: validate the inputs, run the configured loss (through the catalogue,
`rollcorr.losses.registry.LOSSES`), aggregate it."""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.correction.ratios import check_binary_mask
from rollcorr.losses.aggregation import aggregate
from rollcorr.losses.registry import LossConfig, LossInputs


def _validate(
    log_prob: Tensor, kept_mask: Tensor, denominator_mask: Tensor | None, check_values: bool, **named
) -> None:
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be (B, T), got shape {tuple(log_prob.shape)}")
    if not log_prob.is_floating_point():
        raise ValueError(f"log_prob must be floating point, got {log_prob.dtype}")
    shape = tuple(log_prob.shape)
    for name, value in {
        "kept_mask": kept_mask,
        "denominator_mask": denominator_mask,
        **named,
    }.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    if not check_values:
        return
    check_binary_mask("kept_mask", kept_mask)
    if denominator_mask is not None:
        check_binary_mask("denominator_mask", denominator_mask)
    mask = kept_mask.bool()
    for name, value in {"log_prob": log_prob, **named}.items():
        if value is not None and value.is_floating_point() and not torch.isfinite(value.detach()[mask]).all():
            raise ValueError(f"{name} has NaN or ±inf on valid tokens")
    if denominator_mask is not None and (mask & ~denominator_mask.bool()).any():
        raise ValueError("kept_mask keeps tokens that denominator_mask (pre-rejection) does not have")


def policy_loss(
    config: LossConfig,
    log_prob: Tensor,
    old_log_prob: Tensor | None,
    advantages: Tensor | None,
    kept_mask: Tensor,
    *,
    weights: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
    denominator_mask: Tensor | None = None,
    rewards: Tensor | None = None,
    group_ids: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Compute `config.name`'s loss and aggregate it. Returns (scalar loss, detached metrics).

    kept_mask: the tokens kept after rejection (the correction's ``kept_mask``); denominator_mask: valid
    tokens before rejection (default kept_mask). advantages: (B, T) or (B,) (broadcast). What else a loss needs is
    declared by its ``LossSpec``: weights (detached correction weights w (B, T); every loss but ppo_is,
    vanilla_is, tis, areal and oapl takes them), rollout_log_prob (μ: ppo_is, vanilla_is, tis, areal, oapl),
    rewards (B,) and group_ids (B,) (oapl, which reads no advantages). If no token is kept the loss is
    exactly 0 with zero gradient and `actor/all_rejected` = 1.
    generator: clip_cov's random draw (default: a generator seeded with `clip_cov_seed` when that is set,
    else torch's global RNG). Pass one persistent generator per run for fresh, reproducible draws.
    """
    spec = config.spec
    log_prob, old_log_prob, advantages, weights, rollout_log_prob = _prepared(
        log_prob, old_log_prob, advantages, weights, rollout_log_prob, rewards, group_ids
    )
    _validate(
        log_prob,
        kept_mask,
        denominator_mask,
        config.check_inputs,
        old_log_prob=old_log_prob,
        advantages=advantages,
        weights=weights,
        rollout_log_prob=rollout_log_prob,
    )
    # Zero every input outside the kept mask: padding may hold NaN / -inf, and a masked position must get
    # an exactly-zero gradient (0 · NaN in a backward would otherwise poison the parameters).
    kept = kept_mask.bool()

    def clean(value: Tensor | None) -> Tensor | None:
        return None if value is None else torch.where(kept, value, torch.zeros_like(value))

    log_prob, old_log_prob, advantages = clean(log_prob), clean(old_log_prob), clean(advantages)
    weights, rollout_log_prob = clean(weights), clean(rollout_log_prob)
    _check_needs(config, old_log_prob, advantages, weights, rollout_log_prob, rewards, group_ids)
    inputs = LossInputs(
        log_prob=log_prob, kept_mask=kept_mask, old_log_prob=old_log_prob, advantages=advantages,
        weights=weights, rollout_log_prob=rollout_log_prob, rewards=rewards, group_ids=group_ids,
        generator=generator,
    )
    loss, metrics = spec.compute(inputs, config)
    metrics = dict(metrics)
    total = aggregate(
        loss,
        kept_mask,
        config.agg_mode,
        denominator=config.denominator,
        denominator_mask=denominator_mask,
        norm_constant=config.norm_constant,
    )
    kept = kept.sum()
    valid = kept if denominator_mask is None else denominator_mask.bool().sum()
    dtype = log_prob.dtype
    metrics["actor/pg_loss"] = total.detach()
    metrics["actor/kept_token_fraction"] = (kept.to(dtype) / valid.to(dtype).clamp_min(1)).detach()
    metrics["actor/all_rejected"] = (kept == 0).to(dtype)
    return total, metrics


def _prepared(log_prob: Tensor, old_log_prob: Tensor | None, advantages: Tensor | None, weights: Tensor | None,
              rollout_log_prob: Tensor | None, rewards: Tensor | None, group_ids: Tensor | None
              ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(log_prob, old_log_prob, advantages, weights, rollout_log_prob) as a loss reads them: every (B,) input of
    the batch's row count (else a ValueError naming it), (B,) advantages broadcast to (B, T), and fp16 / bf16
    in float32 (as compute_correction does: exp of a log-ratio clamped to ±20 is 4.9e8, beyond fp16's 65504,
    and bf16's 8-bit mantissa would round the ratios near 1)."""
    if log_prob.dim() == 2:
        batch = log_prob.shape[0]
        for arg, value in (("advantages", advantages), ("rewards", rewards), ("group_ids", group_ids)):
            if value is not None and value.dim() == 1 and value.shape[0] != batch:
                raise ValueError(f"{arg} has shape {tuple(value.shape)}, expected ({batch},) for {batch} rows"
                                 + (f" or {tuple(log_prob.shape)}" if arg == "advantages" else ""))
    if advantages is not None and advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(log_prob)
    if log_prob.dtype in (torch.float16, torch.bfloat16):
        log_prob = log_prob.float()
    old_log_prob, advantages, weights, rollout_log_prob = (
        x.float() if x is not None and x.dtype in (torch.float16, torch.bfloat16) else x
        for x in (old_log_prob, advantages, weights, rollout_log_prob)
    )
    return log_prob, old_log_prob, advantages, weights, rollout_log_prob


def _check_needs(config: LossConfig, old_log_prob: Tensor | None, advantages: Tensor | None,
                 weights: Tensor | None, rollout_log_prob: Tensor | None, rewards: Tensor | None,
                 group_ids: Tensor | None) -> None:
    """ValueError when an input the loss's ``LossSpec`` needs is missing, or weights go to a loss that builds its
    own."""
    spec, name = config.spec, config.name
    if spec.needs_rollout_log_prob and rollout_log_prob is None:
        raise ValueError(f"loss {name!r} needs rollout_log_prob (log μ)")
    if not spec.takes_weights and weights is not None:
        raise ValueError(f"loss {name!r} builds its own weight (or none); do not pass weights")
    if spec.needs_rewards and (rewards is None or group_ids is None):
        raise ValueError(f"loss {name!r} needs rewards (B,) and group_ids (B,)")
    if spec.needs_advantages and advantages is None:
        raise ValueError(f"loss {name!r} needs advantages")
    if spec.needs_old_log_prob and old_log_prob is None:
        raise ValueError(f"loss {name!r} needs old_log_prob")
