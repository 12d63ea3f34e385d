"""Trust-region losses without the PPO clip: DPPO (a mask on Δp or on the binary KL) and SAPO (a smooth gate).

dppo_tv      L = −A · r̃ · keep,  keep = ¬[(A>0 ∧ p_θ−p_old > ε_hi) ∨ (A≤0 ∧ p_θ−p_old < −ε_lo)]
             (+ kl_coef · Δ²); r̃ = r, or sg(min(r, c))·exp(Δ − sg(Δ)) with the cap c = clip_c (verl)
dppo_kl      dppo_tv with keep from the binary KL of (p_old, p_θ) (verl `dppo_kl`)
sapo         L = −A · (4/τ)·σ(τ(r − 1)) · w,   τ = τ_pos if A > 0 else τ_neg
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rollcorr.losses.common import clamped_ratio, detached, masked_mean
from rollcorr.losses.registry import LossSpec, VerlCall, VerlResult, register_loss


def _dppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    keep: Tensor,
    high: Tensor,
    low: Tensor,
    *,
    cap: float | None,
    kl_coef: float,
    weights: Tensor | None,
    verl_value: bool,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Shared tail of the DPPO losses once the trust-region mask ``keep`` (B, T) bool is known."""
    delta, ratio = clamped_ratio(log_prob, old_log_prob)
    keep_f = keep.to(ratio.dtype)
    if cap is None and not verl_value:
        loss = -advantages * ratio * keep_f  # prime-rl's value; ∇ = −A·r·∇log π_θ
    else:
        truncated = ratio.detach() if cap is None else ratio.detach().clamp(max=cap)
        # verl: −A·sg(min(r, c))·log π_θ; otherwise the same gradient with the value −A·min(r, c)
        surrogate = log_prob if verl_value else torch.exp(delta - delta.detach())
        loss = -advantages * truncated * surrogate * keep_f
    if weights is not None:
        loss = loss * weights.detach()
    if kl_coef:
        loss = loss + kl_coef * delta**2
    dtype = delta.dtype
    capped = keep & (ratio > cap) if cap is not None else torch.zeros_like(keep)
    metrics = {
        "actor/pg_clipfrac": masked_mean((~keep).to(dtype), kept_mask),
        "actor/ppo_kl": masked_mean(-delta, kept_mask),
        "actor/pg_clipfrac_lower": masked_mean(capped.to(dtype), kept_mask),
        "actor/dppo_masked_fraction": masked_mean((~keep).to(dtype), kept_mask),
        "actor/dppo_masked_high": masked_mean(high.to(dtype), kept_mask),
        "actor/dppo_masked_low": masked_mean(low.to(dtype), kept_mask),
    }
    return loss, detached(metrics)


def dppo_tv_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    cap: float | None = None,
    kl_coef: float = 0.0,
    weights: Tensor | None = None,
    verl_value: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (prime-rl default loss, verl `dppo_tv`): trust region on Δp = p_θ − p_old, p = exp(log-prob)
    of the sampled token. (B, T) loss and metrics.

    keep = ¬[(A>0 ∧ Δp > ε_hi) ∨ (A≤0 ∧ Δp < −ε_lo)]
    cap None:  L = −A·r·keep·w (+ kl_coef·Δ²)                       (prime-rl; ∇ = −A·r·∇log π_θ)
    cap c:     L = −A·sg(min(r, c))·exp(Δ − sg(Δ))·keep·w (+ …)    (∇ = −A·min(r, c)·∇log π_θ, verl's TIS cap)
    verl_value: L = −A·sg(min(r, c))·log π_θ·keep·w — verl's value (same gradient); used by the verl compat.
    Metrics as verl: pg_clipfrac = share outside the region, pg_clipfrac_lower = share kept with r > c.
    """
    with torch.no_grad():
        dp = torch.exp(log_prob) - torch.exp(old_log_prob)
        high = (advantages > 0) & (dp > clip_high)
        low = (advantages <= 0) & (dp < -clip_low)
        keep = ~(high | low)
    return _dppo_loss(
        log_prob, old_log_prob, advantages, kept_mask, keep, high, low,
        cap=cap, kl_coef=kl_coef, weights=weights, verl_value=verl_value,
    )


def dppo_kl_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    cap: float | None = None,
    kl_coef: float = 0.0,
    weights: Tensor | None = None,
    verl_value: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (verl `dppo_kl`): `dppo_tv` with the trust region measured by the KL between the
    Bernoulli distributions (p_old, 1 − p_old) and (p_θ, 1 − p_θ) of the sampled token:

    D = p_old·(log p_old − log p_θ) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p_θ + 1e-8))
    keep = (A>0 ∧ (D ≤ ε_hi ∨ p_θ ≤ p_old)) ∨ (A≤0 ∧ (D ≤ ε_lo ∨ p_θ ≥ p_old))
    Loss, cap and metrics exactly as `dppo_tv_loss`. ε are KL thresholds (verl default 0.2; SkyRL
    recommends 0.05).
    """
    with torch.no_grad():
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        div = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        high = (advantages > 0) & (div > clip_high) & (prob > old_prob)
        low = (advantages <= 0) & (div > clip_low) & (prob < old_prob)
        keep = ~(high | low)
    return _dppo_loss(
        log_prob, old_log_prob, advantages, kept_mask, keep, high, low,
        cap=cap, kl_coef=kl_coef, weights=weights, verl_value=verl_value,
    )


def sapo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    kept_mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (arXiv 2511.20347, verl `sapo`): a smooth gate instead of the PPO clip. (B, T) loss and metrics.

    f(r, τ) = σ(τ·(r − 1))·4/τ,  τ = τ_pos if A > 0 else τ_neg;   L = −f(r, τ)·A·w
    ∇L = −A·4·σ'(τ(r − 1))·r·∇log π_θ: 1× the PPO gradient at r = 1, decaying smoothly away from it.
    verl aggregates with seq-mean-token-mean whatever loss_agg_mode says (rollcorr's default agg for sapo).
    """
    delta, ratio = clamped_ratio(log_prob, old_log_prob)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * advantages
    if weights is not None:
        loss = loss * weights.detach()
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    metrics = {
        "actor/pg_clipfrac": zero,
        "actor/ppo_kl": masked_mean(-delta, kept_mask),
        "actor/pg_clipfrac_lower": zero,
    }
    return loss, detached(metrics)


# ---- the catalogue entries (rollcorr.losses.registry) ------------------------------------------------
# dppo_tv: prime-rl's DefaultLossConfig (dppo_mask_low/high = 0.2, thresholds on Δp); dppo_kl: verl's
# ActorConfig (ε are binary-KL thresholds); sapo: verl's, aggregated seq-mean-token-mean (ε unused).
_VERL_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def _dppo_as_verl(fn) -> Callable:
    def call(v: VerlCall) -> VerlResult:
        """verl's dppo: its value −A·sg(min(r, clip_ratio_c))·log π_θ·keep, verl's three metrics."""
        loss, metrics = fn(v.log_prob, v.old_log_prob, v.advantages, v.response_mask, clip_low=v.clip_low,
                           clip_high=v.clip_high, cap=v.clip_c, verl_value=True, weights=v.weights)
        return loss, {k: x for k, x in metrics.items() if k in _VERL_METRICS}, None, "kept"

    return call


def _sapo_as_verl(v: VerlCall) -> VerlResult:
    """verl's ``sapo``: seq-mean-token-mean whatever ``loss_agg_mode``."""
    loss, metrics = sapo_loss(v.log_prob, v.old_log_prob, v.advantages, v.response_mask, tau_pos=v.options["tau_pos"],
                              tau_neg=v.options["tau_neg"], weights=v.weights)
    return loss, metrics, "seq-mean-token-mean", "kept"


for _name, _fn in (("dppo_tv", dppo_tv_loss), ("dppo_kl", dppo_kl_loss)):
    register_loss(LossSpec(
        _name,
        lambda i, c, fn=_fn: fn(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, clip_low=c.eps_low,
                                clip_high=c.eps_high, cap=c.clip_c, kl_coef=c.dppo_kl_coef,
                                weights=i.weights),
        options={"dppo_kl_coef": 0.0}, verl_name=_name, verl_loss=_dppo_as_verl(_fn),
        clip_low_at_most=None if _name == "dppo_kl" else 1.0,  # dppo_kl: ε are binary-KL thresholds
    ))
register_loss(LossSpec(
    "sapo",
    lambda i, c: sapo_loss(i.log_prob, i.old_log_prob, i.advantages, i.kept_mask, tau_pos=c.sapo_tau_pos,
                           tau_neg=c.sapo_tau_neg, weights=i.weights),
    clip_low=0.0, clip_high=0.0, agg="seq-mean-token-mean",
    options={"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}, verl_name="sapo", verl_loss=_sapo_as_verl,
))
