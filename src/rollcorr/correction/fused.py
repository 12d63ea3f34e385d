"""The correction of a large batch in one pass over (B, T): every per-row reduction the weights, the sequence
rules and the diagnostics read, computed by one compiled kernel (``torch.compile``, Inductor's C++ backend).

The eager path (api.py) makes ~30 passes over (B, T), one per operation, each reading and writing memory; here
one loop per row reads π_old, μ and the mask once and keeps every per-token quantity in registers:

    ℓ = old − rollout (0 on padding), ℓ_c = clamp(ℓ, ±bound), ρ = exp(ℓ_c), p_old = e^old, p_μ = e^rollout
    per row: n, Σ old, Σ rollout, Σ ℓ, Σ k3, Σ ρ², Σ (ρℓ_c − ρ + 1), Σ JS term, Σ (e^|ℓ_c| − 1), Σ |ℓ_c|,
             Σ p_old, Σ p_μ, Σ p_old², Σ p_μ², Σ p_old·p_μ, Σ |Δp|, max |Δp|, #|Δp| < 1e-3,
             #|Δp| ≥ 0.01 / 0.05 / 0.1, #invalid old / rollout entries
    sequence rules, when one reads them: Σ ℓ_c (k1), Σ k2 and max k2, max k3
    token IS: the (B, T) weights w = threshold(ρ·mask) and per row Σ w, Σ w², Σ ρ, #ρ > hi, #ρ < lo, max / min w

Everything else (sequence weights, sequence rules, metrics) follows from these (B,) values with the same
functions the eager path uses (``metrics.*_from_sums``, ``rejection.rs_option``). Sums run in another order
than the eager path's, and e^x is computed as 2^(x·log2 e) (see ``_exp``; relative error ≲ |x|·6e-8, so
≲ 1.2e-6 at the ±20 clamp), so results agree with the eager path to float rounding, not bit for bit
(tests/test_correction_perf_fused.py).

Used by ``compute_correction`` when B·T ≥ ``MIN_POSITIONS`` and the configuration needs nothing beyond these
reductions (``supports``): no token-level rejection, veto, TRM, OPSM, staleness, decomposition metrics or
verl-compatible rounding. The first call compiles (13–35 s measured on a loaded 2-core machine with a cold
cache, less once Inductor's on-disk cache holds the kernel; again per input dtype and kernel variant: token IS
or not, the statistics the sequence rules read); if compiling fails (no C++
compiler, an unsupported platform) a ``FusedUnavailableWarning`` says so once and every call takes the eager
path. ``ROLLCORR_FUSED=0`` in the environment turns the fused path off.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
from torch import Tensor

from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction import metrics as M
from rollcorr.correction.ratios import (
    NO_VALID_TOKEN,
    Rows,
    check_binary_mask,
    compute_dtype,
    locate,
    positive_tolerance,
)
from rollcorr.correction.rejection import rs_option, split_option
from rollcorr.correction.weights import apply_threshold, norm_factor

MIN_POSITIONS = 1 << 18  # B·T from which compute_correction takes the fused path (256 K positions)
ENV = "ROLLCORR_FUSED"
# Inductor fuses at most 16 reductions into one loop by default: this kernel has ~30, all over the same rows.
COMPILE_OPTIONS = {"cpp.max_horizontal_fusion_size": 64}


class FusedUnavailableWarning(UserWarning):
    """The fused correction kernel could not be compiled: compute_correction runs eagerly (slower; results equal
    to float rounding)."""


def supports(config: CorrectionConfig, numel: int, *, decomposition: bool, staleness: bool) -> bool:
    """Whether the fused path covers this call: a large batch, and only rules and metrics computed from the
    per-row reductions above (sequence-level RS options on k1/k2/k3; no token rules, veto, TRM, OPSM,
    staleness or decomposition metrics, no verl rounding)."""
    if numel < MIN_POSITIONS or os.environ.get(ENV, "1") == "0" or _state["failed"]:
        return False
    seq_only = all(o.startswith("seq_") and not o.endswith("binary_kl") for o in config.rs)
    no_rules = config.veto_threshold is None and config.veto_upper is None and config.opsm_delta is None
    no_trm = config.trm_max_k2 is None and config.trm_mean_k3 is None
    return seq_only and no_rules and no_trm and not (config.verl_compat or decomposition or staleness)


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
    rs_stats: tuple[str, ...] = (),
) -> dict[str, Tensor]:
    """The per-row reductions listed in the module docstring: (B,) tensors in the compute dtype, plus the
    (B, T) token weights ``w`` when ``token_is`` = (mode, upper, lower) is given. ``rs_stats``: the statistics
    of the sequence rules ("k1": Σ ℓ_c; "k2": Σ k2 and max k2; "k3": max k3), computed only when a rule reads
    them. ``mask``: (B, T) bool. Pure; ``torch.compile`` turns it into one loop over the batch."""
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
        "old": rsum(o),
        "rollout": rsum(r),
    }
    lr = o - r
    lrs = lr.clamp(-bound, bound)
    rho = _exp(lrs)  # 1 on padding; every term below is 0 there
    k2 = lrs.square() * 0.5  # (the k2 and max statistics only when a sequence rule reads them)
    k3 = rho - 1.0 - lrs
    rho_lr = rho * lrs
    softplus = torch.where(lrs > 20.0, lrs, torch.log1p(rho))  # torch's softplus(ℓ_c), from ρ = e^ℓ_c
    if "k1" in rs_stats:
        out["lrs"] = rsum(lrs)
    if "k2" in rs_stats:
        out |= {"k2": rsum(k2), "k2_max": torch.where(mask, k2, -math.inf).amax(dim=-1)}
    if "k3" in rs_stats:
        out["k3_max"] = torch.where(mask, k3, -math.inf).amax(dim=-1)
    out |= {
        "lr": rsum(lr),
        "k3": rsum(k3),
        "rho2": rsum(torch.where(mask, rho * rho, 0.0)),
        "policy_kl": rsum(rho_lr - rho + 1.0),
        "js": rsum((rho_lr - (softplus - math.log(2.0)) * (rho + 1.0)) * 0.5),
        "e_abs": rsum(torch.maximum(rho, 1.0 / rho) - 1.0),
        "abs": rsum(lrs.abs()),
    }
    a, b = _exp(o), _exp(r)  # 1 on padding
    d = (a - b).abs()  # 0 on padding
    am, bm = a * mf, b * mf
    out |= {
        "sa": rsum(am),
        "sb": rsum(bm),
        "saa": rsum(am * a),
        "sbb": rsum(bm * b),
        "sab": rsum(am * b),
        "d_sum": rsum(d),
        "d_max": d.amax(dim=-1),
        "lt": rsum(mask & (d < 1e-3)),
    }
    for i, threshold in enumerate(M.PROB_SHARES):
        out[f"ge{i}"] = rsum(d >= threshold)
    if token_is is not None:
        mode, upper, lower = token_is
        lo, hi = M.is_band(upper, lower)
        raw = rho * mf
        w = apply_threshold(raw, mf, mode, upper, lower)
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


_state: dict[str, object] = {"compiled": None, "failed": False}


def run_row_pass(*args: object) -> dict[str, Tensor] | None:
    """``row_pass`` compiled (dynamic shapes: one kernel for every B, T); None once compiling has failed."""
    if _state["failed"]:
        return None
    if _state["compiled"] is None:
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


def rows_from(s: dict[str, Tensor], shape: tuple[int, int]) -> Rows:
    """The ``Rows`` of a batch from the kernel's per-row counts (rollcorr's unbiased conventions)."""
    n = s["n"]
    valid = n > 0
    num_tokens = n.sum()
    return Rows(
        n=n,
        valid=valid,
        num_tokens=num_tokens,
        num_rows=valid.sum().to(n.dtype),
        num_pad=shape[0] * shape[1] - num_tokens,
        verl=False,
        count_dtype=torch.get_default_dtype(),
    )


def diagnostics(s: dict[str, Tensor], rows: Rows) -> M.Metrics:
    """The off-policy, divergence and probability-mismatch metrics from the kernel's row sums."""
    tot = {k: s[k].sum() for k in ("lr", "k3", "rho2", "policy_kl", "js", "e_abs", "abs")}
    return {
        **M.offpolicy_from_sums(
            rows, old_row=s["old"], roll_row=s["rollout"], lr_row=s["lr"], lr_sum=tot["lr"], k3_sum=tot["k3"],
            rho2_sum=tot["rho2"],
        ),
        **M.divergence_from_sums(
            rows, k3_sum=tot["k3"], policy_kl_sum=tot["policy_kl"], js_sum=tot["js"], e_abs_sum=tot["e_abs"],
            lr_sum=tot["lr"], abs_sum=tot["abs"],
        ),
        **M.prob_from_sums(
            rows.n, rows.num_tokens, **{k: s[k].sum() for k in ("sa", "sb", "saa", "sbb", "sab", "lt")},
            d_row_max=s["d_max"], d_row_sum=s["d_sum"], ge=[s[f"ge{i}"].sum() for i in range(len(M.PROB_SHARES))],
        ),
    }  # fmt: skip


def correct(
    anchor: Tensor,
    rollout: Tensor,
    mask: Tensor,
    config: CorrectionConfig,
    *,
    names: tuple[str, str],
    validate: bool,
    group: object | None,
) -> tuple[Tensor | None, Tensor | None, Rows, M.Metrics, M.Metrics] | None:
    """``compute_correction`` for a configuration ``supports`` accepts: (IS weights or None, (B,) row keep of
    the sequence rules or None, rows, IS + RS metrics, diagnostics), or None when the kernel is unavailable.
    Raises the eager path's ``ValueError`` for an empty mask or an invalid log-prob (``validate``)."""
    mask_bool = mask if mask.dtype == torch.bool else mask != 0
    if validate and mask.dtype != torch.bool:
        check_binary_mask("response_mask", mask)
    token_is = (config.is_mode, config.is_upper, config.is_lower) if config.is_level == "token" else None
    tols = (positive_tolerance(anchor.dtype), positive_tolerance(rollout.dtype))
    rs_stats = tuple(sorted({split_option(option)[1] for option in config.rs}))
    s = run_row_pass(anchor, rollout, mask_bool, float(config.safety_bound), *tols, token_is, rs_stats)
    if s is None:
        return None
    rows = rows_from(s, tuple(mask.shape))
    if validate:  # one sync, as in the eager path
        num_tokens, *bad = torch.stack([rows.num_tokens, s["bad_old"].sum(), s["bad_rollout"].sum()]).tolist()
        if num_tokens == 0:
            raise ValueError(NO_VALID_TOKEN)
        for count, name, x, tol in zip(bad, names, (anchor, rollout), tols):
            if count:
                raise ValueError(locate(name, x, mask_bool, tol))
    metrics: M.Metrics = {}
    weights = None
    if config.is_level is not None:
        w, is_metrics = _is_weights(s, rows, mask_bool, config)
        metrics.update(is_metrics)
        if config.batch_normalize:
            factor = norm_factor(w, rows.n, rows.valid, config.is_level, group=group)
            w = w.div_(factor)  # a fresh tensor from the kernel or _is_weights
            metrics["rollout_is_batch_norm_factor"] = factor
        if config.applies_weights:
            weights = w
    row_keep = None
    for option, threshold in zip(config.rs, config.rs_thresholds):
        stat = split_option(option)[1]  # seq_sum / seq_mean / seq_max of k1, k2 or k3 (``supports``)
        row_sum = -s["lrs"] if stat == "k1" else s[stat]  # Σ_t k1 = −Σ_t ℓ_c
        r = rs_option(option, threshold, None, rows, row_sum=row_sum, row_max=s.get(f"{stat}_max"))
        metrics.update(M.rs_option_metrics(r, rows))
        row_keep = r.row_keep if row_keep is None else row_keep & r.row_keep
    return weights, row_keep, rows, metrics, diagnostics(s, rows)


def _is_weights(
    s: dict[str, Tensor], rows: Rows, mask: Tensor, config: CorrectionConfig
) -> tuple[Tensor, M.Metrics]:
    """(B, T) thresholded IS weights (0 on padding) and the IS metrics, from the kernel's reductions.
    Sequence levels threshold the (B,) row weight, then broadcast it to the row's valid tokens."""
    level, mode, upper, lower = config.is_level, config.is_mode, config.is_upper, config.is_lower
    if level == "token":
        w = s["w"]
        return w, M.is_metrics_from_sums(
            rows, upper, lower, mode, row_log=None, w_sum=s["w_sum"].sum(), w_sq=s["w_sq"].sum(),
            w_row_sum=s["w_sum"], raw_row_sum=s["raw"], high=s["high"].sum(), low=s["low"].sum(),
            w_max=s["w_max"].max(), w_min=s["w_min"].min(),
        )  # fmt: skip
    row_log = s["lr"] if level == "sequence" else s["lr"] / rows.n.clamp_min(1)  # Σ_t ℓ or mean_t ℓ
    row_raw = row_log.clamp(-config.safety_bound, config.safety_bound).exp()
    row_w = apply_threshold(row_raw, rows.valid.to(rows.dtype), mode, upper, lower)
    oob = None
    if mode == "mask":
        out = (row_raw > M.is_band(upper, lower)[1]) | (row_raw < (lower or 0.0))
        oob = (rows.n * out).sum()
    metrics = M.is_metrics_from_sums(
        rows, upper, lower, mode, row_log=row_log, w_sum=(row_w * rows.n).sum(),
        w_sq=(row_w.square() * rows.n).sum(), w_row_sum=row_w * rows.n, raw_row_sum=row_raw * rows.n, oob=oob,
    )  # fmt: skip
    return torch.where(mask, row_w[:, None], 0.0), metrics
