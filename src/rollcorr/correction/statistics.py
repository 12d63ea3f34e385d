"""The statistics of a (B, T) batch: every per-row sum the weights, the rules and the diagnostics read.

``batch_statistics`` is the one door; it returns a ``BatchStatistics``, the interface every later step of
``compute_correction`` reads (the rules through ``row_sum`` / ``row_max`` / ``token``). Its sources of the same
sums, to float rounding: the C++ kernel built at setup (``native.py``: one read of (B, T), the input checks in
it), for contiguous float32 CPU batches; else plain torch, the fewest passes over (B, T) (this module).
``fused.py`` is an optional compiled source, used only once a process has compiled it on purpose
(``fused.warm``), never mid-run; a batch it was warmed for takes it first.

Per position, with mf the mask as 0/1 floats and o = log π_old·mf, r = log μ·mf (0 on padding):

    ℓ = o − r            ℓ_c = clamp(ℓ, ±bound)        e = expm1(ℓ_c) = ρ − 1         ρ = 1 + e
    k1 = −ℓ_c            k2 = ½ℓ_c²                    k3 = e − ℓ_c = ρ − 1 − ℓ_c
    q = log1p(e/2) = softplus(ℓ_c) − log 2             (the JS term's log((1 + ρ)/2))
    p_old = exp(o)       p_μ = exp(r)                  Δp = p_old − p_μ              (p = 1 on padding)

Every term is 0 on padding (ℓ = e = k3 = q = Δp = 0 there), so a sum over all positions is the sum over the
valid ones. The diagnostics' totals, each Σ over valid tokens:

    Σ ρ²           = n + 2 Σ e + Σ e²                  (chi2_token)
    Σ ρℓ − ρ + 1   = Σ e·ℓ_c − Σ k3                    (policy_kl)
    Σ js_t         = ½ [Σ (ℓ_c − 2q) + Σ e·(ℓ_c − q)]  (½[ρℓ − (1 + ρ)·q] per token)
    Σ e^|ℓ| − 1    = Σ max(e, −e/ρ)                    (large blocks with token IS: ρ and e are at hand)
                   = Σ_all e^|ℓ_c| − B·T               (otherwise; token_mult_prob_error is 1 + its mean;
                                                        padding adds e^0 = 1)

written so that each term is computed where it is small (expm1, log1p: no 1 − 1 cancellation). The token IS
weights read ρ = e^ℓ_c itself (1 + e loses ρ's relative precision where ρ ≪ 1). In blocks of at least
``GROUPED_EXP_BELOW`` positions the probabilities are p = 2^(x·log2 e) (``exp2``, about 3× cheaper than ``exp``
on the CPU): the rounding of x·log2 e adds a relative error ≲ |x|·u (u the dtype's unit roundoff, 6e-8 in
float32), an absolute one ≲ u·|x|·e^x ≤ u/e (x ≤ 0): below half an ulp of 1, the scale of every probability metric.

**Passes.** The batch is walked in blocks of rows (``BLOCK_POSITIONS`` on CPU, a cache's worth); in each block
the terms whose row sums are needed are written into the slices of one (k, rows, T) buffer and reduced by one
``sum``, the totals are dot products, and no (B, T) temporary outlives its block. Per position, every
diagnostic on: expm1 ℓ_c, one ``exp2`` over [o, r] (p_old, p_μ), one ``exp`` (ρ with token IS, else e^|ℓ_c|)
and one log1p. A smaller block (a small batch, whose cost is its number of operations) takes one ``exp`` over
[o, r (, ℓ_c), |ℓ_c|] instead (``grouped_exp``): the same values to float rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollcorr.config.correction import LOG_RATIO_CLAMP, CorrectionConfig
from rollcorr.correction import fused, native
from rollcorr.correction.metrics import PROB_SHARES, is_band
from rollcorr.correction.ratios import (
    NO_VALID_TOKEN,
    Rows,
    Tokens,
    check_binary_mask,
    compute_dtype,
    locate,
    make_tokens,
    positive_tolerance,
)
from rollcorr.correction.rejection import Statistics, declared_reductions
from rollcorr.correction.weights import apply_threshold

BLOCK_POSITIONS = 1 << 16  # positions per block on CPU: the block's ~20 float slices stay in cache
DEVICE_BLOCK_POSITIONS = 1 << 24  # on an accelerator: one block for any batch a step holds (launches, not cache)
GROUPED_EXP_BELOW = 1 << 13  # positions per block below which the pass takes one exp (``grouped_exp``)
SMALL_DIFF = 1e-3  # |Δp| below this counts as "no difference" (prob_diff_frac_lt_1e-3)


@dataclass
class BatchStatistics(Statistics):
    """What ``compute_correction`` knows of a batch after its statistics pass.

    rows: the per-row counts (``Rows``). row: (B,) reductions over each row's valid tokens — ``n``, ``lr``
    (Σ ℓ, unclamped), the rules' ``sum_k1`` … ``max_k3``, with the diagnostics ``old`` / ``rollout`` (Σ log π_old,
    Σ log μ), ``d_sum`` / ``d_max`` (Σ, max |Δp|), with token IS ``w_sum`` / ``raw`` (Σ w, Σ ρ). total: 0-d
    reductions over the batch (the diagnostics' and token IS's; names as ``metrics.*_from_sums`` read them).
    weights: (B, T) token IS weights, 0 on padding, or None. The (B, T) ``tok`` (``Tokens``) is built only when
    a rule reads tokens (token-level or binary-KL rejection, veto, OPSM)."""

    rows: Rows
    row: dict[str, Tensor]
    total: dict[str, Tensor]
    weights: Tensor | None
    inputs: tuple[Tensor, Tensor, Tensor, bool, tuple[str, str]]  # anchor, rollout, mask, verl, names
    bound: float
    _tokens: Tokens | None = field(default=None, repr=False)
    _token: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def tok(self) -> Tokens:
        """The (B, T) masked batch (``ratios.Tokens``), built on first use (the inputs were checked already)."""
        if self._tokens is None:
            anchor, rollout, mask, verl, names = self.inputs
            self._tokens = make_tokens(anchor, rollout, mask, bound=self.bound, verl=verl, names=names,
                                       validate=False)
        return self._tokens

    @property
    def mask_bool(self) -> Tensor:
        """(B, T) bool, the valid tokens."""
        mask = self.inputs[2]
        return mask if mask.dtype == torch.bool else mask != 0

    @property
    def has_tokens(self) -> bool:
        return self._tokens is not None

    def row_sum(self, stat: str) -> Tensor:
        """(B,) Σ_t k over valid tokens (k1, k2, k3 from the pass; others from the tokens)."""
        return self.row[f"sum_{stat}"] if f"sum_{stat}" in self.row else super().row_sum(stat)

    def row_max(self, stat: str) -> Tensor:
        """(B,) max_t k over valid tokens, 0 for rows without one."""
        if f"max_{stat}" in self.row:
            return torch.where(self.rows.valid, self.row[f"max_{stat}"], 0.0)
        return super().row_max(stat)


@dataclass(frozen=True)
class Plan:
    """What one call's pass computes: the rules' reductions, token IS (mode, upper, lower) or None, the
    diagnostics, verl mode, the discrepancy/drift split (π_θ given); ``clamp``: |ℓ| may reach ``bound`` (from
    the checked inputs' ranges; always without the check), so verl's unclamped k3 is a term of its own."""

    reductions: frozenset[str]
    token_is: tuple[str, float | None, float | None] | None
    diagnostics: bool
    verl: bool
    decomposition: bool
    clamp: bool
    bound: float


def batch_statistics(
    anchor: Tensor,
    rollout: Tensor,
    mask: Tensor,
    config: CorrectionConfig,
    *,
    names: tuple[str, str],
    validate: bool,
    diagnostics: bool,
    log_prob: Tensor | None = None,
) -> BatchStatistics:
    """The statistics of a batch: (B, T) anchor (log π_old, or log π_θ in bypass), rollout (log μ) and mask.
    ``validate``: check the inputs (one sync; ``ValueError`` naming the tensor and position). ``log_prob``: π_θ
    for the discrepancy/drift split (decoupled mode, diagnostics on)."""
    mask_bool = mask if mask.dtype == torch.bool else mask != 0
    clean = False  # unchecked: the padding may hold anything
    plan = Plan(
        reductions=declared_reductions(config),
        token_is=(config.is_mode, config.is_upper, config.is_lower) if config.is_level == "token" else None,
        diagnostics=diagnostics, verl=config.verl_compat, decomposition=diagnostics and log_prob is not None,
        clamp=True, bound=float(config.safety_bound),
    )
    dtype = compute_dtype(anchor, rollout)
    # the built kernel (which checks the inputs in its read), unless a compiled one was warmed for this batch
    if native.serves(anchor, rollout, mask_bool) and not fused.serves(plan, dtype, mask_bool):
        kernel = _native(anchor, rollout, mask, mask_bool, plan, names, validate)
    else:
        if validate:
            clean, clamp = _check(anchor, rollout, mask, mask_bool, plan.bound, names)
            plan = dataclasses.replace(plan, clamp=clamp)
        kernel = fused.row_statistics(anchor, rollout, mask_bool, plan, dtype)
    if kernel is not None:
        row, total, weights = kernel
        if plan.decomposition:  # beside the kernel
            masked = (torch.where(mask_bool, x.to(dtype), 0.0) for x in (anchor, rollout, log_prob))
            total |= {k: v.sum() for k, v in _decomposition_terms(*masked).items()}
    else:
        row, total, weights = _blocks(anchor, rollout, mask_bool, plan, dtype, clean, log_prob)
    rows = rows_from(row["n"], mask, verl=config.verl_compat)
    return BatchStatistics(rows, row, total, weights, (anchor, rollout, mask, config.verl_compat, names),
                           float(config.safety_bound))


def rows_from(n: Tensor, mask: Tensor, *, verl: bool) -> Rows:
    """The ``Rows`` of a batch from its (B,) valid-token counts n (verl's conventions when ``verl``)."""
    valid = n > 0
    num_tokens = n.sum()
    count_dtype = mask.dtype if mask.dtype.is_floating_point else torch.get_default_dtype()
    return Rows(n=n, valid=valid, num_tokens=num_tokens, num_rows=valid.sum().to(n.dtype),
                num_pad=mask.numel() - num_tokens, verl=verl, count_dtype=count_dtype)


def _native(
    anchor: Tensor, rollout: Tensor, mask: Tensor, mask_bool: Tensor, plan: Plan, names: tuple[str, str],
    validate: bool,
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor | None]:
    """The statistics from the built kernel (native.py), under the names the plain-torch pass gives them. With
    ``validate``, its counts of invalid entries and of valid tokens check the inputs (a bad batch is checked again
    by ``_check``, which names the tensor and position)."""
    rows, totals, weights = native.run(anchor, rollout, mask_bool, plan)
    if validate:
        n, bad_old, bad_rollout = totals[:3].tolist()
        check_binary_mask("response_mask", mask)
        if n == 0 or bad_old or bad_rollout:
            _check(anchor, rollout, mask, mask_bool, plan.bound, names)
    r = dict(zip(native.SLOTS, rows.unbind(0)))
    t = dict(zip(native.SLOTS, totals.to(rows.dtype).unbind(0)))
    row = {k: r[k] for k in ("n", "lr", "old", "rollout")} | {k: r[k] for k in ("max_k2", "max_k3")
                                                                if k in plan.reductions}
    row |= {"sum_k1": -r["lr_c"]} if "sum_k1" in plan.reductions else {}
    row |= {"sum_k2": r["k2"]} if "sum_k2" in plan.reductions else {}
    if plan.diagnostics or plan.reductions & {"sum_k3", "max_k3"}:
        row["sum_k3"] = r["k3"]
    total = {}
    if plan.token_is:
        row |= {"w_sum": r["w"], "raw": r["raw"]}
        total |= {k: t[k] for k in ("w_sq", "w_max", "w_min", "high", "low")}
    if plan.diagnostics:
        row |= {"d_sum": r["d"], "d_max": r["d_max"]}
        total |= {f"{k}_sum": t[k] for k in ("p_old", "p_rollout", "p_old_sq", "p_rollout_sq", "p_cross")}
        total |= {k: t[k] for k in ("e_abs", "abs", *(f"ge{i}" for i in range(len(PROB_SHARES))))}
        total |= {"sum_k3": t["k3"], "small_diff_count": t["small"], "rho2": t["n"] + 2.0 * t["e"] + t["e_sq"],
                  "policy_kl": t["e_lr"] - t["k3"], "js": (t["js_a"] + t["e_lr"] - t["e_q"]) * 0.5}
        if plan.verl:
            total["k3_unclamped"] = t["k3_unclamped"]
    return row, total, weights


def _check(
    anchor: Tensor, rollout: Tensor, mask: Tensor, mask_bool: Tensor, bound: float, names: tuple[str, str]
) -> tuple[bool, bool]:
    """Check the inputs in one sync: a valid token exists, the mask is 0/1, every valid log-prob is finite and
    ≤ 0. Returns (clean: the padding holds finite log-probs too, so masking may multiply by the mask; clamp:
    |ℓ| may reach ``bound``, from the inputs' ranges)."""
    dtype = compute_dtype(anchor, rollout)
    flags = [mask_bool.view(torch.uint8).amax(), *torch.aminmax(anchor), *torch.aminmax(rollout)]
    if mask.dtype != torch.bool:
        flags.append(((mask != 0) & (mask != 1)).any())
    if mask.is_cpu:  # a CPU read waits for nothing: each flag as it is (the same values as the stacked read)
        values = [f.item() for f in flags]
    else:  # one device sync for them all
        values = torch.stack([f if f.dtype == dtype else f.to(dtype) for f in flags]).tolist()
    if values[0] == 0:
        raise ValueError(NO_VALID_TOKEN)
    if len(values) > 5 and values[5]:
        check_binary_mask("response_mask", mask)
    inputs = (anchor, rollout)
    clean = all(lo > -math.inf and hi <= positive_tolerance(x.dtype)
                for lo, hi, x in zip(values[1:5:2], values[2:5:2], inputs))  # (NaN fails both)
    if not clean:  # the padding (or a valid token) holds garbage: check the valid tokens alone
        valid_only = (torch.where(mask_bool, x, -1.0) for x in inputs)
        values[1:5] = torch.stack([v.to(dtype) for x in valid_only for v in torch.aminmax(x)]).tolist()
        for lo, hi, name, x in zip(values[1:5:2], values[2:5:2], names, inputs):
            if not (lo > -math.inf and hi <= positive_tolerance(x.dtype)):
                raise ValueError(locate(name, x, mask_bool, positive_tolerance(x.dtype)))
    lo_a, hi_a, lo_r, hi_r = values[1:5]
    return clean, not max(hi_a - lo_r, hi_r - lo_a) < bound  # |ℓ| < bound everywhere: the clamp is the identity


# The buffer's layout: terms that one operation computes together are neighbours (one ``exp2`` over [o, r]
# gives [p_old, p_μ]; one comparison over the thresholds gives every |Δp| share): a small batch costs its number
# of operations, a large one its passes.
GE = (SMALL_DIFF, *PROB_SHARES)  # |Δp| ≥ each: the shares' counts (|Δp| < 1e-3 is the complement of the first)


def _slices(plan: Plan) -> list[str]:
    """The names of the per-position terms the pass writes, in the buffer's order (module docstring)."""
    # [o, r] side by side, and the probabilities [p_old, p_μ]
    names = ["n", "lr", *(["old", "rollout", "lr_c"] if plan.token_is else ["lr_c", "old", "rollout"])]
    if plan.diagnostics:
        names += ["abs", "p_old", "p_rollout"]
    if plan.token_is:
        names.append("raw")
    if plan.diagnostics:
        names.append("exp_abs")
    if plan.diagnostics or plan.reductions & {"sum_k3", "max_k3"}:
        names += ["e", "k3"]
    if plan.reductions & {"sum_k2", "max_k2"}:
        names.append("k2")
    if plan.diagnostics:
        names += ["js", "d", *(f"ge{i}" for i in range(len(GE)))]
        if plan.verl and plan.clamp:
            names.append("k3_unclamped")
        if plan.decomposition:
            names += ["drift_k3", "total_k3"] + (["discrepancy_k3"] if plan.bound != LOG_RATIO_CLAMP else [])
    if plan.token_is:
        names += ["high", "low"]
    return names


def _maxima(plan: Plan) -> list[str]:
    """The per-row maxima the pass takes (of |Δp| and of the rules' k2 / k3), in the buffer's order."""
    return (["d_max"] if plan.diagnostics else []) + [f"max_{k}" for k in ("k2", "k3") if f"max_{k}" in plan.reductions]


def _dots(plan: Plan) -> list[str]:
    """The dot products (Σ over the batch of a product of two terms) the pass takes, in its order."""
    return (["e_sq", "e_lr", "e_q", "p_old_sq", "p_rollout_sq", "p_cross"] if plan.diagnostics else []) + (
        ["w_sq"] if plan.token_is else [])


@functools.lru_cache(maxsize=256)
def _layout(plan: Plan) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, int]]:
    """(the block's slices, the row maxima, the totals' index: each slice's row-sum total, then the dot products
    and token IS's max w and −min w), made once per plan."""
    names, maxima = tuple(_slices(plan)), tuple(_maxima(plan))
    extremes = ["w_max", "neg_w_min"] if plan.token_is else []
    return names, maxima, {name: i for i, name in enumerate([*names, *_dots(plan), *extremes])}


def _blocks(
    anchor: Tensor, rollout: Tensor, mask_bool: Tensor, plan: Plan, dtype: torch.dtype, clean: bool,
    log_prob: Tensor | None,
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor | None]:
    """The pass, block by block of rows, into the batch's (k, B) row sums and maxima and its (k,) dot products:
    (row: name → (B,), total: name → 0-d, token weights or None)."""
    b, t = mask_bool.shape
    device = anchor.device
    step = max(1, (BLOCK_POSITIONS if device.type == "cpu" else DEVICE_BLOCK_POSITIONS) // t)
    names, maxima, index = _layout(plan)
    work = torch.empty(len(names), min(step, b), t, dtype=dtype, device=device)
    # per row: the slices' sums, then Σ_t w (token IS); the maxima
    row_sums = torch.empty(len(names) + (1 if plan.token_is else 0), b, dtype=dtype, device=device)
    row_max = torch.empty(len(maxima), b, dtype=dtype, device=device) if maxima else None
    weights = torch.empty(b, t, dtype=dtype, device=device) if plan.token_is else None
    batch = None  # (k,) the dot products, then max w and −min w
    grouped = grouped_exp(min(step, b) * t)  # one choice for every block (``_finish`` reads it)
    for i in range(0, b, step):
        rows = slice(i, min(i + step, b))
        whole = rows.stop - i == b  # one block: the tensors as they are (no slicing: a small batch counts operations)
        block = _Block(work if whole else work[:, : rows.stop - i], names, plan,
                       mask_bool if whole else mask_bool[rows], clean, grouped)
        part = (lambda x: x) if whole else (lambda x, rows=rows: None if x is None else x[rows])  # noqa: E731
        acc = block.run(part(anchor), part(rollout), part(weights), part(log_prob))
        sums = row_sums if whole else row_sums[:, rows]
        torch.sum(block.work, dim=-1, out=sums[: len(names)])
        if weights is not None:  # Σ_t w while the block's weights are in cache
            torch.sum(part(weights), dim=-1, out=sums[len(names)])
        for k, name in enumerate(maxima):  # max over each row of |Δp| (d_max), k2, k3
            torch.amax(block.rows_of(name[4:] if name != "d_max" else "d"), dim=-1,
                       out=row_max[k] if whole else row_max[k, rows])
        batch = acc if batch is None else _combine(batch, acc, 2 if plan.token_is else 0)
    parts = [row_sums[: len(names)].sum(dim=-1)] + ([batch] if batch is not None else [])
    total = Named(torch.cat(parts) if len(parts) > 1 else parts[0], index)
    row = Named(row_sums, {**index, "w_sum": len(names)} if plan.token_is else index)
    finished = _finish(total, plan, b * t, grouped)
    return _rows(row, Named(row_max, {k: i for i, k in enumerate(maxima)}), plan), finished, weights


def grouped_exp(positions: int) -> bool:
    """Whether a block of ``positions`` takes the fewest operations (one ``exp`` over [o, r (, ℓ_c), |ℓ_c|]) rather
    than the fewest exponentials (``exp2`` for the probabilities, e^|ℓ_c| from ρ and e): below
    ``GROUPED_EXP_BELOW`` positions an operation's fixed cost outweighs an exponential's."""
    return positions < GROUPED_EXP_BELOW


def _combine(batch: Tensor | None, acc: Tensor | None, extremes: int) -> Tensor | None:
    """Two blocks' (k,) dot products (summed) and, in the last ``extremes`` entries, maxima (the larger)."""
    if batch is None:
        return acc
    if extremes:
        torch.maximum(batch[-extremes:], acc[-extremes:], out=batch[-extremes:])
        batch[:-extremes].add_(acc[:-extremes])
        return batch
    return batch.add_(acc)


class Named(dict):
    """Named rows of one stacked tensor, each selected on first use (a small batch's cost is its number of
    operations: the pass stacks ~20 terms, the metrics read a few of them). ``index``: name → row."""

    def __init__(self, stacked: Tensor | None, index: dict[str, int]) -> None:
        super().__init__()
        self.stacked, self.index, self.rows = stacked, index, None

    def __missing__(self, name: str) -> Tensor:
        if name not in self.index:
            raise KeyError(name)
        if self.rows is None:  # every row as a view, in one operation
            self.rows = self.stacked.unbind(0)
        self[name] = value = self.rows[self.index[name]]
        return value

    def __contains__(self, name: object) -> bool:
        return name in self.index or dict.__contains__(self, name)

    def get(self, name: str, default=None):
        return self[name] if name in self else default

    def pick(self, names: tuple[str, ...]) -> Tensor:
        """The rows ``names`` as one (k, …) tensor (one gather; the index made once per plan)."""
        return self.stacked[_positions(tuple(self.index[k] for k in names), self.stacked.device)]


@functools.lru_cache(maxsize=256)
def _positions(rows: tuple[int, ...], device: torch.device) -> Tensor:
    """``rows`` as an index tensor on ``device``, made once."""
    return torch.tensor(rows, device=device)


def _rows(sums: Named, maxima: Named, plan: Plan) -> dict[str, Tensor]:
    """The per-row reductions under the names the weights, rules and metrics read (``BatchStatistics.row``)."""
    row = {k: sums[k] for k in ("n", "lr", "old", "rollout")} | {k: maxima[k] for k in maxima.index}
    if "sum_k1" in plan.reductions:
        row["sum_k1"] = -sums["lr_c"]
    if "sum_k2" in plan.reductions:
        row["sum_k2"] = sums["k2"]
    if "k3" in sums.index:
        row["sum_k3"] = sums["k3"]
    if plan.diagnostics:
        row["d_sum"] = sums["d"]
    if plan.token_is:
        row["w_sum"], row["raw"] = sums["w_sum"], sums["raw"]
    return row


_MOMENTS = ("p_old", "p_rollout", "p_old_sq", "p_rollout_sq", "p_cross")


def _finish(raw: Named, plan: Plan, numel: int, grouped: bool) -> dict[str, Tensor]:
    """The totals ``metrics.*_from_sums`` read, from the pass's raw ones (the module docstring's identities;
    the padding's known contribution removed: p = 1 there, and 0 < lo for the raw weight). ``grouped``: the blocks
    took one ``exp`` (``grouped_exp``)."""
    n = raw["n"]
    pad = numel - n
    out = {k: raw[k] for k in ("w_sq", "w_max", "high") if k in raw.index}
    if plan.token_is:
        out["w_min"] = -raw["neg_w_min"]
        out["low"] = raw["low"] - pad if is_band(plan.token_is[1], plan.token_is[2])[0] > 0 else raw["low"]
    if not plan.diagnostics:
        return out
    out |= dict(zip(("p_old_sum", "p_rollout_sum", "p_old_sq_sum", "p_rollout_sq_sum", "p_cross_sum"),
                    raw.pick(_MOMENTS).sub_(pad).unbind()))
    out |= {
        "sum_k3": raw["k3"], "rho2": torch.add(n, raw["e"], alpha=2.0).add_(raw["e_sq"]),
        "policy_kl": raw["e_lr"] - raw["k3"], "js": torch.add(raw["js"], raw["e_lr"]).sub_(raw["e_q"]).mul_(0.5),
        "e_abs": raw["exp_abs"] - numel if grouped or not plan.token_is else raw["exp_abs"], "abs": raw["abs"],
        "small_diff_count": n - raw["ge0"],  # padding has |Δp| = 0 < 1e-3
        **{f"ge{i}": raw[f"ge{i + 1}"] for i in range(len(PROB_SHARES))},
    }
    if plan.verl:
        out["k3_unclamped"] = raw.get("k3_unclamped", raw["k3"])
    if plan.decomposition:
        out |= {k: raw[k] for k in ("drift_k3", "total_k3")}
        out["discrepancy_k3"] = raw.get("discrepancy_k3", raw["k3"])
    return out


class _Block:
    """One block of rows: the (k, rows, T) buffer ``work`` whose slices hold the terms of ``names``."""

    def __init__(
        self, work: Tensor, names: tuple[str, ...], plan: Plan, mask_bool: Tensor, clean: bool, grouped: bool
    ) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self.grouped = grouped  # one exp over [o, r (, ℓ_c), |ℓ_c|] (``grouped_exp``)
        self.flat = work.view(len(names), -1)  # each term as one flat row: dot products read it as it is
        self.s = dict(zip(names, self.flat.unbind(0)))
        self.work, self.plan, self.mask_bool, self.clean = work, plan, mask_bool, clean

    def group(self, first: str, last: str) -> Tensor:
        """The neighbouring slices ``first`` … ``last`` as one (k, rows·T) view."""
        return self.flat[self.index[first] : self.index[last] + 1]

    def rows_of(self, name: str) -> Tensor:
        """The slice ``name`` as (rows, T)."""
        return self.work[self.index[name]]

    def run(
        self, anchor: Tensor, rollout: Tensor, w_out: Tensor | None, log_prob: Tensor | None
    ) -> Tensor | None:
        """Write every term of this block into its slice (the caller sums them per row) and its token weights into
        ``w_out``; returns the (k,) dot products of ``_dots`` then, with token IS, max w and −min w (None when
        there are none)."""
        s, plan = self.s, self.plan
        mf = s["n"].copy_(self.mask_bool.view(torch.uint8).reshape(-1))  # the mask as 0/1 floats
        o, r = self._masked(anchor, s["old"], mf), self._masked(rollout, s["rollout"], mf)
        torch.sub(o, r, out=s["lr"])  # ℓ, unclamped
        lrs = torch.clamp(s["lr"], -plan.bound, plan.bound, out=s["lr_c"])  # ℓ_c
        if plan.diagnostics:
            torch.abs(lrs, out=s["abs"])
        if plan.diagnostics and self.grouped:  # [o, r (, ℓ_c), |ℓ_c|] → [p_old, p_μ (, ρ), e^|ℓ_c|]: one exp
            torch.exp(self.group("old", "abs"), out=self.group("p_old", "exp_abs"))
        elif plan.diagnostics:  # [o, r] → [p_old, p_μ] as 2^(x·log2 e) (module docstring)
            torch.mul(self.group("old", "rollout"), _LOG2E, out=self.group("p_old", "p_rollout")).exp2_()
            torch.exp(lrs if plan.token_is else s["abs"], out=s["raw" if plan.token_is else "exp_abs"])
        elif plan.token_is:
            torch.exp(lrs, out=s["raw"])  # ρ
        if "e" in s:
            torch.expm1(lrs, out=s["e"])  # e = ρ − 1, exact where ρ ≈ 1
            torch.sub(s["e"], lrs, out=s["k3"])  # k3 = ρ − 1 − ℓ_c ≥ 0
        if plan.diagnostics and plan.token_is and not self.grouped:  # e^|ℓ_c| − 1 = max(e, −e/ρ): no exp
            e_abs = torch.div(s["e"], s["raw"], out=s["exp_abs"]).neg_()
            torch.maximum(e_abs, s["e"], out=e_abs)
        if "k2" in s:
            torch.mul(lrs, lrs, out=s["k2"]).mul_(0.5)
        dots: list[Tensor] = []
        if plan.diagnostics:
            dots += self._divergences(lrs, s["e"], s["lr"]) + self._probabilities()
            if plan.decomposition:
                self._decomposition(o, r, log_prob)
        if plan.token_is:
            dots += self._token_weights(mf, w_out.view(-1))
        return torch.stack(dots) if dots else None

    def _masked(self, x: Tensor, out: Tensor, mf: Tensor) -> Tensor:
        """x·mf (checked inputs whose padding is finite: x·0 = 0), else ``where`` (NaN in padding stays out)."""
        if self.clean:
            return torch.mul(x.reshape(-1), mf, out=out)
        return out.copy_(torch.where(self.mask_bool, x, 0.0).view(-1))

    def _divergences(self, lrs: Tensor, e: Tensor, lr: Tensor) -> list[Tensor]:
        """The JS term ℓ_c − 2q (q = log1p(e/2)) and the dot products Σ e², Σ e·ℓ_c, Σ e·q."""
        q = torch.mul(e, 0.5).log1p_()  # log((1 + ρ)/2)
        torch.add(lrs, q, alpha=-2.0, out=self.s["js"])  # ℓ_c − 2q
        if "k3_unclamped" in self.s:  # verl's k3_kl: e^ℓ − 1 − ℓ of the unclamped ℓ
            torch.sub(torch.expm1(lr), lr, out=self.s["k3_unclamped"])
        return [_dot(e, e), _dot(e, lrs), _dot(e, q)]

    def _probabilities(self) -> list[Tensor]:
        """|Δp| = |p_old − p_μ| and its 0/1 flags against every threshold (one comparison); the probabilities'
        second moments Σ p_old², Σ p_μ², Σ p_old·p_μ (padding adds 1 to each)."""
        s = self.s
        p_o, p_r = s["p_old"], s["p_rollout"]
        d = torch.sub(p_o, p_r, out=s["d"]).abs_()
        torch.ge(d, _thresholds(d.dtype, d.device), out=self.group("ge0", f"ge{len(GE) - 1}"))
        return [_dot(p_o, p_o), _dot(p_r, p_r), _dot(p_o, p_r)]

    def _decomposition(self, o: Tensor, r: Tensor, log_prob: Tensor) -> None:
        """The discrepancy/drift split's k3 terms (``_decomposition_terms``), θ = log π_θ·mf; the discrepancy's
        only when the correction's bound is not ``LOG_RATIO_CLAMP`` (else it is the k3 slice)."""
        theta = torch.where(self.mask_bool, log_prob.to(o.dtype), 0.0).view(-1)  # its padding is not checked
        _decomposition_terms(o, r, theta, out=self.s)

    def _token_weights(self, mf: Tensor, w_out: Tensor) -> list[Tensor]:
        """Token IS: raw = ρ·mf (ρ = e^ℓ_c, relatively exact where ρ ≪ 1, unlike 1 + e), w = threshold(raw) into
        ``w_out``, the flags of raw above / below the band; returns [Σ w², max w, −min w] (over valid tokens)."""
        mode, upper, lower = self.plan.token_is
        lo, hi = is_band(upper, lower)
        raw = self.s["raw"].mul_(mf)
        apply_threshold(raw, mf, mode, upper, lower, out=w_out)
        torch.gt(raw, hi, out=self.s["high"])
        torch.lt(raw, lo, out=self.s["low"])
        lifted = torch.add(w_out, torch.rsub(mf, 1.0), alpha=_ABOVE_ANY_WEIGHT)  # padding above every weight
        return [_dot(w_out, w_out), w_out.amax(), lifted.amin().neg_()]


def _decomposition_terms(o: Tensor, r: Tensor, theta: Tensor, out: dict[str, Tensor] | None = None
                         ) -> dict[str, Tensor]:
    """Per token, k3(x) = e^x − 1 − x of the split of log π_θ/μ (docs/spec.md §1), x clamped to ±``LOG_RATIO_CLAMP``:
    drift x = θ − o (π_θ/π_old), total x = θ − r (π_θ/μ), discrepancy x = o − r (π_old/μ); 0 on padding.
    ``out``: write each into ``out[name]`` when that name is there (and skip it otherwise)."""
    pairs = [("drift_k3", theta, o), ("total_k3", theta, r), ("discrepancy_k3", o, r)]
    terms = {}
    for name, a, b in pairs:
        if out is None or name in out:
            x = torch.sub(a, b).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            terms[name] = torch.expm1(x, out=None if out is None else out[name]).sub_(x)
    return terms


_LOG2E = math.log2(math.e)
_ABOVE_ANY_WEIGHT = 1e30  # > e^80 (safety_bound ≤ 80), finite in float32


@functools.cache
def _thresholds(dtype: torch.dtype, device: torch.device) -> Tensor:
    """``GE`` as a (k, 1) tensor, made once per dtype and device (a host-to-device copy per call would wait for
    the device)."""
    return torch.tensor(GE, dtype=dtype, device=device).view(-1, 1)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ a·b over the flat terms a, b, one pass."""
    return torch.dot(a, b)
