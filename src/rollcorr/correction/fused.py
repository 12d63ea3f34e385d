"""The statistics of a large batch in one compiled pass over (B, T), on request only: ``warm(config)`` compiles
``_row_pass`` (``torch.compile``, Inductor's C++ backend) for one configuration before a run, and from then on
``statistics.batch_statistics`` takes it for batches of ≥ ``MIN_POSITIONS`` positions of that configuration.
Nothing compiles in a call of ``compute_correction``: a call the warmed kernel does not fit (another variant, a
shape Inductor would recompile for) takes the default path (statistics.py: the kernel built at setup, native.py,
else plain torch) instead. ``rollcorr train`` warms it at start when ``ROLLCORR_FUSED=1`` is set
(docs/performance.md).

One loop per row reads π_old, μ and the mask once and keeps every per-token quantity in registers:

    ℓ = old − rollout (0 on padding), ℓ_c = clamp(ℓ, ±bound), ρ = exp(ℓ_c), p_old = e^old, p_μ = e^rollout
    per row: n, Σ old, Σ rollout, Σ ℓ, Σ k3, Σ ρ², Σ (ρℓ_c − ρ + 1), Σ JS term, Σ (e^|ℓ_c| − 1), Σ |ℓ_c|,
             Σ p_old, Σ p_μ, Σ p_old², Σ p_μ², Σ p_old·p_μ, Σ |Δp|, max |Δp|, #|Δp| < 1e-3,
             #|Δp| ≥ 0.01 / 0.05 / 0.1, #invalid old / rollout entries
    the rules' reductions, when a rule declares them (``rejection.Rule.reductions``): Σ ℓ_c (sum_k1), Σ k2
    (sum_k2), max k2, max k3; verl mode: Σ (e^ℓ − 1 − ℓ) unclamped (verl's k3_kl)
    token IS: the (B, T) weights w = threshold(ρ·mask) and per row Σ w, Σ w², Σ ρ, #ρ > hi, #ρ < lo, max / min w
    ``compute_correction(..., diagnostics=False)``: only n, the invalid counts, Σ ℓ, the rules' and token IS's

Rows of 4 096 < T ≤ 16 384 positions that 2 or 4 divides are reduced as 2 or 4 pieces (``split_for``): Inductor
keeps the accumulators of rows up to 4 096 long in registers, longer ones in memory. Sums run in another order
than the default path's, and e^x is computed as 2^(x·log2 e) (see ``_exp``; relative error ≲ |x|·6e-8, so
≲ 1.2e-6 at the ±20 clamp): results agree with the default path to float rounding (tests/test_correction_perf_fused.py).

Compiling costs seconds to tens of seconds per variant (token IS or not, the reductions the rules read, verl
mode, diagnostics, dtype) and is worth it only for a long job of large batches; if it fails (no C++ compiler,
an unsupported platform) ``warm`` says so with a ``FusedUnavailableWarning`` and the default path serves.
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
from rollcorr.correction.ratios import compute_dtype, positive_tolerance
from rollcorr.correction.weights import apply_threshold

MIN_POSITIONS = 1 << 18  # B·T from which a warmed kernel serves (below, the default path costs about as much)
ENV = "ROLLCORR_FUSED"  # "1": ``rollcorr train`` warms the kernel for its correction before the first step
# Inductor fuses at most 16 reductions into one loop by default: this kernel has ~30, all over the same rows.
COMPILE_OPTIONS = {"cpp.max_horizontal_fusion_size": 64}


class FusedUnavailableWarning(UserWarning):
    """The fused correction kernel could not be compiled: compute_correction takes the default path (results
    equal to float rounding)."""


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
    kernel: Callable[..., dict[str, Tensor]] | None = None,
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
    as its (B·k, T / k) pieces, for the caller to view as (B, T). Pure; ``torch.compile`` turns ``_row_pass`` into one
    loop over the batch. ``kernel``: ``_row_pass`` compiled (``warm``); None runs it eagerly (the tests)."""
    b, t = mask.shape
    k = split_for(t) if split else 1
    kernel = kernel or _row_pass
    if k == 1:
        return kernel(old, rollout, mask, bound, tol_old, tol_rollout, token_is, reductions, verl, diagnostics,
                      row_one)
    pieces = (x.reshape(b * k, t // k) for x in (old, rollout, mask))
    out = kernel(*pieces, bound, tol_old, tol_rollout, token_is, reductions, verl, diagnostics, row_one)
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


_state: dict[str, object] = {"compiled": None, "warm": set()}  # warm: the variants compiled and run once


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


def variant(config: CorrectionConfig, dtype: torch.dtype, diagnostics: bool = True) -> tuple:
    """What one compiled kernel is specialised on: token IS (mode, upper, lower) or None, the rules' reductions,
    verl mode, the diagnostics, the compute dtype."""
    from rollcorr.correction.rejection import declared_reductions

    token_is = (config.is_mode, config.is_upper, config.is_lower) if config.is_level == "token" else None
    return token_is, tuple(sorted(declared_reductions(config))), config.verl_compat, diagnostics, dtype


def warm(config: CorrectionConfig, dtype: torch.dtype = torch.float32, *, diagnostics: bool = True) -> bool:
    """Compile the kernel for ``config``'s statistics and run it once, now (seconds to a minute): from then on
    every batch of ≥ ``MIN_POSITIONS`` positions with this configuration, dtype and ``diagnostics`` takes it.
    Returns False (with a ``FusedUnavailableWarning``) when compiling fails: the default path serves."""
    key = variant(config, dtype, diagnostics)
    if key in _state["warm"]:
        return True
    if _state["compiled"] is None:
        capability_cache_dir()
        _state["compiled"] = torch.compile(_row_pass, dynamic=True, options=COMPILE_OPTIONS)
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 64, generator=g, dtype=dtype) - 0.1
    old = rollout + 0.01 * torch.randn(3, 64, generator=g, dtype=dtype)
    mask = torch.arange(64)[None] < torch.tensor([[64], [40], [0]])
    try:
        with torch.no_grad():  # as compute_correction calls it (grad mode is one of the kernel's guards)
            _run(old, rollout, mask, key, float(config.safety_bound))
    except Exception as err:  # noqa: BLE001 — any compiler failure: say so once, the default path serves
        warnings.warn(f"the fused correction kernel could not be compiled ({type(err).__name__}: {str(err)[:200]}); "
                      "compute_correction keeps its default path", FusedUnavailableWarning, stacklevel=2)
        return False
    _state["warm"].add(key)
    return True


def _run(old: Tensor, rollout: Tensor, mask: Tensor, key: tuple, bound: float) -> dict[str, Tensor]:
    """The compiled kernel on a batch (contiguous inputs: rows reduced in ``split_for`` pieces)."""
    token_is, reductions, verl, diagnostics, dtype = key
    b, t = mask.shape
    split = all(x.is_contiguous() for x in (old, rollout, mask))
    rows = b * (split_for(t) if split else 1)
    row_one = None if token_is is None else old.new_ones(rows, 1, dtype=dtype)
    tols = (positive_tolerance(old.dtype), positive_tolerance(rollout.dtype))
    return row_pass(old, rollout, mask, bound, *tols, token_is, reductions, verl, diagnostics, row_one, split,
                    kernel=_state["compiled"])


def _key(plan, dtype: torch.dtype) -> tuple:
    """The variant (``variant``) a ``statistics.Plan`` needs."""
    return plan.token_is, tuple(sorted(plan.reductions)), plan.verl, plan.diagnostics, dtype


def serves(plan, dtype: torch.dtype, mask_bool: Tensor) -> bool:
    """Whether a warmed kernel takes this batch: its variant compiled, at least ``MIN_POSITIONS`` positions."""
    return _key(plan, dtype) in _state["warm"] and mask_bool.numel() >= MIN_POSITIONS


def row_statistics(
    anchor: Tensor, rollout: Tensor, mask_bool: Tensor, plan, dtype: torch.dtype
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor | None] | None:
    """``statistics.batch_statistics``' compiled source: (per-row reductions, batch totals, token weights) as the
    default path names them (the π_θ split is computed beside it), or None — not warmed for this variant, a
    batch under ``MIN_POSITIONS``, or a call Inductor would recompile for (never done mid-run)."""
    if not serves(plan, dtype, mask_bool):
        return None
    key = _key(plan, dtype)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            s = _run(anchor, rollout, mask_bool, key, plan.bound)
    except Exception:  # noqa: BLE001 — a guard failed (another stride, a size-1 dimension): the default path serves
        return None
    weights = s.pop("w").view(mask_bool.shape) if "w" in s else None
    per_row = ("n", "lr", "old", "rollout", "d_sum", "d_max", "sum_k1", "sum_k2", "max_k2", "max_k3", "w_sum", "raw")
    row = {k: v for k, v in s.items() if k in per_row}
    if "sum_k3" in s:
        row["sum_k3"] = s["sum_k3"]
    total = {k: v.amax() if k == "w_max" else v.amin() if k == "w_min" else v.sum()
             for k, v in s.items() if k not in per_row and not k.startswith("bad_")}
    return row, total, weights
