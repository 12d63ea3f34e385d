"""Diagnostics (docs/spec.md §4): every verl metric under its verl name and meaning, plus rollcorr's extras.

All functions return ``dict[str, 0-d Tensor]`` (no ``.item()``); ``metrics_to_floats`` is the one place values
are synced to Python. Keys here carry no prefix; ``compute_correction`` adds ``rollout_corr/``.

Where verl is biased, rollcorr is not unless ``Tokens.verl`` is set: rows without a valid token never enter
per-sequence metrics (verl averages them in as ppl 1, χ² 0, weight 1), and ``k3_kl`` uses the clamped
log-ratio (verl's is unclamped and turns ``inf`` at ℓ ≈ 90).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollcorr.config.correction import LOG_RATIO_CLAMP
from rollcorr.correction.ratios import (
    Rows,
    RSOutcome,
    Tokens,
    any_per_row,
    at_least_one,
    check_mask,
    check_tensor,
    zero_below_two,
)

Metrics = dict[str, Tensor]
# The metrics that describe the sampler/learner mismatch rather than the correction applied to it: verl's
# off-policy metrics, the divergences, the probability mismatch and the discrepancy/drift split.
# ``compute_correction(..., diagnostics=False)`` leaves them out (and does not compute what they read).
DIAGNOSTIC_METRICS = frozenset({
    "training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
    "gen_kl", "policy_kl", "js_divergence", "token_mult_prob_error", "log_ratio_mean", "log_ratio_abs_mean",
    "prob_diff_seq_max_mean", "prob_diff_seq_mean_mean", "prob_diff_mean", "prob_diff_max", "prob_diff_frac_lt_1e-3",
    "prob_diff_frac_ge_0.01", "prob_diff_frac_ge_0.05", "prob_diff_frac_ge_0.1", "prob_pearson",
    "discrepancy_k3", "drift_k3", "total_k3",
})
PPL_LOG_CAP = 80.0  # rollcorr's PPL metrics saturate at e^80 (finite in float32); verl's overflow to inf


def _count(flag: Tensor, dtype: torch.dtype) -> Tensor:
    """Number of True entries as a 0-d ``dtype`` tensor (count_nonzero: no bool → float copy)."""
    return torch.count_nonzero(flag).to(dtype)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ a·b over all elements in one fused pass."""
    return torch.dot(a.reshape(-1), b.reshape(-1))


def _std(values: Tensor, weight: Tensor, total: Tensor) -> Tensor:
    """sqrt(max(E[x²] − E[x]², 0)) with E the weighted mean Σ weight·x / total."""
    mean = (values * weight).sum() / total
    var = (values.square() * weight).sum() / total - mean.square()
    return var.clamp_min(0).sqrt()


def _row_std_unbiased(x: Tensor, tok: Rows) -> Tensor:
    """Unbiased std of a (B,) row value over the rows that count (all in verl mode, valid otherwise);
    0 when fewer than two rows count."""
    w = torch.ones_like(x) if tok.verl else tok.valid_f
    count = w.sum()
    mean = (x * w).sum() / count.clamp_min(1)
    var = ((x - mean).square() * w).sum() / (count - 1).clamp_min(1)
    return torch.where(count > 1, var.sqrt(), torch.zeros_like(var))


# ---- IS ---------------------------------------------------------------------------------------
def is_band(upper: float | None, lower: float | None) -> tuple[float, float]:
    """(lo, hi) of the IS metrics' fraction_low / fraction_high: hi = upper (inf if None), lo = lower or,
    as in verl, 1/upper when no lower bound is given."""
    hi = math.inf if upper is None else upper
    lo = (1.0 / hi if hi != math.inf else 0.0) if not lower else lower
    return lo, hi


def is_metrics(
    w: Tensor,
    raw: Tensor,
    row_log: Tensor | None,
    tok: Tokens,
    level: str,
    upper: float | None,
    lower: float | None,
    mode: str,
) -> Metrics:
    """verl ``compute_is_metrics`` (verl ``rollout_corr_helper.py``) on the thresholded weights ``w`` and the raw ones.
    For sequence / geometric levels ``row_log`` is the per-row log weight (unclamped)."""
    dtype = w.dtype
    lo, hi = is_band(upper, lower)
    extra: dict[str, Tensor] = {}
    if row_log is None:
        # raw is 0 on padding: "> hi" never fires there, "< lo" always does (subtract the padding count)
        extra["high"] = _count(raw > hi, dtype)
        extra["low"] = _count(raw < lo, dtype) - tok.num_pad if lo > 0 else torch.zeros((), dtype=dtype)
        extra["w_max"] = w.max()  # w ≥ 0 and 0 on padding: the max over valid tokens
        extra["w_min"] = tok.valid_min(w)
    elif mode == "mask":
        extra["oob"] = _count(((raw > hi) | (raw < (lower or 0.0))) & tok.mask, dtype)
    w_sq = w.square().sum() if tok.verl else _dot(w, w)  # verl's sum order
    return is_metrics_from_sums(
        tok, upper, lower, mode, row_log=row_log, w_sum=w.sum(), w_sq=w_sq, w_row_sum=w.sum(dim=-1),
        raw_row_sum=raw.sum(dim=-1), **extra,
    )


def is_metrics_from_sums(
    rows: Rows,
    upper: float | None,
    lower: float | None,
    mode: str,
    *,
    row_log: Tensor | None,
    w_sum: Tensor,
    w_sq: Tensor,
    w_row_sum: Tensor,
    raw_row_sum: Tensor,
    high: Tensor | None = None,
    low: Tensor | None = None,
    w_max: Tensor | None = None,
    w_min: Tensor | None = None,
    oob: Tensor | None = None,
) -> Metrics:
    """The IS metrics from reductions of the thresholded weights w and the raw ones (valid tokens):
    Σ w, Σ w², (B,) row sums Σ_t w and Σ_t raw; token level: the counts of raw > hi and raw < lo, max and
    min of w; sequence / geometric level: ``row_log`` (B,) and, in mask mode, the count ``oob`` of tokens
    whose raw weight is outside [lower or 0, hi].

        mean = Σw / N   std = sqrt(Σw²/N − mean²)   ESS = (mean + 1e-8)² / (Σw²/N)   (N valid tokens)
        seq_*: over rows of the row means Σ_t w / n and of the flags Σ_t raw / n > hi, < lo"""
    out: Metrics = {}
    lo, hi = is_band(upper, lower)
    total = rows.den(rows.num_tokens)
    if row_log is None:
        mean, sq, share_high, share_low = (torch.stack([w_sum, w_sq, high, low]) / total).unbind()
        out["rollout_is_ratio_fraction_high"], out["rollout_is_ratio_fraction_low"] = share_high, share_low
        out["rollout_is_max"], out["rollout_is_min"] = w_max, w_min
        if mode == "mask":  # IcePop out-of-band share; the band's lower edge is 0 when none is given
            out["rollout_is_oob_ratio"] = share_high + share_low if lower else share_high
    else:
        mean, sq = (torch.stack([w_sum, w_sq]) / total).unbind()
        log_hi = math.log(hi) if hi != math.inf else math.inf
        log_lo = math.log(lo) if lo > 0 else -math.inf
        per_row = rows.summary(torch.stack([row_log, row_log > log_hi, row_log < log_lo]))
        log_max, log_min = per_row.max[0], per_row.min[0]
        out["rollout_is_max"] = log_max.clamp(max=LOG_RATIO_CLAMP).exp()
        # verl leaves the minimum unclamped (inf for ℓ ≫ 0)
        out["rollout_is_min"] = (log_min if rows.verl else log_min.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).exp()
        out["rollout_is_ratio_fraction_high"], out["rollout_is_ratio_fraction_low"] = per_row.mean[1:].unbind()
    # std / ESS on the applied weights clamped to [0, upper] (verl); thresholded weights already lie there
    out["rollout_is_mean"] = mean
    out["rollout_is_std"] = zero_below_two(torch.addcmul(sq, mean, mean, value=-1.0).clamp_min_(0).sqrt_(),
                                           rows.num_tokens)
    # 1 / mean((w / (mean + 1e-8))²); 0 (not inf) when every weight is 0 (all tokens masked out)
    ess = (mean + 1e-8).square_() / sq
    out["rollout_is_eff_sample_size"] = ess if sq.is_cpu and sq.item() > 0 else torch.where(sq > 0, ess, 0.0)
    row_w, raw_row = rows.row_mean_of_sum(torch.stack([w_row_sum, raw_row_sum])).unbind()
    seq = rows.summary(torch.stack([row_w, (row_w - 1.0).abs_(), raw_row > hi, raw_row < lo]))
    mean_w, _, seq_high, seq_low = seq.mean.unbind()
    out["rollout_is_seq_mean"] = mean_w
    out["rollout_is_seq_std"] = seq.std[0]
    out["rollout_is_seq_max"] = seq.max[0]
    out["rollout_is_seq_min"] = seq.min[0]
    out["rollout_is_seq_max_deviation"] = seq.max[1]
    out["rollout_is_seq_fraction_high"] = seq_high
    out["rollout_is_seq_fraction_low"] = seq_low
    if mode == "mask" and row_log is not None:
        out["rollout_is_oob_ratio"] = oob / total
    return out


# ---- RS ---------------------------------------------------------------------------------------
def rs_option_metrics(r: RSOutcome, tok: Rows) -> Metrics:
    """verl ``compute_rs_metrics`` for one option (verl ``rollout_corr_helper.py``), keys ``rollout_rs_{option}_*``.

    The row statistic's extremes and the shares of rows are each computed once (the sequence level's max /
    min / fraction_high / fraction_low are the same values as its seq_* ones) on stacked (k, B) tensors."""
    p = f"rollout_rs_{r.option}"
    dtype = tok.dtype
    out: Metrics = {}
    is_k1 = r.lower is not None
    lower = r.lower if is_k1 else 0.0
    seq = r.row_stat
    nv = tok.num_rows
    # over valid rows: max, −min and max |·| of the row statistic; mean of it and of the row flags
    extremes = tok.valid_rows(torch.stack([seq, -seq, seq.abs()]), -math.inf)
    seq_max, neg_min, seq_max_dev = extremes.amax(-1)
    seq_min = -neg_min

    def seq_shares(*flags: Tensor) -> tuple[Tensor, ...]:
        """Means over valid rows of seq and of each (B,) flag: (Σ x·valid) / #valid rows (the stack casts the bool
        flags to seq's dtype as 0 / 1, in the one operation)."""
        return (tok.times_valid(torch.stack([seq, *flags])).sum(-1) / nv).unbind()

    if r.token_stat is not None:  # token level
        x = r.token_stat
        out[f"{p}_mean"] = tok.token_mean(x)
        out[f"{p}_max"] = tok.valid_max(x)
        out[f"{p}_min"] = tok.valid_min(x)
        out[f"{p}_fraction_high"] = tok.token_share((x > r.upper) & tok.mask)
        out[f"{p}_fraction_low"] = (
            tok.token_share((x < lower) & tok.mask) if is_k1 else torch.zeros((), dtype=dtype)
        )
        # std of the clamped statistic over valid tokens: c·m, and (c·m)² = c²·m for m ∈ {0, 1}
        cm = x.clamp(min=lower, max=r.upper).mul_(tok.mask_f)
        total = tok.den(tok.num_tokens)
        mean = cm.sum() / total
        std = (cm.square_().sum() / total - mean.square()).clamp_min(0).sqrt()
        rejected = ~r.token_keep & tok.mask
        out[f"{p}_masked_fraction_"] = tok.token_share(rejected)
        row_rejected = any_per_row(rejected)
        shares = seq_shares(seq > r.upper, *((seq < lower,) if is_k1 else ()), row_rejected)
    else:  # sequence level: the row statistic broadcast to its tokens (token-weighted mean / std)
        row_rejected = tok.and_valid(~r.row_keep)
        shares = seq_shares(seq > r.upper, *((seq < lower,) if is_k1 else ()), row_rejected)
        out[f"{p}_max"] = seq_max
        out[f"{p}_min"] = seq_min
        out[f"{p}_fraction_high"] = shares[1]
        out[f"{p}_fraction_low"] = shares[2] if is_k1 else torch.zeros((), dtype=dtype)
        total = tok.den(tok.num_tokens)
        if tok.verl and isinstance(tok, Tokens):  # verl broadcasts the row statistic to (B, T): same rounding
            spread = torch.where(tok.mask, seq[:, None], 0.0)
            out[f"{p}_mean"] = spread.sum() / total
            clamped = torch.where(tok.mask, seq.clamp(min=lower, max=r.upper)[:, None], 0.0)
            mean = clamped.sum() / total
            std = (clamped.square().sum() / total - mean.square()).clamp_min(0).sqrt()
            out[f"{p}_masked_fraction_"] = (row_rejected.to(dtype) * tok.n).sum() / total
        else:  # from the per-row counts (compute_correction in verl mode too: equal to float rounding)
            # Σ seq·n and Σ rejected·n in one reduction; std of the clamped statistic, token-weighted
            seq_sum, rejected_sum = (torch.stack([seq, row_rejected]) * tok.n).sum(-1).unbind()
            out[f"{p}_mean"] = seq_sum / total
            std = _std(seq.clamp(min=lower, max=r.upper), tok.n, total)
            out[f"{p}_masked_fraction_"] = rejected_sum / total
    # 0 below two tokens / rows (the counts are never NaN: this is where(count > 1, x, 0))
    out[f"{p}_std"] = zero_below_two(std, tok.num_tokens)  # std: a fresh tensor
    out[f"{p}_seq_mean"] = shares[0]
    var = tok.times_valid((seq - shares[0]).square()).sum() / at_least_one(nv - 1)  # over valid rows, verl too
    out[f"{p}_seq_std"] = zero_below_two(var.sqrt(), nv)
    out[f"{p}_seq_max"] = seq_max
    out[f"{p}_seq_min"] = seq_min
    out[f"{p}_seq_max_deviation"] = seq_max_dev
    out[f"{p}_seq_fraction_high"] = shares[1]
    if is_k1:
        out[f"{p}_seq_fraction_low"] = shares[2]
    out[f"{p}_masked_fraction"] = out.pop(f"{p}_masked_fraction_")
    out[f"{p}_seq_masked_fraction"] = shares[-1]
    return out


def rs_total_metrics(keep: Tensor, tok: Tokens) -> Metrics:
    """``rollout_rs_masked_fraction`` (tokens) and ``rollout_rs_seq_masked_fraction`` (rows with any valid
    token rejected; over all rows in verl mode, over valid rows otherwise)."""
    rejected = ~keep & tok.mask
    return rs_total_from_counts(_count(rejected, tok.dtype), any_per_row(rejected), tok)


def rs_total_from_counts(rejected_tokens: Tensor, rejected_rows: Tensor, tok: Rows) -> Metrics:
    """``rs_total_metrics`` from the number of rejected valid tokens (0-d) and the (B,) bool rows with a
    rejected valid token."""
    return {
        "rollout_rs_masked_fraction": rejected_tokens / tok.den(tok.num_tokens),
        "rollout_rs_seq_masked_fraction": tok.over_rows(rejected_rows.to(tok.dtype)),
    }


# ---- off-policy (verl compute_offpolicy_metrics) -----------------------------------------------
def offpolicy_metrics(tok: Tokens, k3: Tensor | None = None) -> Metrics:
    """PPL, KL (k1, k3), log-PPL differences and χ² of π_old (or π_θ in bypass) against μ (verl
    ``compute_offpolicy_metrics``). ``k3``: the per-token ρ − 1 − ℓ from the clamped ℓ if already computed
    (verl's k3_kl is unclamped)."""
    if k3 is None:
        k3 = tok.ratio - 1.0 - tok.log_ratio_safe
    lr = tok.log_ratio
    if tok.verl:
        k3 = lr.exp().sub_(lr).sub_(1.0)
    # ρ = 1 on padding: Σ ρ² − #pad is one fused pass; verl mode sums the masked ρ² as verl does, so float32
    # rounding matches too
    if tok.verl:
        rho2 = torch.where(tok.mask, tok.ratio.square(), 0.0).sum()
    else:
        rho2 = _dot(tok.ratio, tok.ratio) - tok.num_pad
    return offpolicy_from_sums(
        tok, old_row=tok.anchor.sum(dim=-1), roll_row=tok.rollout.sum(dim=-1), lr_row=lr.sum(dim=-1),
        lr_sum=lr.sum(), k3_sum=k3.sum(), rho2_sum=rho2,
    )


def offpolicy_from_sums(
    rows: Rows,
    *,
    old_row: Tensor,
    roll_row: Tensor,
    lr_row: Tensor,
    lr_sum: Tensor,
    k3_sum: Tensor,
    rho2_sum: Tensor,
) -> Metrics:
    """``offpolicy_metrics`` from its reductions over valid tokens: (B,) row sums of log π_old, log μ and
    ℓ (unclamped), and the totals Σ ℓ, Σ k3 (clamped ℓ; unclamped in verl mode) and Σ ρ². The per-row values
    are stacked into one (k, B) tensor so each reduction over rows is one operation (small batches: the cost
    is the number of operations)."""
    neg_mean = -rows.row_mean_of_sum(torch.stack([old_row, roll_row]))  # (2, B): −mean log π_old, −mean log μ
    diff = neg_mean[0] - neg_mean[1]  # mean log μ − mean log π_old
    total = rows.den(rows.num_tokens)
    # rollcorr keeps these finite: PPL saturates at e^80, ppl_ratio's exponent is clamped to ±20 like ρ
    ppl_cap, ratio_cap = (math.inf, math.inf) if rows.verl else (PPL_LOG_CAP, LOG_RATIO_CLAMP)
    ppl = neg_mean.clamp(max=ppl_cap).exp()
    ratio = diff.clamp(-ratio_cap, ratio_cap).exp()
    chi2 = (2.0 * lr_row.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).exp()
    per_row = [ppl[0], neg_mean[0], ppl[1], neg_mean[1], diff, diff.abs(), ratio, chi2]
    m = rows.over_rows(torch.stack(per_row)).unbind()
    neg_kl, k3_kl, rho2 = (torch.stack([lr_sum, k3_sum, rho2_sum]) / total).unbind()
    return {
        "training_ppl": m[0],
        "training_log_ppl": m[1],
        "kl": -neg_kl,
        "k3_kl": k3_kl,
        "rollout_ppl": m[2],
        "rollout_log_ppl": m[3],
        "log_ppl_diff": m[4],
        "log_ppl_abs_diff": m[5],
        "log_ppl_diff_max": rows.rows_max(diff),
        "log_ppl_diff_min": rows.rows_min(diff),
        "ppl_ratio": m[6],
        "chi2_token": rho2 - 1.0,
        "chi2_seq": m[7] - 1.0,
    }


# ---- beyond verl -------------------------------------------------------------------------------
@torch.no_grad()  # diagnostics; the in-place / out= buffer reuse needs tensors outside autograd
def divergence_metrics(
    tok: Tokens, k3: Tensor | None = None, *, scratch: tuple[Tensor, Tensor] | None = None
) -> Metrics:
    """Both KL directions, Jensen–Shannon and NeMo-RL's token_mult_prob_error, estimated from the sampled
    tokens (samples from μ, ρ = π_old/μ; every per-token term is ≥ 0 and exactly 0 where ρ = 1):

        gen_kl     KL(μ ‖ π_old)  ≈ mean(ρ − 1 − ℓ)                 (k3; = verl k3_kl, clamped)
        policy_kl  KL(π_old ‖ μ)  ≈ mean(ρ·ℓ − ρ + 1)              (importance-weighted k3)
        js         JS(π_old, μ)   ≈ mean(½[ρ·ℓ − (1 + ρ)·log((1 + ρ)/2)])
        token_mult_prob_error = mean exp(|ℓ|);  log_ratio_mean = mean ℓ;  log_ratio_abs_mean = mean |ℓ|

    ``scratch``: two (B, T) tensors of ℓ's dtype that may be overwritten (else two are allocated).
    """
    lr, rho = tok.log_ratio_safe, tok.ratio
    if k3 is None:
        k3 = (rho - 1.0).sub_(lr)
    # (B, T) buffers are reused in place: a fresh (B, T) allocation costs as much as the arithmetic
    a, b = scratch if scratch is not None else (torch.empty_like(lr), torch.empty_like(lr))
    rho_lr = torch.mul(rho, lr, out=a)
    policy_kl = torch.sub(rho_lr, rho, out=b).add_(1.0).sum()  # ρℓ − ρ + 1 ≥ 0 per token
    # js = ½[ρℓ − (1 + ρ)·(softplus(ℓ) − log 2)]
    js = torch.nn.functional.softplus(lr).sub_(math.log(2.0)).mul_(torch.add(rho, 1.0, out=b))
    js = torch.sub(rho_lr, js, out=js).mul_(0.5).sum()
    e_abs = torch.maximum(rho, torch.reciprocal(rho, out=a), out=a).sub_(1.0).sum()  # e^|ℓ| − 1
    return divergence_from_sums(
        tok, k3_sum=k3.sum(), policy_kl_sum=policy_kl, js_sum=js, e_abs_sum=e_abs,
        lr_sum=tok.log_ratio.sum(), abs_sum=torch.abs(lr, out=b).sum(),
    )


def divergence_from_sums(
    rows: Rows,
    *,
    k3_sum: Tensor,
    policy_kl_sum: Tensor,
    js_sum: Tensor,
    e_abs_sum: Tensor,
    lr_sum: Tensor,
    abs_sum: Tensor,
) -> Metrics:
    """``divergence_metrics`` from the sums over valid tokens of k3, ρℓ − ρ + 1, the JS term, e^|ℓ| − 1,
    ℓ (unclamped) and |ℓ| (clamped)."""
    means = torch.stack([k3_sum, policy_kl_sum, js_sum, e_abs_sum, lr_sum, abs_sum]) / rows.den(rows.num_tokens)
    gen_kl, policy_kl, js, e_abs, lr, lr_abs = means.unbind()
    return {
        "gen_kl": gen_kl,
        "policy_kl": policy_kl,
        "js_divergence": js,
        "token_mult_prob_error": 1.0 + e_abs,
        "log_ratio_mean": lr,
        "log_ratio_abs_mean": lr_abs,
    }


def mismatch_stats(
    p_old: Tensor, p_rollout: Tensor, response_mask: Tensor, *, log_space: bool = True
) -> Metrics:
    """Probability-space mismatch between the learner and the sampler on the sampled tokens.

    ``p_old`` / ``p_rollout``: (B, T) log-probs (``log_space=True``) or probabilities; padding ignored.
    Returns (0-d tensors): ``prob_diff_seq_max_mean`` / ``prob_diff_seq_mean_mean`` (per-response max and
    mean |Δp|, averaged over responses with a valid token: the TIS paper's two metrics), ``prob_diff_mean``
    and ``prob_diff_max`` over tokens, the share of tokens with |Δp| < 1e-3, ≥ 0.01, ≥ 0.05, ≥ 0.1 (the ABEJA
    table), ``prob_pearson`` (Pearson correlation of p_μ and p_old over valid tokens; 1 when both are
    constant and equal, 0 when one is constant and they differ).
    """
    mask = check_mask(response_mask)
    check_tensor("p_old", p_old, tuple(mask.shape))
    check_tensor("p_rollout", p_rollout, tuple(mask.shape))
    dtype = torch.float64 if torch.float64 in (p_old.dtype, p_rollout.dtype) else torch.float32
    m = mask if mask.dtype == torch.bool else mask != 0
    a = torch.where(m, p_old.to(dtype), 0.0)
    b = torch.where(m, p_rollout.to(dtype), 0.0)
    if log_space:
        a, b = a.exp(), b.exp()  # 1 on padding for both
    n = m.sum(dim=-1, dtype=dtype)
    valid, num_tokens = n > 0, n.sum()
    rows = Rows(n=n, valid=valid, num_tokens=num_tokens, num_rows=valid.sum().to(dtype),
                num_pad=m.numel() - num_tokens, verl=False, count_dtype=dtype)
    return _prob_mismatch(a, b, rows, pad=1.0 if log_space else 0.0)


def prob_mismatch(p_old: Tensor, p_rollout: Tensor, tok: Tokens, *, overwrite: bool = False) -> Metrics:
    """``mismatch_stats`` on probabilities already equal on padding (exp of the masked log-probs).
    ``overwrite=True`` lets it store |Δp| in ``p_rollout`` (saves a (B, T) allocation)."""
    return _prob_mismatch(p_old, p_rollout, tok, pad=1.0, overwrite=overwrite)


@torch.no_grad()
def _prob_mismatch(a: Tensor, b: Tensor, rows: Rows, *, pad: float, overwrite: bool = False) -> Metrics:
    """a, b: (B, T) probabilities equal to ``pad`` on padding (so |Δp| = 0 there), ``rows`` their counts;
    ``overwrite``: b may be reused for |Δp|."""
    num_pad = rows.num_pad
    # moments over valid tokens (Σa, Σb, Σa², Σb², Σab), removing the padding's known contribution
    pad_a, pad_aa = pad * num_pad, pad * pad * num_pad
    sa, sb = a.sum() - pad_a, b.sum() - pad_a
    saa, sbb, sab = _dot(a, a) - pad_aa, _dot(b, b) - pad_aa, _dot(a, b) - pad_aa
    d = torch.sub(a, b, out=b if overwrite else None).abs_()
    dtype = a.dtype
    flag = torch.empty(d.shape, dtype=torch.bool, device=d.device)  # one (B, T) bool buffer for the shares
    counts = [_count(torch.ge(d, threshold, out=flag), dtype) for threshold in PROB_SHARES]
    return prob_from_sums(
        rows, p_old_sum=sa, p_rollout_sum=sb, p_old_sq_sum=saa, p_rollout_sq_sum=sbb, p_cross_sum=sab,
        d_row_max=d.amax(dim=-1), d_row_sum=d.sum(dim=-1),
        small_diff_count=_count(torch.lt(d, 1e-3, out=flag), dtype) - num_pad, ge=counts,  # padding has d = 0
    )


PROB_SHARES = (0.01, 0.05, 0.1)  # |Δp| thresholds of the prob_diff_frac_ge_* shares


def prob_from_sums(
    rows: Rows,
    *,
    p_old_sum: Tensor,
    p_rollout_sum: Tensor,
    p_old_sq_sum: Tensor,
    p_rollout_sq_sum: Tensor,
    p_cross_sum: Tensor,
    d_row_max: Tensor,
    d_row_sum: Tensor,
    small_diff_count: Tensor,
    ge: list[Tensor],
) -> Metrics:
    """The probability-mismatch metrics from reductions over valid tokens (``rows``: n (B,), the valid tokens, the
    rows holding one; over those rows in verl mode too), the moments Σa, Σb, Σa², Σb², Σab of a = p_old and
    b = p_μ, the (B,) row max and row sum of d = |a − b| (rows without a valid token: 0), the number of tokens with
    d < 1e-3 (``small_diff_count``) and those with d ≥ each of ``PROB_SHARES``."""
    count = at_least_one(rows.num_tokens)
    # Pearson over valid tokens from raw moments, in float64 (one cast): N·cov = Σab − ΣaΣb/N, N·var likewise
    moments = torch.stack([p_old_sum, p_rollout_sum, p_old_sq_sum, p_rollout_sq_sum, p_cross_sum, count])
    sa, sb, saa, sbb, sab, cnt = moments.to(torch.float64).unbind()
    var_ab = torch.stack([saa - sa * sa / cnt, sbb - sb * sb / cnt]).clamp_min_(0)
    denom = var_ab.prod().sqrt_()
    d_max = d_row_max.max()  # |Δp| ≥ 0 and 0 on padding
    # variance below rounding noise of the moment sums (1e-12 N) counts as constant: 1 if Δp is 0 everywhere
    correlation = (sab - sa * sb / cnt) / denom
    if denom.is_cpu:  # CPU values read as they are: the branch ``where`` would take, the same value
        pearson = correlation if denom.item() > 1e-12 * cnt.item() else (d_max == 0).to(torch.float64)
    else:
        pearson = torch.where(denom > 1e-12 * cnt, correlation, d_max == 0)
    # per-row means over rows with a valid token: max |Δp| and mean |Δp| of each row, stacked (2, B)
    n_clamped = rows.n.clamp_min(1) if rows.verl else rows.n_den  # the batch's cached n.clamp_min(1)
    per_row = rows.valid_rows(torch.stack([d_row_max, d_row_sum / n_clamped]), 0.0)
    seq_max_mean, seq_mean_mean = (per_row.sum(-1) / at_least_one(rows.num_rows)).unbind()
    shares = (torch.stack([d_row_sum.sum(), small_diff_count, *ge]) / count).unbind()
    out = {
        "prob_diff_seq_max_mean": seq_max_mean,
        "prob_diff_seq_mean_mean": seq_mean_mean,
        "prob_diff_mean": shares[0],
        "prob_diff_max": d_max,
        "prob_diff_frac_lt_1e-3": shares[1],
    }
    for threshold, c in zip(PROB_SHARES, shares[2:]):
        out[f"prob_diff_frac_ge_{threshold}"] = c
    out["prob_pearson"] = pearson.clamp_(-1.0, 1.0).to(d_row_max.dtype)
    return out


def diagnostics_from_sums(row: dict[str, Tensor], total: dict[str, Tensor], rows: Rows) -> Metrics:
    """The off-policy, divergence and probability-mismatch metrics from the statistics' reductions
    (statistics.py): per row ``old``, ``rollout``, ``lr``, ``d_sum``, ``d_max``; the batch totals of the rest."""
    lr_sum = row["lr"].sum()
    out = {
        **offpolicy_from_sums(
            rows, old_row=row["old"], roll_row=row["rollout"], lr_row=row["lr"], lr_sum=lr_sum,
            k3_sum=total["k3_unclamped"] if rows.verl else total["sum_k3"], rho2_sum=total["rho2"],
        ),
        **divergence_from_sums(
            rows, k3_sum=total["sum_k3"], policy_kl_sum=total["policy_kl"], js_sum=total["js"],
            e_abs_sum=total["e_abs"], lr_sum=lr_sum, abs_sum=total["abs"],
        ),
        **prob_from_sums(
            rows, p_old_sum=total["p_old_sum"], p_rollout_sum=total["p_rollout_sum"],
            p_old_sq_sum=total["p_old_sq_sum"], p_rollout_sq_sum=total["p_rollout_sq_sum"],
            p_cross_sum=total["p_cross_sum"], d_row_max=row["d_max"], d_row_sum=row["d_sum"],
            small_diff_count=total["small_diff_count"], ge=[total[f"ge{i}"] for i in range(len(PROB_SHARES))],
        ),
    }
    return out


def decomposition_from_sums(total: dict[str, Tensor], rows: Rows) -> Metrics:
    """``decomposition_metrics`` from the sums over valid tokens of the three k3 terms (statistics.py)."""
    names = ("discrepancy_k3", "drift_k3", "total_k3")
    return dict(zip(names, (torch.stack([total[k] for k in names]) / rows.den(rows.num_tokens)).unbind()))


def staleness_metrics(version: Tensor, current_version: int | Tensor, mask: Tensor, rows: Rows) -> Metrics:
    """Per-token version lag (current − version that produced the token): mean and max over valid tokens.
    mask: (B, T) bool, valid tokens; rows: their counts."""
    lag = (torch.as_tensor(current_version, device=version.device) - version).to(rows.dtype)
    lag = torch.where(mask, lag, 0.0)
    return {
        "staleness_mean": lag.sum() / rows.den(rows.num_tokens),
        "staleness_max": lag.masked_fill(~mask, float("-inf")).max(),
    }


def decomposition_metrics(
    log_prob: Tensor, anchor: Tensor, rollout: Tensor, mask: Tensor, rows: Rows
) -> Metrics:
    """docs/spec.md §1 split of π_θ/μ into discrepancy π_old/μ and drift π_θ/π_old: k3 (e^x − 1 − x, mean
    over valid tokens, x clamped to ±20) of each log-ratio and of the total. anchor / rollout: log π_old and
    log μ already 0 on padding; mask: (B, T) bool."""
    theta = torch.where(mask, log_prob.to(anchor.dtype), 0.0)

    def k3(x: Tensor) -> Tensor:
        x = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.expm1(x).sub_(x).sum() / rows.den(rows.num_tokens)

    return {
        "discrepancy_k3": k3(anchor - rollout),
        "drift_k3": k3(theta - anchor),
        "total_k3": k3(theta - rollout),
    }


def metrics_to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Python floats for logging. Values on the CPU are read one by one (``item``: a CPU read waits for nothing,
    and 65 reads cost less than stacking 65 tensors); elsewhere one device sync for the whole dict (the 0-d
    tensors stacked per dtype, cast to float64 together, read at once; a one-element tensor of another shape is
    reshaped to 0-d first). Either way each float is the value's exact float64."""
    floats = {}
    for key, value in metrics.items():  # one walk: a CPU value is read as met (~0.3 us), others at once
        if not isinstance(value, Tensor):
            floats[key] = float(value)
        elif value.is_cpu:
            floats[key] = float(value.item())
        else:
            return _read_at_once(metrics)
    return floats


def _read_at_once(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """``metrics_to_floats`` with one device sync: the tensors stacked per dtype, cast to float64, read together."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, value in metrics.items():
        if isinstance(value, Tensor):
            by_dtype.setdefault(value.dtype, []).append(key)
    with torch.no_grad():  # the stack of tensors that require grad is not recorded (as with detach)
        parts = [torch.stack([v if v.dim() == 0 else v.reshape(()) for v in (metrics[k] for k in keys)])
                 for keys in by_dtype.values()]
        flat = torch.cat([p.to(torch.float64) for p in parts]) if parts else None
    names = (k for keys in by_dtype.values() for k in keys)
    read = dict(zip(names, flat.tolist() if flat is not None else []))
    return {k: read[k] if k in read else float(v) for k, v in metrics.items()}
