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

import torch
import torch.distributed as dist
from torch import Tensor

from rollcorr.correction.ratios import Rows, Tokens


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
    thresholded weight), each (B,). The fused path broadcasts the last to the row's tokens; ``raw_weights``
    then ``apply_threshold`` give the same values on (B, T)."""
    row_log = row_log_weight(row_sum, rows.n, level)
    row_raw = row_log.clamp(-bound, bound).exp()
    return row_log, row_raw, apply_threshold(row_raw, rows.valid.to(rows.dtype), mode, upper, lower)


def apply_threshold(
    raw: Tensor, mask_f: Tensor, mode: str, upper: float | None, lower: float | None
) -> Tensor:
    """Truncate (clamp) or mask (zero outside the band, keep ρ inside) the raw weights."""
    if mode == "truncate":
        if upper is None and lower is None:
            return raw
        w = raw.clamp(min=lower, max=upper)
        return w * mask_f if lower is not None else w  # a lower clamp would lift padding off 0
    if mode == "mask":
        keep = raw <= (float("inf") if upper is None else upper)
        if lower:
            keep = keep & (raw >= lower)
        return torch.where(keep, raw, 0.0)
    raise ValueError(f"is_mode={mode!r}; choose one of ['truncate', 'mask']")


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
