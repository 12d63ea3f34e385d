"""Input checks and the per-token log-ratio ℓ = log π_old − log μ with its k1/k2/k3 statistics (docs/spec.md §1, §3).

Everything here is a pure function of (B, T) tensors. Padding never matters: ℓ is set to 0 there (so NaN or
inf in padding is ignored), which also makes ρ − 1, k1, k2 and k3 exactly 0 on padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, *FLOAT_DTYPES)


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16 / fp16 inputs are upcast)."""
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


NO_VALID_TOKEN = "response_mask has no valid token: nothing to correct (every row is padding)"


def positive_tolerance(dtype: torch.dtype) -> float:
    # A log-prob rounded in low precision can land just above 0; anything beyond a few ulps of 1 is a bug.
    return max(1e-6, 4 * torch.finfo(dtype).eps)


def check_tensor(
    name: str, x: object, shape: tuple[int, ...] | None = None, *, float_only: bool = True
) -> Tensor:
    """Type, dtype and shape checks that need no device sync."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if float_only and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float32/bfloat16/float64), got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    return x


def check_mask(mask: object) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.layout != torch.strided:  # sparse (COO, CSR, ...) masks reach no kernel of the correction
        raise ValueError(
            f"response_mask must be a dense tensor, got layout {mask.layout}; pass response_mask.to_dense()"
        )
    if mask.dtype not in MASK_DTYPES:
        raise TypeError(f"response_mask must be bool, integer or float, got {mask.dtype}")
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be (B, T), got shape {tuple(mask.shape)}")
    if mask.shape[0] == 0 or mask.shape[1] == 0:
        raise ValueError(f"response_mask is empty (shape {tuple(mask.shape)})")
    return mask


def check_binary_mask(name: str, mask: Tensor) -> None:
    """A mask is 0/1 (or bool): a fractional value (0.5) is refused, not read as "kept" by one entry point and
    as a weight by another. Weight tokens with IS weights instead. One sync; free for bool masks."""
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} has values other than 0 and 1 at {_where((mask != 0) & (mask != 1))}")


def check_not_newer(version: Tensor, current_version: int | Tensor, mask: Tensor) -> None:
    """No valid token may carry a weight version above the learner's (negative staleness is a bookkeeping
    bug upstream: the token would come from weights that do not exist yet)."""
    newer = (version > torch.as_tensor(current_version, device=version.device)) & (mask != 0)
    if bool(newer.any()):
        raise ValueError(
            f"version is above current_version ({int(torch.as_tensor(current_version))}) on valid tokens at "
            f"{_where(newer)}: a token cannot come from weights newer than the learner's"
        )


def zero_below_two(x: Tensor, count: Tensor) -> Tensor:
    """``x.masked_fill_(count <= 1, 0.0)`` (a statistic that needs two entries is 0 below two): ``x`` untouched
    when the count is known on the CPU to be above 1, the same values without the two operations."""
    if count.is_cpu and count.item() > 1:
        return x
    return x.masked_fill_(count <= 1, 0.0)


def at_least_one(count: Tensor) -> Tensor:
    """``count.clamp_min(1)`` (a denominator that is never 0): ``count`` itself when it is known on the CPU to be
    ≥ 1, the same value without the operation."""
    if count.is_cpu and count.item() >= 1:
        return count
    return count.clamp_min(1)


def any_per_row(flag: Tensor) -> Tensor:
    """(B,) rows of a (B, T) bool tensor holding a True: a uint8 max (vectorised, unlike bool ``any``)."""
    return flag.view(torch.uint8).amax(dim=-1).bool()


def _where(bad: Tensor) -> str:
    idx = bad.nonzero()[:3].tolist()
    return ", ".join(f"(row {i}, pos {j})" for i, j in idx)


def locate(name: str, x: Tensor, mask_bool: Tensor, upper_ok: float) -> str:
    """Error path only: say what is wrong with ``x`` on valid tokens and where."""
    nonfinite = mask_bool & ~torch.isfinite(x)
    if nonfinite.any():
        return f"{name} is NaN/inf on valid tokens at {_where(nonfinite)}"
    return (
        f"{name} is positive (not a log-probability) on valid tokens at {_where(mask_bool & (x > upper_ok))}"
    )


@dataclass(frozen=True)
class Rows:
    """Per-row counts of a masked (B, T) batch: all the sequence-level statistics need. Shapes: () unless noted."""

    n: Tensor  # (B,) valid tokens per row, in the compute dtype
    valid: Tensor  # (B,) bool, rows with >= 1 valid token
    num_tokens: Tensor  # total valid tokens
    num_rows: Tensor  # rows with >= 1 valid token
    num_pad: Tensor  # padding positions (B·T − num_tokens)
    verl: bool  # reproduce verl's formulas (masked means with +1e-8, all rows in seq metrics)
    count_dtype: torch.dtype  # dtype of verl's ``mask.sum()`` (the +1e-8 is added in it)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (float32, or float64 for float64 inputs)."""
        return self.n.dtype

    def den(self, count: Tensor) -> Tensor:
        """Denominator of a masked mean over ``count`` valid entries. verl's ``masked_mean`` divides by
        ``mask.sum() + 1e-8`` computed in the mask's sum dtype: float32 for a bool/int mask, where the 1e-8
        vanishes for any count ≥ 1, the mask's own dtype for a float mask. rollcorr divides by the count."""
        if not self.verl:
            return count
        return (count.to(self.count_dtype) + 1e-8).to(count.dtype)

    @cached_property
    def n_den(self) -> Tensor:
        """(B,) the per-row masked-mean denominator: ``den(n)`` in verl mode, n clamped to ≥ 1 otherwise."""
        if self.verl:
            return self.den(self.n)
        return self.n if self.all_valid else self.n.clamp_min(1)  # every row valid: n ≥ 1 already

    @cached_property
    def valid_f(self) -> Tensor:
        """(B,) ``valid`` in the compute dtype (1.0 / 0.0)."""
        return self.valid.to(self.dtype)

    @cached_property
    def invalid(self) -> Tensor:
        """(B,) bool, rows without a valid token (``~valid``, computed once per batch)."""
        return ~self.valid

    @cached_property
    def all_valid(self) -> bool:
        """Every row holds a valid token, where that is known without a device sync (CPU counts: one read); False
        where it is not (then the rows are masked, which gives the same values)."""
        return self.num_rows.is_cpu and self.num_rows.item() == self.n.shape[-1]

    def valid_rows(self, x: Tensor, fill: float) -> Tensor:
        """(…, B) ``x`` with the rows without a valid token set to ``fill``: ``x`` itself when every row holds one
        (a masked_fill with nothing to fill is the identity; a small batch's cost is its number of operations)."""
        return x if self.all_valid else x.masked_fill(self.invalid, fill)

    def and_valid(self, flag: Tensor) -> Tensor:
        """(B,) bool ``flag`` ∧ valid: ``flag`` itself when every row holds a valid token."""
        return flag if self.all_valid else flag & self.valid

    def times_valid(self, x: Tensor) -> Tensor:
        """(…, B) ``x`` · valid (0 / 1): ``x`` itself when every row holds a valid token (x·1 = x, bit for bit)."""
        return x if self.all_valid else x * self.valid_f

    def row_mean_of_sum(self, row_sum: Tensor) -> Tensor:
        """(…, B) per-row masked mean from the row sums Σ_t x (0 for all-padding rows)."""
        return row_sum / self.n_den

    def over_rows(self, x: Tensor) -> Tensor:
        """Mean of a (B,) per-row value: over all rows in verl mode, over rows with a valid token otherwise.
        x may be (k, B), k per-row values stacked: then (k,) means, each the same as for its row alone."""
        if self.verl:
            return x.mean(dim=-1)
        return self.valid_rows(x, 0.0).sum(dim=-1) / self.num_rows  # = where(valid, x, 0)

    def rows_max(self, x: Tensor) -> Tensor:
        """Max of a (B,) (or stacked (k, B)) per-row value over the rows that count (all in verl mode)."""
        return (x if self.verl else self.valid_rows(x, -math.inf)).amax(dim=-1)

    def rows_min(self, x: Tensor) -> Tensor:
        """Min of a (B,) (or stacked (k, B)) per-row value over the rows that count (all in verl mode)."""
        return (x if self.verl else self.valid_rows(x, math.inf)).amin(dim=-1)

    def summary(self, table: Tensor, *, valid_only: bool = False) -> RowSummary:
        """Mean, max, min and unbiased std over rows of each of the k per-row values of ``table`` (k, B), over the
        rows that count (all in verl mode; ``valid_only``: rows with a valid token in either mode)."""
        return RowSummary(table, self, valid_only or not self.verl)


class RowSummary:
    """Statistics over rows of a (k, B) table of per-row values, each (k,) and computed on first use: one
    operation serves all k values (a small batch's cost is its number of operations). ``valid``: only rows
    with a valid token count (else every row)."""

    def __init__(self, table: Tensor, rows: Rows, valid: bool) -> None:
        self.table, self.rows, self.valid = table, rows, valid

    @cached_property
    def counted(self) -> Tensor:
        """The table with the rows that do not count set to 0."""
        return self.rows.valid_rows(self.table, 0.0) if self.valid else self.table

    @cached_property
    def count(self) -> Tensor | int:
        return self.rows.num_rows if self.valid else self.table.shape[-1]

    @cached_property
    def mean(self) -> Tensor:
        return self.counted.sum(dim=-1) / self.count

    @cached_property
    def max(self) -> Tensor:
        return (self.rows.valid_rows(self.table, -math.inf) if self.valid else self.table).amax(dim=-1)

    @cached_property
    def min(self) -> Tensor:
        return (self.rows.valid_rows(self.table, math.inf) if self.valid else self.table).amin(dim=-1)

    @cached_property
    def std(self) -> Tensor:
        """sqrt(Σ (x − mean)² / (count − 1)) over the rows that count (two passes); 0 below two rows."""
        deviation = (self.table - self.mean[:, None]).square_()
        if self.valid and not self.rows.all_valid:
            deviation.masked_fill_(self.rows.invalid, 0.0)
        count = torch.as_tensor(self.count, dtype=self.table.dtype, device=self.table.device)
        return zero_below_two(deviation.sum(dim=-1).div_(at_least_one(count - 1)).sqrt_(), count)


@dataclass(frozen=True)
class Tokens(Rows):
    """The masked batch every correction step reads: ``Rows`` plus the (B, T) tensors."""

    mask: Tensor  # bool, valid tokens
    mask_f: Tensor  # same in the compute dtype
    anchor: Tensor  # the ratio's anchor log-probs (π_old, or π_θ in bypass), 0 on padding; a fresh buffer, never an input
    rollout: Tensor  # log μ, 0 on padding; a fresh buffer, never an input
    log_ratio: Tensor  # ℓ, unclamped, 0 on padding
    log_ratio_safe: Tensor  # clamp(ℓ, ±bound); the same tensor as log_ratio when no entry reaches ±bound
    ratio: Tensor  # ρ = exp(clamp(ℓ)), 1 on padding

    def token_mean(self, x: Tensor) -> Tensor:
        """Masked mean over valid tokens of a (B, T) tensor that is already 0 on padding."""
        return x.sum() / self.den(self.num_tokens)

    def token_share(self, flag: Tensor) -> Tensor:
        """Share of valid tokens where a bool (B, T) flag holds (the flag must be False on padding)."""
        return torch.count_nonzero(flag).to(self.dtype) / self.den(self.num_tokens)

    def row_mean(self, x: Tensor) -> Tensor:
        """(B,) per-row masked mean of a tensor that is 0 on padding (0 for all-padding rows)."""
        return self.row_mean_of_sum(x.sum(dim=-1))

    def valid_max(self, x: Tensor, dim: int | None = None) -> Tensor:
        """Max of a (B, T) tensor over valid tokens: over the batch (0-d) or per row (``dim=-1``, (B,);
        −inf for rows without a valid token). One ``where`` pass (``masked_fill(~mask)`` takes three)."""
        filled = torch.where(self.mask, x, -math.inf)
        return filled.max() if dim is None else filled.amax(dim=dim)

    def valid_min(self, x: Tensor) -> Tensor:
        """Min of a (B, T) tensor over valid tokens (0-d)."""
        return torch.where(self.mask, x, math.inf).min()


def make_tokens(
    anchor_log_prob: Tensor,
    rollout_log_prob: Tensor,
    mask: Tensor,
    *,
    bound: float,
    verl: bool,
    names: tuple[str, str] = ("old_log_prob", "rollout_log_prob"),
    validate: bool = True,
) -> Tokens:
    """Mask the log-probs (0 on padding, whatever padding held), check them, and form ℓ = anchor − rollout,
    its clamp to ±bound and ρ = exp(clamp(ℓ)). The anchor is log π_old in decoupled mode and log π_θ in bypass
    mode (``names`` says which, for the error messages).

    The check raises ``ValueError`` naming the tensor and the first bad positions when the mask has no
    valid token or a valid log-prob is NaN, ±inf or positive. It costs one min/max pass per tensor and a
    single device sync (one small stacked vector read; a second one only when the padding holds NaN, ±inf
    or positive values).

    Fast path (validated inputs whose padding is finite and ≤ 0, e.g. verl's zero padding): masking is a
    multiplication by the float mask (x·1 = x, x·0 = 0 exactly for finite x) instead of ``torch.where``,
    and when the min/max of the inputs bound |ℓ| below ``bound`` the clamp is the identity and is skipped.
    Both give bit-identical tensors to the general path."""
    dtype = compute_dtype(anchor_log_prob, rollout_log_prob)
    mask_bool = mask if mask.dtype == torch.bool else mask != 0
    mask_f = mask_bool.to(dtype)
    n = mask_f.sum(dim=-1)  # integer counts: exact in float
    num_tokens = n.sum()
    inputs = (anchor_log_prob, rollout_log_prob)
    clamp_needed = True
    if validate:
        # one sync: the raw (padding included) min/max of each input
        flags = [num_tokens, *torch.aminmax(anchor_log_prob), *torch.aminmax(rollout_log_prob)]
        if mask.dtype != torch.bool:
            flags.append(((mask != 0) & (mask != 1)).any())
        values = torch.stack([f.to(dtype) for f in flags]).tolist()
        if values[0] == 0:
            raise ValueError(NO_VALID_TOKEN)
        if len(values) > 5 and values[5]:
            check_binary_mask("response_mask", mask)
        ranges = (values[1:3], values[3:5])
        clean = all(
            lo > float("-inf") and hi <= positive_tolerance(x.dtype) for (lo, hi), x in zip(ranges, inputs)
        )  # NaN fails both comparisons
        if clean:  # every entry (padding too) is a finite log-prob: multiply, and clamp only if needed
            old, rollout = (x * mask_f for x in inputs)
            (lo_old, hi_old), (lo_roll, hi_roll) = ranges
            clamp_needed = not max(hi_old - lo_roll, hi_roll - lo_old) < bound
        else:  # the padding (or a valid token) holds garbage: mask it away, then check the valid tokens
            old, rollout = (torch.where(mask_bool, x.to(dtype), 0.0) for x in inputs)
            masked = torch.stack([v.to(dtype) for x in (old, rollout) for v in torch.aminmax(x)]).tolist()
            for lo, hi, name, x in zip(masked[0::2], masked[1::2], names, inputs):
                tol = positive_tolerance(x.dtype)
                if not (lo > float("-inf") and hi <= tol):
                    raise ValueError(locate(name, x, mask_bool, tol))
    else:
        old, rollout = (torch.where(mask_bool, x.to(dtype), 0.0) for x in inputs)
    log_ratio = old - rollout
    log_ratio_safe = log_ratio.clamp(-bound, bound) if clamp_needed else log_ratio
    valid = n > 0
    return Tokens(
        mask=mask_bool,
        mask_f=mask_f,
        n=n,
        valid=valid,
        num_tokens=num_tokens,
        num_rows=valid.sum().to(dtype),
        num_pad=mask_bool.numel() - num_tokens,
        anchor=old,
        rollout=rollout,
        log_ratio=log_ratio,
        log_ratio_safe=log_ratio_safe,
        ratio=log_ratio_safe.exp(),
        verl=verl,
        count_dtype=mask.dtype if mask.dtype.is_floating_point else torch.get_default_dtype(),
    )


def check_extra(
    mask_bool: Tensor,
    non_positive: dict[str, Tensor] | None = None,
    finite_rows: dict[str, Tensor] | None = None,
) -> None:
    """Checks for the optional inputs (one sync): ``non_positive`` tensors finite and ≤ 0 on valid tokens
    (log_prob, log_kept_mass); ``finite_rows`` finite on valid rows / tokens (advantages, (B,) or (B, T))."""
    checks: list[tuple[str, Tensor, Tensor, float | None]] = []
    for name, x in (non_positive or {}).items():
        checks.append((name, x, torch.where(mask_bool, x, 0), positive_tolerance(x.dtype)))
    row_valid = mask_bool.any(dim=-1)
    for name, x in (finite_rows or {}).items():
        checks.append((name, x, torch.where(row_valid if x.dim() == 1 else mask_bool, x, 0), None))
    if not checks:
        return
    stats = torch.stack([v.to(torch.float64) for _, _, xm, _ in checks for v in torch.aminmax(xm)]).tolist()
    for k, (name, x, _, tol) in enumerate(checks):
        lo, hi = stats[2 * k], stats[2 * k + 1]
        if tol is None:
            if not (lo > float("-inf") and hi < float("inf")):
                raise ValueError(f"{name} is NaN/inf on valid rows/tokens")
        elif not (lo > float("-inf") and hi <= tol):
            raise ValueError(locate(name, x, mask_bool, tol))


def kl_stats(tok: Tokens, k: str) -> Tensor:
    """Per-token k1 = −ℓ, k2 = ½ℓ² or k3 = ρ − 1 − ℓ (from the clamped ℓ; all 0 on padding)."""
    lr = tok.log_ratio_safe
    if k == "k1":
        return -lr
    if k == "k2":
        return lr.square().mul_(0.5)
    if k == "k3":
        return (tok.ratio - 1.0).sub_(lr)
    raise ValueError(f"unknown statistic {k!r}; choose k1, k2 or k3")


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
