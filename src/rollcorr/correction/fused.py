"""The correction of a large batch in one pass over (B, T): every per-row reduction the weights, the sequence
rules and the diagnostics read, computed by one compiled kernel (``torch.compile``, Inductor's C++ backend).

The eager path (api.py) makes ~30 passes over (B, T), one per operation, each reading and writing memory; here
one loop per row reads π_old, μ and the mask once and keeps every per-token quantity in registers:

    ℓ = old − rollout (0 on padding), ℓ_c = clamp(ℓ, ±bound), ρ = exp(ℓ_c), p_old = e^old, p_μ = e^rollout
    per row: n, Σ old, Σ rollout, Σ ℓ, Σ k3, Σ ρ², Σ (ρℓ_c − ρ + 1), Σ JS term, Σ (e^|ℓ_c| − 1), Σ |ℓ_c|,
             Σ p_old, Σ p_μ, Σ p_old², Σ p_μ², Σ p_old·p_μ, Σ |Δp|, max |Δp|, #|Δp| < 1e-3,
             #|Δp| ≥ 0.01 / 0.05 / 0.1, #invalid old / rollout entries
    the rules' reductions, when a rule declares them (``rejection.Rule.reductions``): Σ ℓ_c (sum_k1), Σ k2
    (sum_k2), max k2, max k3; verl mode: Σ (e^ℓ − 1 − ℓ) unclamped (verl's k3_kl)
    token IS: the (B, T) weights w = threshold(ρ·mask) and per row Σ w, Σ w², Σ ρ, #ρ > hi, #ρ < lo, max / min w
    ``compute_correction(..., diagnostics=False)``: only n, the invalid counts, Σ ℓ, the rules' and token IS's

Rows of 4 096 < T ≤ 16 384 positions that 2 or 4 divides are reduced as 2 or 4 pieces (``split_for``): Inductor
keeps the accumulators of rows up to 4 096 long in registers, longer ones in memory.

The kernel is a backend of the same rule list, not a second one: ``compute_correction`` runs
``rejection.rejection_rules`` on a ``KernelStatistics`` (these per-row values) instead of the eager
``rejection.Statistics``, and forms the weights with the functions of weights.py. Everything else (sequence
weights, metrics) follows from these (B,) values with the functions the eager path uses
(``metrics.*_from_sums``, ``weights.row_weights``). Sums run in another order
than the eager path's, and e^x is computed as 2^(x·log2 e) (see ``_exp``; relative error ≲ |x|·6e-8, so
≲ 1.2e-6 at the ±20 clamp), so results agree with the eager path to float rounding, not bit for bit
(tests/test_correction_perf_fused.py).

Used by ``compute_correction`` when B·T ≥ ``MIN_POSITIONS`` and every rule the configuration sets declares
its per-row reductions (``plan``): RS options at sequence level on k1/k2/k3 and TRM do, token-level and
binary-KL options, veto and OPSM read the (B, T) tokens and keep the call eager. Staleness and the
discrepancy/drift split are computed beside the kernel; verl mode (``verl_compat``) is served with verl's
conventions from the same sums. The first call compiles (13–35 s measured on a loaded 2-core machine with a
cold cache, less once Inductor's on-disk cache holds the kernel; again per input dtype and kernel variant:
token IS or not, the reductions the rules read); if compiling fails (no C++
compiler, an unsupported platform) a ``FusedUnavailableWarning`` says so once and every call takes the eager
path.

**When it pays.** Compiling costs seconds (≈ 7 s with a warm on-disk cache, 17–35 s cold, on a 2-core machine)
and saves tens of nanoseconds a position (256 × 8192 float32 here: 63 ns eager, 17 ns fused), so it pays only
after some 10⁸ positions in one process — never in a short command (``rollcorr analyze`` of 10⁶ tokens was 3×
slower with it, ``audit --from-log``, the first call of the verl drop-in) and not in a training run whose batches
are small. The default therefore keeps a process eager until it has corrected ``BREAKEVEN_POSITIONS`` positions
(counted over every call), then compiles for the large calls that follow. ``ROLLCORR_FUSED=1`` takes the fused
path for every large call from the first (a long job that knows it will pay); ``ROLLCORR_FUSED=0`` never does.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction import metrics as metric_fns
from rollcorr.correction.ratios import (
    NO_VALID_TOKEN,
    Rows,
    check_binary_mask,
    compute_dtype,
    locate,
    positive_tolerance,
)
from rollcorr.correction.rejection import rule_reductions
from rollcorr.correction.weights import apply_threshold, row_weights

MIN_POSITIONS = 1 << 18  # B·T from which compute_correction takes the fused path (256 K positions)
BREAKEVEN_POSITIONS = 200_000_000  # positions corrected in this process before compiling is worth it (docstring)
ENV = "ROLLCORR_FUSED"
# Inductor fuses at most 16 reductions into one loop by default: this kernel has ~30, all over the same rows.
COMPILE_OPTIONS = {"cpp.max_horizontal_fusion_size": 64}


class FusedUnavailableWarning(UserWarning):
    """The fused correction kernel could not be compiled: compute_correction runs eagerly (slower; results equal
    to float rounding)."""


def plan(config: CorrectionConfig, numel: int) -> frozenset[str] | None:
    """The per-row reductions the fused path computes for this call, or None when it does not apply: a small
    batch (< ``MIN_POSITIONS``), a process that has not yet corrected ``BREAKEVEN_POSITIONS`` positions (unless
    ``ROLLCORR_FUSED=1``), ``ROLLCORR_FUSED=0``, a kernel that failed to compile, or a rule that needs the (B, T)
    tokens (``rejection.rule_reductions``)."""
    _state["seen"] = int(_state["seen"]) + int(numel)
    mode = os.environ.get(ENV, "")
    if numel < MIN_POSITIONS or mode == "0" or _state["failed"]:
        return None
    if mode != "1" and int(_state["seen"]) < BREAKEVEN_POSITIONS:  # not paid back yet: stay eager
        return None
    return rule_reductions(config)


def _exp(x: Tensor) -> Tensor:
    """e^x as 2^(x·log2 e): Inductor stores an ``exp`` read by several reductions to a (B, T) buffer and
    reads it back (a CPU heuristic, not configurable); ``exp2`` stays in registers. Relative error ≲ |x|·6e-8."""
    return torch.special.exp2(x * math.log2(math.e))


def row_pass(
    old: Tensor,
    rollout: Tensor,
    mask: Tensor,
    bound: float,
    tol_old: float,
    tol_rollout: float,
    token_is: tuple[str, float | None, float | None] | None,
    reductions: tuple[str, ...] = (),
    verl: bool = False,
    diagnostics: bool = True,
    row_one: Tensor | None = None,
    split: bool = False,
) -> dict[str, Tensor]:
    """The per-row reductions listed in the module docstring: (B,) tensors in the compute dtype, plus the
    (B, T) token weights ``w`` when ``token_is`` = (mode, upper, lower) is given. ``reductions``: those the
    rules declare ("sum_k1": Σ ℓ_c, negated; "sum_k2", "max_k2", "sum_k3", "max_k3"), computed only when a rule
    reads them. ``verl``: also Σ of the unclamped k3 (verl's k3_kl). ``diagnostics``: also the off-policy,
    divergence and probability-mismatch reductions (False: only n, the validity counts, Σ ℓ, the rules' and the
    token weights' — what ``compute_correction(..., diagnostics=False)`` reads). ``mask``: (B, T) bool.
    ``row_one``: (B·split, 1) ones, multiplied into w (exact): a per-row operand keeps Inductor from flattening
    w's loop to one dimension, so the row loop that computes the reductions also writes w (without it w is
    written by a separate pass over (B, T), recomputing ρ). ``split`` (contiguous inputs): reduce each row as
    k = ``split_for(T)`` pieces of T / k positions, then add (max, min) the pieces' results; w is then returned
    as its (B·k, T / k) pieces, for the caller to view as (B, T). Pure; ``torch.compile`` turns it into one
    loop over the batch."""
    b, t = mask.shape
    k = split_for(t) if split else 1
    if k == 1:
        return _row_pass(old, rollout, mask, bound, tol_old, tol_rollout, token_is, reductions, verl, diagnostics,
                         row_one)  # fmt: skip
    pieces = (x.reshape(b * k, t // k) for x in (old, rollout, mask))
    out = _row_pass(*pieces, bound, tol_old, tol_rollout, token_is, reductions, verl, diagnostics, row_one)
    return {key: _combine(key, v, b) for key, v in out.items()}


SPLIT_LENGTH = 4096  # Inductor sums a longer float32 row through memory (its cascade helper)


def split_for(t: int) -> int:
    """How many pieces ``row_pass`` reduces a row of t positions in: 2 or 4 where that divides t into pieces of
    ≤ ``SPLIT_LENGTH`` (4 096 < t ≤ 16 384), else 1. Each value of it is a kernel variant of its own.

    Inductor sums a float32 row longer than 4 096 through a "cascade" helper held in memory (a load and a store
    per accumulator per 16 positions; its cascading starts only past 16 × 4 096 positions, so at these lengths
    it adds no accuracy), shorter ones in registers: on 256 × 8192 the kernel with every diagnostic (~30 sums)
    took ~15–20 % less as 512 × 4096 pieces. Each piece is summed as before, the pieces' sums then added."""
    if t <= SPLIT_LENGTH:
        return 1
    return next((k for k in (2, 4) if t % k == 0 and t // k <= SPLIT_LENGTH), 1)


def _combine(key: str, v: Tensor, b: int) -> Tensor:
    """A ``_row_pass`` output over (B·k) row pieces back to the batch's B rows: maxima / minima of the pieces,
    sums of the rest; the weights stay (B·k, T / k) pieces."""
    if key == "w":  # left as the (B·k, T / k) pieces: the caller views them as (B, T) (in a compiled graph a
        return v  # recompiled kernel copied them back one element at a time, unable to prove k · (T / k) = T)
    pieces = v.reshape(b, -1)
    if key in ("max_k2", "max_k3", "d_max", "w_max"):
        return pieces.amax(dim=-1)
    if key == "w_min":
        return pieces.amin(dim=-1)
    return pieces.sum(dim=-1)


def _row_pass(
    old: Tensor,
    rollout: Tensor,
    mask: Tensor,
    bound: float,
    tol_old: float,
    tol_rollout: float,
    token_is: tuple[str, float | None, float | None] | None,
    reductions: tuple[str, ...],
    verl: bool,
    diagnostics: bool,
    row_one: Tensor | None,
) -> dict[str, Tensor]:
    """``row_pass`` on rows as they are (the pieces, when it splits them)."""
    dtype = compute_dtype(old, rollout)
    o = torch.where(mask, old.to(dtype), 0.0)
    r = torch.where(mask, rollout.to(dtype), 0.0)
    mf = mask.to(dtype)

    def rsum(x: Tensor) -> Tensor:
        return x.sum(dim=-1, dtype=dtype)

    out = {
        "n": rsum(mf),
        # a valid log-prob must be finite and ≤ tol (NaN fails both comparisons)
        "bad_old": rsum(mask & ~((o > -math.inf) & (o <= tol_old))),
        "bad_rollout": rsum(mask & ~((r > -math.inf) & (r <= tol_rollout))),
    }
    lr = o - r
    lrs = lr.clamp(-bound, bound)
    rho = _exp(lrs)  # 1 on padding; every term below is 0 there (computed only where read)
    k2 = lrs.square() * 0.5  # (the k2 and max statistics only when a sequence rule reads them)
    k3 = rho - 1.0 - lrs
    if "sum_k1" in reductions:
        out["sum_k1"] = -rsum(lrs)
    if "sum_k2" in reductions:
        out["sum_k2"] = rsum(k2)
    if "max_k2" in reductions:
        out["max_k2"] = torch.where(mask, k2, -math.inf).amax(dim=-1)
    if "max_k3" in reductions:
        out["max_k3"] = torch.where(mask, k3, -math.inf).amax(dim=-1)
    out["lr"] = rsum(lr)
    if diagnostics or "sum_k3" in reductions:
        out["sum_k3"] = rsum(k3)
    if diagnostics:
        out |= _diagnostic_sums(o, r, mask, mf, lr, lrs, rho, k3, verl, rsum)
    if token_is is not None:
        mode, upper, lower = token_is
        lo, hi = metric_fns.is_band(upper, lower)
        raw = rho * mf
        w = apply_threshold(raw, mf, mode, upper, lower)
        if row_one is not None:
            w = w * row_one
        out |= {
            "w": w,
            "w_sum": rsum(w),
            "w_sq": rsum(w * w),
            "raw": rsum(raw),
            "high": rsum(raw > hi),
            "low": rsum(mask & (raw < lo)),
            "w_max": w.amax(dim=-1),
            "w_min": torch.where(mask, w, math.inf).amin(dim=-1),
        }
    return out


def _diagnostic_sums(
    o: Tensor,
    r: Tensor,
    mask: Tensor,
    mf: Tensor,
    lr: Tensor,
    lrs: Tensor,
    rho: Tensor,
    k3: Tensor,
    verl: bool,
    rsum: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """``row_pass``'s reductions for the off-policy, divergence and probability-mismatch metrics (module
    docstring), from the masked log-probs o, r (0 on padding), ℓ, ℓ_c, ρ = e^ℓ_c and k3 = ρ − 1 − ℓ_c."""
    out = {"old": rsum(o), "rollout": rsum(r)}
    if verl:  # verl's k3_kl: e^ℓ − 1 − ℓ of the unclamped ℓ (0 on padding)
        out["k3_unclamped"] = rsum(_exp(lr) - 1.0 - lr)
    rho_lr = rho * lrs
    softplus = torch.where(lrs > 20.0, lrs, torch.log1p(rho))  # torch's softplus(ℓ_c), from ρ = e^ℓ_c
    out |= {
        "rho2": rsum(torch.where(mask, rho * rho, 0.0)),
        "policy_kl": rsum(rho_lr - rho + 1.0),
        "js": rsum((rho_lr - (softplus - math.log(2.0)) * (rho + 1.0)) * 0.5),
        "e_abs": rsum(torch.maximum(rho, 1.0 / rho) - 1.0),
        "abs": rsum(lrs.abs()),
    }
    p_old, p_rollout = _exp(o), _exp(r)  # 1 on padding
    d = (p_old - p_rollout).abs()  # |Δp|, 0 on padding
    p_old_m, p_rollout_m = p_old * mf, p_rollout * mf
    out |= {
        "p_old_sum": rsum(p_old_m),
        "p_rollout_sum": rsum(p_rollout_m),
        "p_old_sq_sum": rsum(p_old_m * p_old),
        "p_rollout_sq_sum": rsum(p_rollout_m * p_rollout),
        "p_cross_sum": rsum(p_old_m * p_rollout),
        "d_sum": rsum(d),
        "d_max": d.amax(dim=-1),
        "small_diff_count": rsum(mask & (d < 1e-3)),
    }
    for i, threshold in enumerate(metric_fns.PROB_SHARES):
        out[f"ge{i}"] = rsum(d >= threshold)
    return out


_state: dict[str, object] = {"compiled": None, "failed": False, "seen": 0}  # seen: positions corrected so far


def capability_cache_dir() -> str:
    """Compile into an Inductor cache folder of this CPU capability: ``<cache>/rollcorr-<capability>``, where
    ``<cache>`` is ``TORCHINDUCTOR_CACHE_DIR`` or Inductor's default. Inductor's cache is not keyed by the
    capability torch runs with (``ATEN_CPU_CAPABILITY``): on an AVX512 machine, the kernels a native run cached
    made a later run under ``ATEN_CPU_CAPABILITY=avx2`` crash with a segmentation fault. Called before the
    first compile of the process (Inductor reads the variable then)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    leaf = f"rollcorr-{torch.backends.cpu.get_cpu_capability().lower()}"
    if os.path.basename(os.path.normpath(base)) != leaf:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, leaf)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def run_row_pass(*args: object) -> dict[str, Tensor] | None:
    """``row_pass`` compiled (dynamic shapes: one kernel for every B, T); None once compiling has failed."""
    if _state["failed"]:
        return None
    if _state["compiled"] is None:
        capability_cache_dir()
        _state["compiled"] = torch.compile(row_pass, dynamic=True, options=COMPILE_OPTIONS)
    try:
        return _state["compiled"](*args)
    except Exception as err:  # noqa: BLE001 — any compiler failure: fall back to the eager path, once
        _state["failed"] = True
        warnings.warn(
            f"the fused correction kernel could not be compiled ({type(err).__name__}: {str(err)[:200]}); "
            f"compute_correction runs eagerly from now on (slower on large batches). "
            f"Set {ENV}=0 to skip the attempt.",
            FusedUnavailableWarning,
            stacklevel=5,  # the caller of compute_correction
        )
        return None


def rows_from(s: dict[str, Tensor], shape: tuple[int, int], *, verl: bool, count_dtype: torch.dtype) -> Rows:
    """The ``Rows`` of a batch from the kernel's per-row counts (verl's conventions when ``verl``)."""
    n = s["n"]
    valid = n > 0
    num_tokens = n.sum()
    return Rows(
        n=n,
        valid=valid,
        num_tokens=num_tokens,
        num_rows=valid.sum().to(n.dtype),
        num_pad=shape[0] * shape[1] - num_tokens,
        verl=verl,
        count_dtype=count_dtype,
    )


class KernelStatistics:
    """The rules' statistics from the kernel's per-row reductions (``rejection.Statistics``' fused twin): only
    ``row_sum`` / ``row_max`` of what the rules declared; no (B, T) token statistic."""

    def __init__(self, sums: dict[str, Tensor], rows: Rows) -> None:
        self.sums, self.rows = sums, rows

    def row_sum(self, stat: str) -> Tensor:
        return self.sums[f"sum_{stat}"]

    def row_max(self, stat: str) -> Tensor:
        return self.sums[f"max_{stat}"]

    def token(self, stat: str) -> Tensor:
        raise RuntimeError(
            f"the fused path holds no (B, T) statistic ({stat}); the rule must declare its reductions"
        )


def diagnostics(s: dict[str, Tensor], rows: Rows) -> metric_fns.Metrics:
    """The off-policy, divergence and probability-mismatch metrics from the kernel's row sums."""
    tot = {k: s[k].sum() for k in ("lr", "sum_k3", "rho2", "policy_kl", "js", "e_abs", "abs")}
    k3_kl = s["k3_unclamped"].sum() if rows.verl else tot["sum_k3"]
    prob_sums = (
        "p_old_sum", "p_rollout_sum", "p_old_sq_sum", "p_rollout_sq_sum", "p_cross_sum", "small_diff_count",
    )  # fmt: skip
    return {
        **metric_fns.offpolicy_from_sums(
            rows, old_row=s["old"], roll_row=s["rollout"], lr_row=s["lr"], lr_sum=tot["lr"], k3_sum=k3_kl,
            rho2_sum=tot["rho2"],
        ),
        **metric_fns.divergence_from_sums(
            rows, k3_sum=tot["sum_k3"], policy_kl_sum=tot["policy_kl"], js_sum=tot["js"],
            e_abs_sum=tot["e_abs"], lr_sum=tot["lr"], abs_sum=tot["abs"],
        ),
        **metric_fns.prob_from_sums(
            rows.n, rows.num_tokens, **{k: s[k].sum() for k in prob_sums},
            d_row_max=s["d_max"], d_row_sum=s["d_sum"],
            ge=[s[f"ge{i}"].sum() for i in range(len(metric_fns.PROB_SHARES))],
        ),
    }  # fmt: skip


def row_statistics(
    anchor: Tensor,
    rollout: Tensor,
    mask: Tensor,
    config: CorrectionConfig,
    reductions: frozenset[str],
    *,
    names: tuple[str, str],
    validate: bool,
    diagnostics: bool = True,
) -> tuple[KernelStatistics, dict[str, Tensor]] | None:
    """Run the kernel for ``compute_correction``: (the rules' statistics, with ``.rows``; every per-row sum),
    or None when the kernel is unavailable. Raises the eager path's ``ValueError`` for an empty mask or an
    invalid log-prob (``validate``). ``diagnostics``: also the diagnostics' reductions (``row_pass``)."""
    mask_bool = mask if mask.dtype == torch.bool else mask != 0
    if validate and mask.dtype != torch.bool:
        check_binary_mask("response_mask", mask)
    token_is = (config.is_mode, config.is_upper, config.is_lower) if config.is_level == "token" else None
    tols = (positive_tolerance(anchor.dtype), positive_tolerance(rollout.dtype))
    dtype = compute_dtype(anchor, rollout)
    b, t = mask.shape
    split = all(x.is_contiguous() for x in (anchor, rollout, mask_bool))  # reshaping them is free
    rows = b * (split_for(t) if split else 1)  # the kernel's rows (pieces of rows when it splits them)
    s = run_row_pass(
        anchor, rollout, mask_bool, float(config.safety_bound), *tols, token_is, tuple(sorted(reductions)),
        config.verl_compat, diagnostics, None if token_is is None else anchor.new_ones(rows, 1, dtype=dtype),
        split,
    )  # fmt: skip
    if s is None:
        return None
    if "w" in s:
        s["w"] = s["w"].view(b, t)  # the pieces' weights (row_pass), contiguous: a view
    count_dtype = mask.dtype if mask.dtype.is_floating_point else torch.get_default_dtype()
    rows = rows_from(s, tuple(mask.shape), verl=config.verl_compat, count_dtype=count_dtype)
    if validate:  # one sync, as in the eager path
        num_tokens, *bad = torch.stack([rows.num_tokens, s["bad_old"].sum(), s["bad_rollout"].sum()]).tolist()
        if num_tokens == 0:
            raise ValueError(NO_VALID_TOKEN)
        for count, name, x, tol in zip(bad, names, (anchor, rollout), tols):
            if count:
                raise ValueError(locate(name, x, mask_bool, tol))
    return KernelStatistics(s, rows), s


def is_weights(
    s: dict[str, Tensor], rows: Rows, mask: Tensor, config: CorrectionConfig
) -> tuple[Tensor, metric_fns.Metrics]:
    """(B, T) thresholded IS weights (0 on padding) and the IS metrics, from the kernel's reductions.
    Sequence levels threshold the (B,) row weight (``weights.row_weights``), then broadcast it to the row's
    valid tokens."""
    level, mode, upper, lower = config.is_level, config.is_mode, config.is_upper, config.is_lower
    if level == "token":
        w = s["w"]
        return w, metric_fns.is_metrics_from_sums(
            rows, upper, lower, mode, row_log=None, w_sum=s["w_sum"].sum(), w_sq=s["w_sq"].sum(),
            w_row_sum=s["w_sum"], raw_row_sum=s["raw"], high=s["high"].sum(), low=s["low"].sum(),
            w_max=s["w_max"].max(), w_min=s["w_min"].min(),
        )  # fmt: skip
    row_log, row_raw, row_w = row_weights(s["lr"], rows, level, config.safety_bound, mode, upper, lower)
    oob = None
    if mode == "mask":
        out = (row_raw > metric_fns.is_band(upper, lower)[1]) | (row_raw < (lower or 0.0))
        oob = (rows.n * out).sum()
    metrics = metric_fns.is_metrics_from_sums(
        rows, upper, lower, mode, row_log=row_log, w_sum=(row_w * rows.n).sum(),
        w_sq=(row_w.square() * rows.n).sum(), w_row_sum=row_w * rows.n, raw_row_sum=row_raw * rows.n, oob=oob,
    )  # fmt: skip
    # w_bt = 1[valid] · w_row, as the eager path's raw_weights (the mask's bytes as floats: a broadcast
    # ``torch.where`` on a bool mask is ~4× slower on 256 × 8192)
    return mask.view(torch.uint8).to(row_w.dtype).mul_(row_w[:, None]), metrics
