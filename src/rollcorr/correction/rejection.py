"""Rejection (docs/spec.md §3): masks, not weights. Every rule returns a keep mask; rules combine with AND.

Per-token statistics from ℓ (clamped): k1 = −ℓ, k2 = ½ℓ², k3 = e^ℓ − 1 − ℓ. verl options:

    token_k{1,2,3}      the token statistic
    seq_sum_k{1,2,3}    Σ_t k   (seq_sum_k1 = −log Π ρ_t)
    seq_mean_k{1,2,3}   mean_t k (seq_mean_k1 = −log ρ_geo: Geo-RS)
    seq_max_k{2,3}      max_t k

K1 bounds a **ratio** window [lo, hi]: keep lo ≤ ρ ≤ hi (product for seq_sum, geometric mean for seq_mean),
i.e. −log hi ≤ k1 ≤ −log lo. verl's code instead keeps log lo ≤ k1 ≤ log hi (``verl=True``), which inverts
asymmetric windows (verl PR #6377, never merged). k2/k3 thresholds are upper bounds.

Binary KL (AReaL ``RejectionSamplingConfig(metric="binary_kl")``, "KPop"): with p = π_old(y_t), q = μ(y_t) the
probabilities of the sampled token, each clamped to [1e-8, 1 − 1e-8], and
KL_b(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)) (the KL of the Bernoulli "this token or not"),

    bkl_t = max(KL_b(p‖q), KL_b(q‖p))        (symmetric: a token is out if either direction exceeds u)

with the same four levels (``token_binary_kl``, ``seq_sum_binary_kl``, ``seq_mean_binary_kl``,
``seq_max_binary_kl``) and an upper bound u, like k2/k3. It is 0 on padding and where p = q.

Beyond verl: veto (any ρ_t < C drops the row), outlier ceiling (any ρ_t > C), TRM (max k2 ≤ δ_max and
mean k3 ≤ δ_avg) and OPSM (drop iff A < 0 and mean_t(log μ − log π_θ) > δ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rollcorr.correction.ratios import Tokens, any_per_row, kl_stats

if TYPE_CHECKING:
    from rollcorr.config.correction import CorrectionConfig


@dataclass(frozen=True)
class RSOutcome:
    """One option's decision and statistics (for the metrics)."""

    option: str
    token_keep: Tensor | None  # (B, T) bool for token options, None for sequence options
    row_keep: Tensor | None  # (B,) bool for sequence options
    token_stat: Tensor | None  # (B, T) statistic for token options (0 on padding)
    row_stat: Tensor  # (B,) per-row statistic (row mean of the token stat for token options)
    lower: float | None  # bounds in statistic space (lower only for K1)
    upper: float


def k1_bounds(window: tuple[float, float], verl: bool) -> tuple[float, float]:
    """Statistic-space bounds on k1 = −log ρ for a ratio window (lo, hi)."""
    lo, hi = window
    return (math.log(lo), math.log(hi)) if verl else (-math.log(hi), -math.log(lo))


BINARY_KL_EPS = 1e-8


def split_option(option: str) -> tuple[str, str]:
    """``"seq_mean_k3"`` → ``("seq_mean", "k3")``; ``"token_binary_kl"`` → ``("token", "binary_kl")``."""
    if option.endswith("_binary_kl"):
        return option[: -len("_binary_kl")], "binary_kl"
    kind, stat = option.rsplit("_", 1)
    return kind, stat


def binary_kl(log_p: Tensor, log_q: Tensor, eps: float = BINARY_KL_EPS) -> Tensor:
    """KL_b(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)) elementwise, p and 1 − p clamped to [eps, 1 − eps].

    1 − p is computed as −expm1(log p): in float32, 1 − 1e-8 rounds to 1, and AReaL's 1 − clamp(p) would give
    0·log(0/0) = NaN for a token of probability ≈ 1 (e.g. on zero padding). Same value otherwise."""
    p, q = log_p.exp().clamp(eps, 1.0 - eps), log_q.exp().clamp(eps, 1.0 - eps)
    p_bar, q_bar = (-log_p.expm1()).clamp(eps, 1.0 - eps), (-log_q.expm1()).clamp(eps, 1.0 - eps)
    return p * (p / q).log() + p_bar * (p_bar / q_bar).log()


def rs_statistic(option: str, tok: Tokens) -> Tensor:
    """The per-token statistic (B, T) an RS option thresholds, 0 on padding: k1 = −ℓ, k2 = ½ℓ², k3 = ρ − 1 − ℓ
    (from the clamped ℓ) or the symmetric binary KL max(KL_b(p_old‖p_μ), KL_b(p_μ‖p_old))."""
    stat = split_option(option)[1]
    if stat != "binary_kl":
        return kl_stats(tok, stat)
    # tok.old / tok.rollout are 0 on padding: p = q there, so the statistic is exactly 0
    return torch.maximum(binary_kl(tok.old, tok.rollout), binary_kl(tok.rollout, tok.old))


def _row_max(x: Tensor, tok: Tokens) -> Tensor:
    """Masked row max; 0 for all-padding rows (verl's convention)."""
    m = tok.valid_max(x, dim=-1)
    return torch.where(tok.valid, m, torch.zeros_like(m))


def rs_option(
    option: str,
    threshold: float | tuple[float, float],
    x: Tensor | None,
    tok: Tokens,
    *,
    row_sum: Tensor | None = None,
) -> RSOutcome:
    """Apply one RS option to its per-token statistic ``x`` (k1, k2, k3 or binary KL; 0 on padding).
    ``seq_sum`` / ``seq_mean`` options need only Σ_t x: pass it as ``row_sum`` (B,) and ``x=None`` to skip
    building x (e.g. Σ_t k1 = −Σ_t ℓ, bit-identical since negation is exact)."""
    kind, k = split_option(option)
    if k == "k1":
        lower, upper = k1_bounds(threshold, tok.verl)  # type: ignore[arg-type]
    else:
        lower, upper = None, float(threshold)  # type: ignore[arg-type]

    def inside(v: Tensor) -> Tensor:
        keep = v <= upper
        return keep & (v >= lower) if lower is not None else keep

    if kind in ("seq_sum", "seq_mean") and row_sum is None:
        row_sum = x.sum(dim=-1)
    if kind == "token":
        return RSOutcome(option, inside(x), None, x, tok.row_mean(x), lower, upper)
    if kind == "seq_sum":
        row = row_sum
    elif kind == "seq_mean":
        row = tok.row_mean_of_sum(row_sum)
    elif kind == "seq_max":
        row = _row_max(x, tok)
    else:  # config validation makes this unreachable
        raise ValueError(f"unknown rs option {option!r}")
    return RSOutcome(option, None, inside(row), None, row, lower, upper)


def veto_keep(tok: Tokens, floor: float | None, ceiling: float | None) -> tuple[Tensor, Tensor]:
    """(row keep (B,), per-token catastrophic flags (B, T)): a row is dropped if any valid ρ_t < floor or
    > ceiling. Compared in log space on the unclamped ℓ."""
    bad = torch.zeros_like(tok.mask)
    for limit, hit in ((floor, torch.lt), (ceiling, torch.gt)):
        if limit is not None:
            bad |= hit(tok.log_ratio, math.log(limit))
    bad &= tok.mask
    return ~any_per_row(bad), bad


def trm_keep(
    k2: Tensor, k3: Tensor, tok: Tokens, max_k2: float | None, mean_k3: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Trust-region masking: keep a row iff max_t k2_t ≤ δ_max and mean_t k3_t ≤ δ_avg (either may be off).
    Returns (row keep, row max k2, row mean k3)."""
    row_max_k2 = _row_max(k2, tok)
    row_mean_k3 = tok.row_mean(k3)
    keep = torch.ones_like(tok.valid)
    if max_k2 is not None:
        keep = keep & (row_max_k2 <= max_k2)
    if mean_k3 is not None:
        keep = keep & (row_mean_k3 <= mean_k3)
    return keep, row_max_k2, row_mean_k3


def opsm_keep(
    rollout_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, tok: Tokens, delta: float
) -> tuple[Tensor, Tensor]:
    """OPSM (DeepSeek-V3.2): drop a row iff A < 0 and mean_t(log μ − log π_θ) > δ.
    ``advantages`` is (B,) or (B, T) (then its masked row mean is the row's advantage).
    Returns (row keep, row divergence)."""
    diff = torch.where(tok.mask, rollout_log_prob.to(tok.mask_f.dtype) - log_prob.to(tok.mask_f.dtype), 0.0)
    row_div = tok.row_mean(diff)
    adv = advantages.to(tok.mask_f.dtype)
    if adv.dim() == 2:
        adv = tok.row_mean(torch.where(tok.mask, adv, 0.0))
    return (adv >= 0) | (row_div <= delta), row_div


# ----------------------------------------------------------------------------------------------- the rule list


@dataclass(frozen=True)
class RuleOutcome:
    """One rejection rule of a config applied alone. Exactly one of ``token_keep`` / ``row_keep`` is set.

    rule: the RS option name, ``veto`` (ρ floor), ``veto_upper`` (ρ ceiling), ``trm_max_k2``, ``trm_mean_k3``
    or ``opsm``. stat: what the rule compares, (B, T) for token rules and (B,) for sequence rules, in the
    statistic's own space (RS: k1/k2/k3/binary KL; veto: ℓ; TRM: row max k2 / row mean k3; OPSM: row mean of
    log μ − log π_θ). lower / upper: its bounds there (None = unbounded). threshold: the configured value
    (RS: as in ``rs_thresholds``; veto: the ρ floor / ceiling; TRM, OPSM: δ). rs: the RS outcome (RS rules).
    flags: (B, T) tokens that trip a veto. trm: (row max k2, row mean k3) for the TRM metrics.
    """

    rule: str
    token_keep: Tensor | None
    row_keep: Tensor | None
    stat: Tensor
    lower: float | None
    upper: float | None
    threshold: float | tuple[float, float]
    rs: RSOutcome | None = None
    flags: Tensor | None = None
    trm: tuple[Tensor, Tensor] | None = None


def rejection_rules(
    config: CorrectionConfig,
    tok: Tokens,
    *,
    k3: Tensor | None = None,
    log_prob: Tensor | None = None,
    advantages: Tensor | None = None,
) -> list[RuleOutcome]:
    """Every rejection rule ``config`` sets, each applied alone, in order: the RS options, veto floor, veto
    ceiling, TRM max k2, TRM mean k3, OPSM. ``compute_correction`` ANDs their keeps into the mask; ``analyze``
    explains each. k3: ``kl_stats(tok, "k3")`` if already built. log_prob: π_θ for OPSM (default: the anchor
    ``tok.old``). advantages: (B,) or (B, T), needed by OPSM."""
    rules: list[RuleOutcome] = []
    for option, threshold in zip(config.rs, config.rs_thresholds):
        if option in ("seq_sum_k1", "seq_mean_k1"):  # Σ_t k1 = −Σ_t ℓ: no (B, T) statistic needed
            r = rs_option(option, threshold, None, tok, row_sum=-tok.log_ratio_safe.sum(dim=-1))
        else:
            stat = k3 if k3 is not None and option.endswith("k3") else rs_statistic(option, tok)
            r = rs_option(option, threshold, stat, tok)
        stat = r.token_stat if r.token_keep is not None else r.row_stat
        rules.append(RuleOutcome(option, r.token_keep, r.row_keep, stat, r.lower, r.upper, threshold, rs=r))
    for name, floor, ceiling in (
        ("veto", config.veto_threshold, None),
        ("veto_upper", None, config.veto_upper),
    ):
        if floor is not None or ceiling is not None:
            keep, bad = veto_keep(tok, floor, ceiling)
            limit = floor if floor is not None else ceiling
            bound = math.log(limit)
            lower, upper = (bound, None) if floor is not None else (None, bound)
            rules.append(RuleOutcome(name, None, keep, tok.log_ratio, lower, upper, limit, flags=bad))
    if config.trm_max_k2 is not None or config.trm_mean_k3 is not None:
        k2, k3 = kl_stats(tok, "k2"), (k3 if k3 is not None else kl_stats(tok, "k3"))
        for name, max_k2, mean_k3 in (("trm_max_k2", config.trm_max_k2, None), ("trm_mean_k3", None, config.trm_mean_k3)):  # fmt: skip
            if max_k2 is not None or mean_k3 is not None:
                keep, row_max_k2, row_mean_k3 = trm_keep(k2, k3, tok, max_k2, mean_k3)
                stat = row_max_k2 if max_k2 is not None else row_mean_k3
                trm = (row_max_k2, row_mean_k3)
                upper = max_k2 if max_k2 is not None else mean_k3
                rules.append(RuleOutcome(name, None, keep, stat, None, upper, upper, trm=trm))
    if config.opsm_delta is not None:
        if advantages is None:
            raise ValueError("opsm_delta is set: OPSM needs advantages")
        pi_theta = log_prob if log_prob is not None else tok.old
        keep, row_div = opsm_keep(tok.rollout, pi_theta, advantages, tok, config.opsm_delta)
        rules.append(RuleOutcome("opsm", None, keep, row_div, None, config.opsm_delta, config.opsm_delta))
    return rules
