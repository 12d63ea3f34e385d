"""Mismatch statistics between the sampler (μ) and the learner (π_old) on the same sampled tokens.

All inputs are (B, T) right-padded tensors: ``rollout_log_prob`` = log μ(y_t), ``old_log_prob`` =
log π_old(y_t), ``response_mask`` True on valid tokens. Per token (docs/spec.md §1):

    ℓ_t = log π_old − log μ            (log-ratio, clamped to ±20 before any exp)
    ρ_t = exp(ℓ_t)                     (discrepancy ratio)
    Δp_t = p_μ − p_old,  p = exp(log p)

The tokens were drawn from μ, so every expectation below is an average over sampled tokens (a per-token
Monte-Carlo estimate; the full-vocabulary KL is not available from sampled-token log-probs):

    KL(μ‖π_old):  k1 = mean(−ℓ)   (kl)            k3 = mean(ρ − 1 − ℓ)    (k3_kl, ≥ 0 per token)
    KL(π_old‖μ):  k1 = mean(ρ·ℓ)  (policy_kl_k1)  k3 = mean(1 − ρ + ρ·ℓ)  (policy_kl, importance-weighted)
    χ²_token = mean(ρ²) − 1             χ²_seq = mean_b exp(2·S_b) − 1,  S_b = Σ_t ℓ_t
    ESS_token = (Σρ)² / (N·Σρ²)         ESS_seq = (Σ_b w_b)² / (B·Σ_b w_b²),  w_b = exp(S_b)

ESS is a fraction in (0, 1]: 1 when the sampler and learner agree. Rows without a valid token never enter
per-response statistics. The probability-space table, KL, χ² and PPL metrics come from
``rollcorr.correction.metrics`` (one implementation, the names training logs use); the audit adds the reverse
k1, ESS and the per-response / per-position / worst-token views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollcorr.audit.levels import k3_level, row_k3, verdict_level
from rollcorr.config.correction import LOG_RATIO_CLAMP
from rollcorr.correction.metrics import (
    divergence_metrics,
    metrics_to_floats,
    mismatch_stats,
    offpolicy_metrics,
)
from rollcorr.correction.ratios import make_tokens

# Sampler log-probs computed in low precision can round a certain token to a hair above 0.
POSITIVE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class TokenView:
    """Validated float64 views of the inputs. All (B, T); padding holds 0."""

    log_mu: Tensor
    log_old: Tensor
    mask: Tensor  # bool

    @property
    def log_ratio(self) -> Tensor:
        """ℓ = log π_old − log μ, clamped to ±20, 0 on padding."""
        return (self.log_old - self.log_mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * self.mask

    @property
    def abs_diff(self) -> Tensor:
        """|p_μ − p_old|, 0 on padding."""
        return (self.log_mu.exp() - self.log_old.exp()).abs() * self.mask


def check_inputs(rollout_log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> TokenView:
    """Validate shapes, dtypes and values; return float64 tensors with padding zeroed.

    Raises ValueError naming the problem: non-2-D or mismatched shapes, integer log-probs, an empty mask,
    NaN/inf or positive log-probs on valid tokens. Anything in padding positions is ignored.
    """
    tensors = {"rollout_log_prob": rollout_log_prob, "old_log_prob": old_log_prob}
    for name, x in tensors.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must be (B, T), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor of log-probs, got {x.dtype}")
    if rollout_log_prob.shape != old_log_prob.shape or tuple(response_mask.shape) != tuple(
        rollout_log_prob.shape
    ):
        raise ValueError(
            f"shape mismatch: rollout_log_prob {tuple(rollout_log_prob.shape)}, old_log_prob "
            f"{tuple(old_log_prob.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    if response_mask.dtype != torch.bool:
        if (
            response_mask.is_floating_point()
            and not torch.isin(response_mask, torch.tensor([0.0, 1.0])).all()
        ):
            raise ValueError("response_mask must hold only 0 and 1")
        response_mask = response_mask != 0
    mask = response_mask.detach().cpu()
    if not mask.any():
        raise ValueError("response_mask has no valid token: nothing to audit")
    out = {}
    for name, x in tensors.items():
        x = x.detach().cpu().to(torch.float64)
        valid = x[mask]
        bad = ~torch.isfinite(valid)
        if bad.any():
            where = mask.nonzero()[bad.nonzero()[0, 0]].tolist()
            raise ValueError(
                f"{name} has {int(bad.sum())} NaN/inf value(s) on valid tokens, first at {where}"
            )
        positive = valid > POSITIVE_TOLERANCE
        if positive.any():
            where = mask.nonzero()[positive.nonzero()[0, 0]].tolist()
            raise ValueError(
                f"{name} has {int(positive.sum())} positive log-prob(s) on valid tokens (max "
                f"{valid.max().item():.4g}, first at {where}): are these probabilities, not log-probs?"
            )
        out[name] = torch.where(mask, x.clamp(max=0.0), torch.zeros((), dtype=torch.float64))
    return TokenView(out["rollout_log_prob"], out["old_log_prob"], mask)


def _quantiles(x: Tensor) -> dict[str, float]:
    """Distribution summary of a 1-D float64 tensor."""
    q = torch.quantile(x, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {
        "mean": x.mean().item(),
        "median": q[0].item(),
        "p90": q[1].item(),
        "p99": q[2].item(),
        "max": x.max().item(),
    }


def probability_mismatch(view: TokenView) -> dict[str, float]:
    """The ABEJA table and the TIS paper's metrics in probability space (docs/spec.md §4), under the correction
    library's names: ``prob_diff_frac_lt_1e-3``, ``prob_diff_frac_ge_{0.01,0.05,0.1}``, ``prob_diff_max``,
    ``prob_diff_mean``, ``prob_diff_seq_max_mean``, ``prob_diff_seq_mean_mean``, ``prob_pearson``."""
    return metrics_to_floats(mismatch_stats(view.log_old, view.log_mu, view.mask))


def per_response(view: TokenView) -> dict[str, Tensor]:
    """Per-row values over rows with at least one valid token. Each (B',) float64."""
    rows = view.mask.any(dim=1)
    count = view.mask.sum(dim=1)
    abs_diff = view.abs_diff
    log_ratio = view.log_ratio
    return {
        "row": rows.nonzero().squeeze(1),
        "length": count[rows].to(torch.float64),
        "max_abs_diff": abs_diff.max(dim=1).values[rows],
        "mean_abs_diff": (abs_diff.sum(dim=1) / count.clamp(min=1))[rows],
        "seq_log_ratio": log_ratio.sum(dim=1)[rows],
    }


def divergences(view: TokenView) -> dict[str, float]:
    """verl's off-policy metrics and the correction library's divergences (``kl`` = k1 and ``k3_kl`` = k3 of
    KL(μ‖π_old), ``policy_kl`` = k3 of KL(π_old‖μ), ``js_divergence``, ``chi2_token``, ``chi2_seq``,
    ``log_ratio_mean``, ``log_ratio_abs_mean``, PPLs ...), plus the audit's own: ``policy_kl_k1`` = mean(ρ·ℓ),
    ``ess_token``, ``ess_seq`` and the extreme log-ratios. Formulas in the module docstring."""
    tok = make_tokens(view.log_old, view.log_mu, view.mask, bound=LOG_RATIO_CLAMP, verl=False)
    out = metrics_to_floats({**offpolicy_metrics(tok), **divergence_metrics(tok)})
    lr = view.log_ratio[view.mask]
    rho = lr.exp()
    w = per_response(view)["seq_log_ratio"].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    out.update(
        policy_kl_k1=(rho * lr).mean().item(),
        ess_token=(rho.sum().square() / (rho.numel() * rho.square().sum())).item(),
        ess_seq=(w.sum().square() / (w.numel() * w.square().sum())).item(),
        log_ratio_min=lr.min().item(),
        log_ratio_max=lr.max().item(),
    )
    return out


def position_profile(view: TokenView, n_buckets: int = 20) -> dict[str, list[float]]:
    """|Δp| along the response: mean and max per bucket of positions.

    Returns lists of equal length: ``start`` (first position of the bucket), ``end`` (exclusive),
    ``mean``, ``max`` and ``count`` (valid tokens in the bucket); empty buckets are dropped.
    """
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
    t = int(view.mask.any(dim=0).nonzero().max()) + 1  # last position holding any valid token
    width = -(-t // n_buckets)
    out: dict[str, list[float]] = {"start": [], "end": [], "mean": [], "max": [], "count": []}
    abs_diff = view.abs_diff
    for start in range(0, t, width):
        m = view.mask[:, start : start + width]
        if not m.any():
            continue
        d = abs_diff[:, start : start + width][m]
        out["start"].append(start)
        out["end"].append(min(start + width, t))
        out["mean"].append(d.mean().item())
        out["max"].append(d.max().item())
        out["count"].append(int(m.sum()))
    return out


def worst_tokens(view: TokenView, k: int = 10) -> list[dict[str, float | int]]:
    """The k valid tokens with the largest |Δp|, largest first: row, position, p_sampler, p_learner."""
    abs_diff = torch.where(view.mask, view.abs_diff, torch.full_like(view.abs_diff, -1.0))
    k = min(k, int(view.mask.sum()))
    values, flat = abs_diff.flatten().topk(k)
    t = view.mask.shape[1]
    out = []
    for value, index in zip(values.tolist(), flat.tolist()):
        row, pos = divmod(index, t)
        out.append(
            {
                "row": row,
                "position": pos,
                "p_sampler": view.log_mu[row, pos].exp().item(),
                "p_learner": view.log_old[row, pos].exp().item(),
                "abs_diff": value,
                "log_ratio": view.log_ratio[row, pos].item(),
            }
        )
    return out


MAX_OVER_TOP = 1 << 16  # largest |Δp| a chunked dump audit keeps for ``median_max_over``


def median_max_over(top: Tensor, total: int, n: int) -> float | None:
    """The median of the max |Δp| over ``n`` tokens drawn from the audit's ``total`` tokens: the max of n draws is
    ≤ x with probability F(x)^n (F the tokens' empirical distribution), so its median is F's quantile at
    0.5^(1/n) — what a max over n tokens of these engines usually is, comparable with a max published over n
    tokens where the audit's own max (over all its tokens) is not. ``top``: the largest |Δp| of the tokens (all
    of them, or at least the ones above that quantile), descending; None when they do not reach it, and None
    when the audit has fewer than ``n`` tokens (its sample does not reach the quantile: the estimate would be
    its own max, or below it). Linear interpolation between order statistics, as ``torch.quantile``."""
    position = (total - 1) * 0.5 ** (1.0 / n)
    below = int(position)
    need = total - below  # the quantile reads the values of ascending ranks `below` and `below + 1`
    if total < max(n, 1) or need > top.numel():
        return None
    low = float(top[total - 1 - below])
    high = float(top[total - 2 - below]) if below + 1 <= total - 1 else low
    return low + (position - below) * (high - low)


def audit_stats(
    rollout_log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor, *, worst_k: int = 10
) -> dict:
    """Everything the audit report shows, as plain floats / lists (JSON-ready).

    Keys: ``n_responses``, ``n_tokens``, ``probability`` (ABEJA table, Pearson, per-response max/mean |Δp|
    distributions), ``divergence`` (log-ratio moments, KL both ways, χ², ESS), ``position`` (profile) and
    ``worst_tokens``, ``verdict_level`` (the level the verdict reads: ``rollcorr.audit.levels``),
    ``tokens_differing`` (tokens whose two log-probs are not bitwise equal), ``k3_level`` (k3 among published
    levels: ``rollcorr.audit.levels.k3_level``).
    """
    view = check_inputs(rollout_log_prob, old_log_prob, response_mask)
    rows = per_response(view)
    prob = probability_mismatch(view)
    return {
        "n_responses": int(rows["row"].numel()),
        "n_tokens": int(view.mask.sum()),
        # tokens whose two log-probs differ in any bit (0 for an exact pair such as hf:exact)
        "tokens_differing": int(((view.log_mu != view.log_old) & view.mask).sum()),
        "probability": prob,
        "per_response": {
            "max_abs_diff": _quantiles(rows["max_abs_diff"]),
            "mean_abs_diff": _quantiles(rows["mean_abs_diff"]),
            "length": _quantiles(rows["length"]),
        },
        "divergence": divergences(view),
        "position": position_profile(view),
        "worst_tokens": worst_tokens(view, worst_k),
        "verdict_level": verdict_level(view.abs_diff, view.mask),
        "k3_level": k3_level(row_k3(view.log_ratio, view.mask), view.mask.sum(dim=1).double()),
    }
