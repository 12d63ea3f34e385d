"""``compute_correction``: the one entry point from log-probs to IS weights, rejection mask and metrics.

    statistics   ℓ_t = log π_old − log μ per token, reduced per row   (statistics.py; bypass: log π_θ − log μ)
    weights      w = clip(ρ)   ρ = e^ℓ_t (token), Π_t ρ_t or its geometric mean (sequence levels)   (weights.py)
    rejection    kept = response_mask ∧ RS ∧ veto ∧ TRM ∧ OPSM                                     (rejection.py)
    diagnostics  verl's off-policy metrics and rollcorr's divergences, from the row sums            (metrics.py)

Nothing here is differentiable. The only device syncs are the input checks (one small stacked read, plus one
for the optional inputs log_prob / advantages / log_kept_mass when given), which ``validate=False`` skips
when the caller has already checked the tensors, and, when a rejection rule is set, the check for a batch that
lost every token (``AllRejectedWarning``), which ``warn=False`` skips.

Cost: the statistics are one read of (B, T) by the C++ kernel built at setup (native.py), or one walk in plain
torch, block by block of rows, where it does not serve (statistics.py); every later step works on (B,) vectors,
except token-level rules, veto and OPSM, which read the (B, T) tokens. No call ever compiles
(docs/performance.md); ``fused.warm`` compiles the same statistics on request, before a run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction import metrics as metric_fns
from rollcorr.correction.ratios import any_per_row, check_extra, check_mask, check_not_newer, check_tensor
from rollcorr.correction.rejection import rejection_rules, rule_metrics
from rollcorr.correction.statistics import BatchStatistics, batch_statistics
from rollcorr.correction.weights import importance_weights

PREFIX = "rollout_corr/"


class AllRejectedWarning(UserWarning):
    """``compute_correction`` rejected every valid token of a batch: its loss is 0 and its gradient exactly 0."""


def warn_all_rejected(num_tokens: int, num_seqs: int, stacklevel: int = 4) -> None:
    """Say in words that a batch lost every token to rejection, and what to do about it."""
    warnings.warn(
        f"the correction rejected every token of this batch ({num_tokens} tokens in {num_seqs} sequences): "
        "its loss is 0 and its gradient exactly 0. The rejection thresholds are tighter than this batch's "
        "sampler/learner mismatch; widen them or choose a looser preset (the Geo-RS presets' [0.999, 1.001] "
        "band is meant for bf16-level mismatch only; docs/configuration.md, Presets).",
        AllRejectedWarning,
        stacklevel=stacklevel,
    )


@dataclass(frozen=True)
class CorrectionResult:
    """is_weights: (B, T) detached IS weights, 0 on padding (float32; float64 for float64 inputs) or None.
    kept_mask: (B, T) ``response_mask`` after rejection, same dtype as the input mask.
    metrics: ``rollout_corr/*`` 0-d tensors (read them with ``metrics_to_floats``)."""

    is_weights: Tensor | None
    kept_mask: Tensor
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class Inputs:
    """The checked inputs of one call: the ratio's anchor (π_old, or π_θ in bypass) and its name, log μ (of the
    full distribution when ``sampler_distribution="full"``), the mask, π_θ and the advantages (detached)."""

    anchor: Tensor
    rollout: Tensor
    mask: Tensor
    names: tuple[str, str]
    log_prob: Tensor | None
    advantages: Tensor | None


@torch.no_grad()
def compute_correction(
    old_log_prob: Tensor | None,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    config: CorrectionConfig,
    log_prob: Tensor | None = None,
    advantages: Tensor | None = None,
    log_kept_mass: Tensor | None = None,
    *,
    version: Tensor | None = None,
    current_version: int | Tensor | None = None,
    group: object | None = None,
    validate: bool = True,
    warn: bool = True,
    diagnostics: bool = True,
) -> CorrectionResult:
    """Correct a (B, T) batch of right-padded responses.

    old_log_prob      log π_old of the sampled tokens (decoupled mode; ignored in bypass, may be None)
    rollout_log_prob  log μ, the distribution the sampler drew from
    response_mask     1/True on valid tokens (bool, int or float)
    log_prob          log π_θ (bypass: required, the ratio is π_θ/μ; decoupled: optional, enables the
                      discrepancy/staleness metrics and serves OPSM instead of π_old)
    advantages        (B,) or (B, T); required when ``config.opsm_delta`` is set
    log_kept_mass     (B, T) log of the top-k/top-p kept mass; required when
                      ``config.sampler_distribution == "full"`` (then log μ_full = rollout + log_kept_mass)
    version, current_version   per-token weight version and the learner's version: staleness metrics
    group             process group for the batch-normalisation all-reduce (default group if None)
    warn              emit ``AllRejectedWarning`` when rejection removes every valid token (one device sync,
                      only when a rejection rule is configured; the trainer passes False and reports it
                      through its own alerts)
    diagnostics       True (default): every metric. False: only the correction's own metrics (the IS
                      weights', each rejection rule's, the counts, staleness); left out, and not computed:
                      ``metrics.DIAGNOSTIC_METRICS`` — verl's off-policy metrics (training_ppl … chi2_seq), the
                      divergences (gen_kl, policy_kl, js_divergence, token_mult_prob_error, log_ratio_*), the
                      probability mismatch (prob_*) and the discrepancy/drift split (*_k3). Weights, mask and
                      every metric kept are the same.
    """
    inputs = _checked_inputs(old_log_prob, rollout_log_prob, response_mask, config, log_prob, advantages,
                             log_kept_mass, version, current_version, validate)
    decomposition = config.mode == "decoupled" and log_prob is not None
    stats = batch_statistics(
        inputs.anchor, inputs.rollout, inputs.mask, config, names=inputs.names, validate=validate,
        diagnostics=diagnostics, log_prob=inputs.log_prob if decomposition else None,
    )
    weights, metrics = importance_weights(config, stats.rows, stats.row, stats.total, stats.weights,
                                          stats.mask_bool, group)
    kept_mask, rejection_metrics = _reject(stats, config, inputs, warn)
    metrics |= rejection_metrics
    if diagnostics:
        metrics |= metric_fns.diagnostics_from_sums(stats.row, stats.total, stats.rows)
    if version is not None:
        metrics |= metric_fns.staleness_metrics(version, current_version, stats.mask_bool, stats.rows)
    if diagnostics and decomposition:
        metrics |= metric_fns.decomposition_from_sums(stats.total, stats.rows)
    return CorrectionResult(weights if config.applies_weights else None, kept_mask,
                            {PREFIX + k: v for k, v in metrics.items()})


def _checked_inputs(
    old_log_prob: Tensor | None,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    config: CorrectionConfig,
    log_prob: Tensor | None,
    advantages: Tensor | None,
    log_kept_mass: Tensor | None,
    version: Tensor | None,
    current_version: int | Tensor | None,
    validate: bool,
) -> Inputs:
    """Type, shape and presence checks (no sync); with ``validate``, the optional inputs' values (one sync)."""
    if not isinstance(config, CorrectionConfig):
        raise TypeError(f"config must be a CorrectionConfig, got {type(config).__name__}")
    mask = check_mask(response_mask)
    shape = tuple(mask.shape)
    rollout = check_tensor("rollout_log_prob", rollout_log_prob, shape).detach()
    if log_prob is not None:
        log_prob = check_tensor("log_prob", log_prob, shape).detach()
    if config.mode == "bypass":
        if log_prob is None:
            raise ValueError("bypass mode computes the ratio π_θ/μ from log_prob: pass log_prob")
        names, anchor = ("log_prob", "rollout_log_prob"), log_prob
    else:
        if old_log_prob is None:
            raise ValueError("decoupled mode needs old_log_prob (π_old)")
        names = ("old_log_prob", "rollout_log_prob")
        anchor = check_tensor("old_log_prob", old_log_prob, shape).detach()
    non_positive: dict[str, Tensor] = {} if log_prob is None or config.mode == "bypass" else {"log_prob": log_prob}
    if config.sampler_distribution == "full":
        if log_kept_mass is None:
            raise ValueError("sampler_distribution='full' needs log_kept_mass (log of the top-k/top-p kept mass)")
        non_positive["log_kept_mass"] = check_tensor("log_kept_mass", log_kept_mass, shape).detach()
    finite_rows: dict[str, Tensor] = {}
    if config.opsm_delta is not None:
        if advantages is None:
            raise ValueError("opsm_delta is set: OPSM needs advantages at call time")
        if tuple(advantages.shape) not in (shape, shape[:1]):
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {shape[:1]} or {shape}")
        finite_rows["advantages"] = check_tensor("advantages", advantages).detach()
    if version is not None:
        check_tensor("version", version, shape, float_only=False)
        if current_version is None:
            raise ValueError("version given without current_version (the learner's version)")
        if validate:
            check_not_newer(version, current_version, mask)
    if validate and (non_positive or finite_rows):
        check_extra(mask if mask.dtype == torch.bool else mask != 0, non_positive, finite_rows)
    if config.sampler_distribution == "full":  # log μ_full = log μ + log kept mass
        rollout = rollout.to(torch.promote_types(rollout.dtype, torch.float32)) + non_positive["log_kept_mass"]
    return Inputs(anchor, rollout, mask, names, log_prob, finite_rows.get("advantages"))


def _reject(
    stats: BatchStatistics, config: CorrectionConfig, inputs: Inputs, warn: bool
) -> tuple[Tensor, dict[str, Tensor]]:
    """kept = response_mask ∧ token rules ∧ row rules (the rules of ``rejection.RULES`` that ``config`` sets),
    with each rule's metrics, the rejection totals and the counts; counts are exact integers in float."""
    outcomes = rejection_rules(config, stats, log_prob=inputs.log_prob, advantages=inputs.advantages)
    keep = None  # (B, T) bool, None while no token rule rejects
    row_keep = None  # (B,) bool, None while no sequence rule rejects
    for rule in outcomes:
        if rule.token_keep is not None:
            keep = rule.token_keep if keep is None else keep & rule.token_keep
        else:
            row_keep = rule.row_keep if row_keep is None else row_keep & rule.row_keep
    rows = stats.tok if stats.has_tokens else stats.rows  # token rules' metrics read the (B, T) tokens
    metrics = rule_metrics(outcomes, rows)
    mask = inputs.mask
    if keep is None:  # no rule, or sequence rules only: everything follows from the per-row counts n
        out_mask, kept_tokens, kept_rows = _apply_row_rules(mask, rows, row_keep, metrics)
    else:
        tok = stats.tok
        if row_keep is not None:
            keep = keep & row_keep[:, None]
        kept = tok.mask & keep
        kept_tokens = torch.count_nonzero(kept).to(tok.dtype)
        kept_rows, rejected_rows = any_per_row(kept), any_per_row(tok.mask & ~kept)
        metrics.update(metric_fns.rs_total_from_counts(tok.num_tokens - kept_tokens, rejected_rows, tok))
        out_mask = _masked(mask, keep)
    rejects = keep is not None or row_keep is not None
    _count_metrics(metrics, stats.rows, mask.shape[0], kept_tokens, kept_rows, warn and rejects)
    return out_mask, metrics


def _masked(mask: Tensor, keep: Tensor) -> Tensor:
    """``response_mask`` ∧ keep (keep: (B, T) or (B, 1) bool), in the mask's dtype. Bool masks are combined
    as their uint8 bytes (0 / 1, the same bits): torch's bool ``&`` with a broadcast operand is not vectorised
    (1.1 ms against 0.06 ms on 256 × 8192)."""
    if mask.dtype == torch.bool:
        return (mask.view(torch.uint8) & keep.view(torch.uint8)).view(torch.bool)
    return (mask * keep).to(mask.dtype)


def _apply_row_rules(
    mask: Tensor, rows, row_keep: Tensor | None, metrics: dict[str, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """(output mask, kept tokens (0-d), (B,) kept rows) when only sequence rules (``row_keep``, or None for
    no rule) reject; adds the rejection totals to ``metrics``."""
    if row_keep is None:
        return mask.clone(), rows.num_tokens, rows.valid
    kept_tokens = (rows.n * row_keep).sum()
    rejected_rows = rows.and_valid(~row_keep)
    metrics.update(metric_fns.rs_total_from_counts(rows.num_tokens - kept_tokens, rejected_rows, rows))
    return _masked(mask, row_keep[:, None]), kept_tokens, rows.and_valid(row_keep)


def _count_metrics(
    metrics: dict[str, Tensor], rows, num_seqs: int, kept_tokens: Tensor, kept_rows: Tensor, warn: bool
) -> None:
    """The counts for the loss denominator (docs/spec.md §3); ``warn``: check for a batch that lost every token
    (one sync) and say so with ``AllRejectedWarning``."""
    if warn and _lost_every_token(kept_tokens, rows.num_tokens):
        warn_all_rejected(int(rows.num_tokens), int(rows.num_rows), stacklevel=6)
    dtype = rows.dtype
    metrics["num_tokens"] = rows.num_tokens
    metrics["num_kept_tokens"] = kept_tokens
    metrics["num_seqs"] = torch.scalar_tensor(float(num_seqs), dtype=dtype, device=rows.n.device)
    metrics["num_valid_seqs"] = rows.num_rows
    metrics["num_kept_seqs"] = torch.count_nonzero(kept_rows).to(dtype)
    metrics["all_rejected"] = (kept_tokens == 0).to(dtype)


def _lost_every_token(kept_tokens: Tensor, num_tokens: Tensor) -> bool:
    """Whether rejection left no token of a batch that had some: CPU counts read as they are, device counts in
    one sync."""
    if kept_tokens.is_cpu:
        return kept_tokens.item() == 0 and num_tokens.item() > 0
    return bool((kept_tokens == 0) & (num_tokens > 0))
