"""Importance weights (docs/spec.md §2): level, truncation or IcePop masking, optional batch normalisation.

    token:      w_t = ρ_t                      = exp(ℓ_t)
    sequence:   w   = Π_t ρ_t                  = exp(Σ_t ℓ_t)           broadcast to the row
    geometric:  w   = (Π_t ρ_t)^(1/T)          = exp(mean_t ℓ_t)        broadcast to the row
    truncate:   w ← clamp(w, lower, upper)     (TIS; lower optional, ratios < 1 untouched by default)
    mask:       w ← w · 1[lower ≤ w ≤ upper]   (IcePop / Seq-MIS: inside the band w keeps its value)
    normalise:  w ← w / mean(w)                (masked mean after truncation; per-sequence for seq levels)

Exponents are clamped to ±bound. Weights are 0 on padding.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from rollcorr.correction import metrics as metric_fns
from rollcorr.correction.ratios import Rows, Tokens

if TYPE_CHECKING:
    from rollcorr.config.correction import CorrectionConfig


def row_log_weight(row_sum: Tensor, n: Tensor, level: str) -> Tensor:
    """The (B,) log weight of a sequence level from the row sums Σ_t ℓ_t (unclamped): Σ_t ℓ_t (sequence) or
    mean_t ℓ_t (geometric); 0 for all-padding rows."""
    if level == "geometric":
        return row_sum / n.clamp_min(1)
    if level != "sequence":
        raise ValueError(f"is_level={level!r}; choose one of ['token', 'sequence', 'geometric']")
    return row_sum


def raw_weights(tok: Tokens, level: str, bound: float) -> tuple[Tensor, Tensor | None]:
    """(raw (B, T) weights before thresholds, 0 on padding; per-row log weight (B,) for seq levels)."""
    if level == "token":
        return tok.ratio * tok.mask_f, None
    row_log = row_log_weight(tok.log_ratio.sum(dim=-1), tok.n, level)
    row_w = row_log.clamp(-bound, bound).exp()
    return row_w[:, None] * tok.mask_f, row_log


def row_weights(
    row_sum: Tensor, rows: Rows, level: str, bound: float, mode: str, upper: float | None, lower: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """A sequence level's weights per row from Σ_t ℓ_t: (log weight, raw weight exp(clamp(log, ±bound)),
    thresholded weight), each (B,). ``importance_weights`` broadcasts the last to the row's tokens; ``raw_weights``
    then ``apply_threshold`` give the same values on (B, T)."""
    row_log = row_log_weight(row_sum, rows.n, level)
    row_raw = row_log.clamp(-bound, bound).exp()
    return row_log, row_raw, apply_threshold(row_raw, rows.valid.to(rows.dtype), mode, upper, lower)


def apply_threshold(
    raw: Tensor, mask_f: Tensor, mode: str, upper: float | None, lower: float | None, *, out: Tensor | None = None
) -> Tensor:
    """Truncate (clamp) or mask (zero outside the band, keep ρ inside) the raw weights; ``out``: where to write
    them (a fresh tensor otherwise; ``raw`` itself when nothing applies and no ``out`` is given). The band's
    flags are 0/1 floats multiplied in (ρ·1 = ρ, ρ·0 = 0: a bool ``where`` is ~10× slower on large batches)."""
    if mode == "truncate":
        if upper is None and lower is None:
            return raw if out is None else out.copy_(raw)
        w = torch.clamp(raw, min=lower, max=upper, out=out)
        return w.mul_(mask_f) if lower is not None else w  # a lower clamp would lift padding off 0
    if mode == "mask":
        w = torch.le(raw, math.inf if upper is None else upper, out=torch.empty_like(raw) if out is None else out)
        if lower:
            w.mul_(torch.ge(raw, lower, out=torch.empty_like(raw)))
        return w.mul_(raw)
    raise ValueError(f"is_mode={mode!r}; choose one of ['truncate', 'mask']")


def importance_weights(
    config: CorrectionConfig,
    rows: Rows,
    row: dict[str, Tensor],
    total: dict[str, Tensor],
    token_weights: Tensor | None,
    mask_bool: Tensor,
    group: object | None = None,
) -> tuple[Tensor | None, metric_fns.Metrics]:
    """(B, T) IS weights w = threshold(ρ) (0 on padding), batch-normalised when ``config`` asks, and the IS
    metrics; (None, {}) without IS. From a batch's statistics (``statistics.BatchStatistics``: ``rows``, the
    per-row reductions ``row``, the totals ``total``): at token level the pass wrote w (``token_weights``);
    sequence levels threshold the (B,) row weight exp(clamp(Σ_t ℓ_t or mean_t ℓ_t)) (``row_weights``) and
    broadcast it to the row's valid tokens (``mask_bool`` (B, T))."""
    if config.is_level is None:
        return None, {}
    level, mode, upper, lower = config.is_level, config.is_mode, config.is_upper, config.is_lower
    if level == "token":
        w = token_weights
        metrics = metric_fns.is_metrics_from_sums(
            rows, upper, lower, mode, row_log=None, w_sum=row["w_sum"].sum(), w_sq=total["w_sq"],
            w_row_sum=row["w_sum"], raw_row_sum=row["raw"], high=total["high"], low=total["low"],
            w_max=total["w_max"], w_min=total["w_min"],
        )
    else:
        row_log, row_raw, row_w = row_weights(row["lr"], rows, level, config.safety_bound, mode, upper, lower)
        oob = None
        if mode == "mask":
            out = (row_raw > metric_fns.is_band(upper, lower)[1]) | (row_raw < (lower or 0.0))
            oob = (rows.n * out).sum()
        metrics = metric_fns.is_metrics_from_sums(
            rows, upper, lower, mode, row_log=row_log, w_sum=(row_w * rows.n).sum(),
            w_sq=(row_w.square() * rows.n).sum(), w_row_sum=row_w * rows.n, raw_row_sum=row_raw * rows.n,
            oob=oob,
        )
        # w_bt = 1[valid]·w_row (the mask's bytes as floats: a broadcast ``where`` on a bool mask is ~4× slower)
        w = mask_bool.view(torch.uint8).to(row_w.dtype).mul_(row_w[:, None])
    if config.batch_normalize:
        factor = norm_factor(w, rows.n, rows.valid, level, den=rows.den if rows.verl else None, group=group)
        w = w.div_(factor)  # w is this call's own buffer
        metrics["rollout_is_batch_norm_factor"] = factor
    return w, metrics


LOCAL = "local"  # ``group`` value: the batch is already global on this rank (no all-reduce)


def _all_reduce_sum(x: Tensor, group: object | None) -> Tensor:
    """Σ over the ranks of ``group`` (None: the default group) when torch.distributed is initialised;
    ``x`` itself for ``group=LOCAL`` or a single process."""
    if group is LOCAL:
        return x
    if dist.is_available() and dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def batch_norm_factor(w: Tensor, tok: Tokens, level: str, group: object | None = None) -> Tensor:
    """Masked mean of the weights: over valid tokens (token level) or over valid rows of the per-row
    weight (sequence / geometric). Summed across the ranks of ``group`` when ``torch.distributed`` is
    initialised (``LOCAL``: not summed — the data-parallel trainer passes the global batch).
    Returns 1 when the mean is ≤ 1e-8 (everything masked), so normalising never divides by 0."""
    return norm_factor(w, tok.n, tok.valid, level, den=tok.den if tok.verl else None, group=group)


def norm_factor(
    w: Tensor, n: Tensor, valid: Tensor, level: str, *, den=None, group: object | None = None
) -> Tensor:
    """The divisor of batch normalisation for (B, T) weights ``w`` (0 on padding) with ``n`` (B,) valid tokens
    per row and ``valid`` (B,) rows holding one: the masked token mean (token level) or the mean over valid rows
    of the per-row weight (sequence / geometric). ``batch_norm_factor`` on a whole batch; the trainer calls it
    on each mini- or micro-batch for ``batch_norm_scope``. ``den``: verl's masked-mean denominator
    (``Tokens.den``, verl mode), None = the plain count. Returns 1 when the mean is ≤ 1e-8."""
    n = n.to(w.dtype)
    if level == "token":
        stats = torch.stack([w.sum(), n.sum()])
    else:
        row_w = w.sum(dim=-1) / (den(n) if den is not None else n.clamp_min(1))
        stats = torch.stack([(row_w * valid).sum(), valid.sum().to(w.dtype)])
    num, count = _all_reduce_sum(stats, group).unbind()
    if level == "token":
        mean = num / (den(count) if den is not None else count)
    else:
        mean = num / count.clamp_min(1e-8)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))
