"""Reduce a per-token (B, T) or per-sequence (B,) loss to a scalar under the denominator policy
(docs/spec.md §3), and the count it divides by (``loss_count``), which makes the reduction additive over parts
of a batch: micro-batches and data-parallel ranks (global-batch normalisation)."""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.config.loss import AGG_MODES, DENOMINATORS


def _check(agg: str, denominator: str) -> None:
    if denominator not in DENOMINATORS:
        raise ValueError(f"unknown denominator {denominator!r}; choose one of {DENOMINATORS}")
    if agg not in AGG_MODES:
        raise ValueError(f"unknown aggregation {agg!r}; choose one of {AGG_MODES}")


def loss_count(
    kept_mask: Tensor,
    agg: str = "token-mean",
    *,
    denominator: str = "kept",
    denominator_mask: Tensor | None = None,
    per_sequence: bool = False,
) -> Tensor | None:
    """The count ``aggregate`` divides the summed loss by (before ``clamp_min(1)``), as a 0-d tensor; None for
    token-sum (no denominator). Every count is a sum over rows, so for a batch cut into parts P (micro-batches,
    ranks): aggregate(batch) = Σ_P aggregate(P) · count(P) / count(batch) — the global-batch normalisation
    (verl's ``global_batch_info``): each part's loss scaled by its share of the *global* count.

      token-mean                                   N_tok  (Σ m0: tokens under the denominator policy)
      seq-mean-token-sum / -token-mean / -sum-norm N_seq  (sequences under the policy; the norm constant cancels)
      per-sequence loss (gmpo, oapl)               N_seq
      token-sum                                    None
    """
    _check(agg, denominator)
    m = kept_mask.bool()
    m0 = m if denominator_mask is None or denominator == "kept" else denominator_mask.bool()
    if agg == "token-sum" and not per_sequence:
        return None
    if agg == "token-mean" and not per_sequence:
        return m0.sum()
    return {
        "kept": lambda: (m.sum(-1) > 0).sum(),
        "original": lambda: (m0.sum(-1) > 0).sum(),
        "batch": lambda: torch.tensor(m.shape[0], device=m.device),
    }[denominator]()


def aggregate(
    loss: Tensor,
    kept_mask: Tensor,
    agg: str = "token-mean",
    *,
    denominator: str = "kept",
    denominator_mask: Tensor | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) — or a per-sequence loss (B,) — to a scalar.

    m = kept_mask (kept tokens), m0 = denominator_mask (tokens before rejection; default m).
    Counts by denominator policy:          kept          original         batch
      tokens in the batch  N_tok           Σ m           Σ m0             Σ m0
      tokens of row b      n_b             Σ_t m_b       Σ_t m0_b         Σ_t m0_b
      sequences            N_seq           #{n_b(m)>0}   #{n_b(m0)>0}     B
    Modes (S_b = Σ_t L·m of row b):
      token-mean               Σ_b S_b / N_tok
      token-sum                Σ_b S_b
      seq-mean-token-sum       Σ_b S_b / N_seq
      seq-mean-token-mean      Σ_b (S_b / n_b) / N_seq
      seq-mean-token-sum-norm  Σ_b S_b / N_seq / C            (C = norm_constant, default T; verl newest)
      per-sequence loss (B,)   Σ_b L_b·1[n_b(m)>0] / N_seq    (agg ignored)
    N_tok and N_seq come from ``loss_count``. Masked positions never reach the sum (torch.where), so padding
    NaN/inf cannot leak; a zero count gives exactly 0 with zero gradient.
    """
    per_sequence = loss.dim() == 1
    count = loss_count(
        kept_mask, agg, denominator=denominator, denominator_mask=denominator_mask, per_sequence=per_sequence
    )
    m = kept_mask.bool()
    dtype = loss.dtype
    if per_sequence:
        rows = torch.where(m.any(-1), loss, torch.zeros_like(loss))
        return rows.sum() / count.to(dtype).clamp_min(1)
    row_sum = torch.where(m, loss, torch.zeros_like(loss)).sum(-1)
    if count is None:  # token-sum
        return row_sum.sum()
    if agg == "seq-mean-token-mean":
        m0 = m if denominator_mask is None or denominator == "kept" else denominator_mask.bool()
        row_sum = row_sum / m0.sum(-1).to(dtype).clamp_min(1)
    total = row_sum.sum() / count.to(dtype).clamp_min(1)
    if agg == "seq-mean-token-sum-norm":
        total = total / (loss.shape[-1] if norm_constant is None else norm_constant)
    return total
