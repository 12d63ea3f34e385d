"""Policy losses and loss aggregation (docs/spec.md §5, denominator policy of §3).

Notation (docs/spec.md §1): `log_prob` = log π_θ (with gradient), `old_log_prob` = log π_old, `rollout_log_prob` =
log μ. Per token, Δ = log π_θ − log π_old and the PPO ratio r = exp(clamp(Δ, ±20)); the discrepancy ratio
ρ = exp(clamp(log π_old − log μ, ±20)) is never differentiated. All tensors are (B, T) right-padded;
`response_mask` is the mask *after* rejection (kept tokens) and `denominator_mask` the mask *before*
rejection (valid tokens), used only by the `original` and `batch` denominators.

Each loss is a pure function returning a per-token loss matrix (B, T) — or per-sequence (B,) for GMPO and
OAPL — plus detached scalar metrics; `aggregate` reduces it; `policy_loss(LossConfig, ...)` does both.

  ppo_clip     L = max(−A·r, −A·clip(r, 1−ε_lo, 1+ε_hi)); dual clip (A<0): min(L, −A·c); times w
               (decoupled PPO = ppo_clip with w from the correction; bypass = ppo_clip with π_old := μ)
  ppo_is       ppo_clip with r = π_θ/μ, no w
  vanilla_is   ppo_clip · ρ                  tis   ppo_clip · clamp(ρ, floor, cap)
  areal        ppo_clip · ρ·1[ρ ≤ cap]       (token kept in the denominator)
  reinforce    L = −A · sg(w) · log π_θ
  cispo        L = −sg(clip(r, 1−ε_lo, 1+ε_hi)) · A · log π_θ · w
  gspo         r_t = exp(log π_θ − sg(log π_θ) + sg(mean_t Δ)), then PPO clip; times w
  gmpo         Δ' = sgn(A)·min(sgn(A)·Δ, sgn(A)·clamp(Δ, −ε_lo, ε_hi)); L_b = −mean_t A · exp(mean_t Δ')
  dppo_tv      L = −A · r̃ · keep,  keep = ¬[(A>0 ∧ p_θ−p_old > ε_hi) ∨ (A≤0 ∧ p_θ−p_old < −ε_lo)]
               (+ kl_coef · Δ²); r̃ = r, or sg(min(r, c))·exp(Δ − sg(Δ)) with the cap c = clip_c (verl)
  dppo_kl      dppo_tv with keep from the binary KL of (p_old, p_θ) (verl `dppo_kl`)
  sapo         L = −A · (4/τ)·σ(τ(r − 1)) · w,   τ = τ_pos if A > 0 else τ_neg
  gpg          L = −A · log π_θ · w            (verl `gpg`; = reinforce without its metric)
  clip_cov     PPO clip (no dual clip) with the loss of a few random high-covariance tokens zeroed; · w
  kl_cov       L = −A·r · w, + ppo_kl_coef·|Δ| on the top-k tokens by covariance
  dro          L = −(A · log π_θ − ½β·Δ²) · w
  oapl         ℓ_b = (β · Σ_t (log π_θ − log μ) − (r_b − V̂(x)))²
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rollcorr.advantages import oapl_value
from rollcorr.correction.ratios import check_binary_mask

__all__ = [
    "AGG_MODES",
    "DENOMINATORS",
    "LOSS_NAMES",
    "LossConfig",
    "aggregate",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "gmpo_loss",
    "gspo_loss",
    "kl_cov_loss",
    "masked_mean",
    "oapl_loss",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "sapo_loss",
]

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
DENOMINATORS = ("kept", "original", "batch")
LOSS_NAMES = (
    "ppo_clip",
    "ppo_is",
    "vanilla_is",
    "tis",
    "areal",
    "reinforce",
    "cispo",
    "gspo",
    "gmpo",
    "dppo_tv",
    "dppo_kl",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "dro",
    "oapl",
)
LOG_RATIO_CLAMP = 20.0

# Per-loss defaults: (ε_lo, ε_hi, aggregation). Sources: PPO / DAPO 0.2; GSPO paper 3e-4 / 4e-4 with
# seq-mean-token-mean; GMPO paper ε = 0.4 (log space); CISPO as AReaL recommends (ε_lo = 1 → no lower bound,
# ε_hi = 4); dppo_tv as prime-rl's DefaultLossConfig (dppo_mask_low/high = 0.2, thresholds on Δp); the verl
# losses sapo / gpg / clip_cov / kl_cov / dppo_kl / dro as verl's ActorConfig (clip_ratio 0.2, token-mean; sapo
# forced to seq-mean-token-mean; dppo_kl's ε are binary-KL thresholds). ε is unused by sapo, gpg, kl_cov, dro.
_DEFAULTS: dict[str, tuple[float, float, str]] = {
    "ppo_clip": (0.2, 0.2, "token-mean"),
    "ppo_is": (0.2, 0.2, "token-mean"),
    "vanilla_is": (0.2, 0.2, "token-mean"),
    "tis": (0.2, 0.2, "token-mean"),
    "areal": (0.2, 0.2, "token-mean"),
    "reinforce": (0.0, 0.0, "token-mean"),
    "cispo": (1.0, 4.0, "token-mean"),
    "gspo": (3e-4, 4e-4, "seq-mean-token-mean"),
    "gmpo": (0.4, 0.4, "token-mean"),
    "dppo_tv": (0.2, 0.2, "token-mean"),
    "dppo_kl": (0.2, 0.2, "token-mean"),
    "sapo": (0.0, 0.0, "seq-mean-token-mean"),
    "gpg": (0.0, 0.0, "token-mean"),
    "clip_cov": (0.2, 0.2, "token-mean"),
    "kl_cov": (0.0, 0.0, "token-mean"),
    "dro": (0.0, 0.0, "token-mean"),
    "oapl": (0.0, 0.0, "token-mean"),
}


@dataclass(frozen=True)
class LossConfig:
    """Which policy loss, its hyper-parameters and how it is aggregated. Validated when built.

    clip_low / clip_high / agg default (None) to the loss's own defaults (see `_DEFAULTS`). gmpo and oapl
    are per-sequence losses: `agg` is ignored for them (sequence mean under the denominator policy).
    `denominator`: `kept` (mean over kept tokens), `original` (pre-rejection counts) or `batch` (every
    sequence of the batch counts, TRM). `norm_constant` divides `seq-mean-token-sum-norm` (None → T).
    """

    name: str = "ppo_clip"
    clip_low: float | None = None
    clip_high: float | None = None
    clip_c: float | None = None  # dual clip for A < 0; dppo_tv / dppo_kl: cap on sg(r); None = off (verl 3.0)
    agg: str | None = None
    denominator: str = "kept"
    norm_constant: float | None = None
    tis_cap: float = 2.0  # tis: w = min(ρ, cap)
    tis_floor: float | None = None  # tis: optional lower bound w = max(w, floor)
    areal_cap: float = 5.0  # areal: w = 0 where ρ > cap
    dppo_kl_coef: float = 0.0  # dppo_tv / dppo_kl: + coef · (log r)² on every valid token (prime-rl kl_tau)
    sapo_tau_pos: float = 1.0  # sapo: gate temperature for A > 0 (verl tau_pos)
    sapo_tau_neg: float = 1.05  # sapo: gate temperature for A ≤ 0 (verl tau_neg)
    clip_cov_ratio: float = 2e-4  # clip_cov: share of tokens whose loss is zeroed (at least one)
    clip_cov_lb: float = 1.0  # clip_cov: candidates have lb < cov < ub
    clip_cov_ub: float = 5.0
    clip_cov_seed: int | None = None  # clip_cov: seed of the token draw when no generator is passed
    kl_cov_ratio: float = 2e-4  # kl_cov: share of tokens (top covariance, at least one) given the KL term
    kl_cov_coef: float = 0.1  # kl_cov: coefficient of |Δ| (verl policy_loss.ppo_kl_coef)
    dro_beta: float = 0.1  # dro: β of the quadratic penalty ½β·Δ²
    oapl_beta: float = 1e-3  # OAPL β (compose-rl default)
    oapl_beta1: float | None = None  # OAPL β₁ of the soft value; None → β; inf → plain group mean
    check_inputs: bool = True  # NaN / mask checks (one host sync); turn off in tight loops

    def __post_init__(self) -> None:
        if self.name not in LOSS_NAMES:
            raise ValueError(f"LossConfig.name: unknown loss {self.name!r}; choose one of {LOSS_NAMES}")
        if self.agg is not None and self.agg not in AGG_MODES:
            raise ValueError(f"LossConfig.agg: unknown aggregation {self.agg!r}; choose one of {AGG_MODES}")
        if self.denominator not in DENOMINATORS:
            raise ValueError(
                f"LossConfig.denominator: unknown {self.denominator!r}; choose one of {DENOMINATORS}"
            )
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LossConfig.{name} must be a finite number >= 0, got {value}")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ValueError(f"LossConfig.clip_c (dual clip / dppo ratio cap) must be > 1, got {self.clip_c}")
        if self.norm_constant is not None and not self.norm_constant > 0:
            raise ValueError(f"LossConfig.norm_constant must be > 0, got {self.norm_constant}")
        if not self.tis_cap > 0:
            raise ValueError(f"LossConfig.tis_cap must be > 0, got {self.tis_cap}")
        if self.tis_floor is not None and not 0 <= self.tis_floor <= self.tis_cap:
            raise ValueError(f"LossConfig.tis_floor must be in [0, tis_cap], got {self.tis_floor}")
        if not self.areal_cap > 0:
            raise ValueError(f"LossConfig.areal_cap must be > 0, got {self.areal_cap}")
        if not self.dppo_kl_coef >= 0:
            raise ValueError(f"LossConfig.dppo_kl_coef must be >= 0, got {self.dppo_kl_coef}")
        for name in ("sapo_tau_pos", "sapo_tau_neg", "dro_beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"LossConfig.{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.kl_cov_coef) and self.kl_cov_coef >= 0):
            raise ValueError(f"LossConfig.kl_cov_coef must be a finite number >= 0, got {self.kl_cov_coef}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"LossConfig.{name} must be in (0, 1], got {value}")
        if not (math.isfinite(self.clip_cov_lb) and math.isfinite(self.clip_cov_ub)) or not (
            self.clip_cov_lb < self.clip_cov_ub
        ):
            raise ValueError(
                "LossConfig.clip_cov_lb and LossConfig.clip_cov_ub must be finite with clip_cov_lb < "
                f"clip_cov_ub, got {self.clip_cov_lb} and {self.clip_cov_ub}"
            )
        if self.clip_cov_seed is not None and (
            isinstance(self.clip_cov_seed, bool) or not isinstance(self.clip_cov_seed, int)
        ):
            raise ValueError(f"LossConfig.clip_cov_seed must be an int or None, got {self.clip_cov_seed!r}")
        if not self.oapl_beta > 0:
            raise ValueError(f"LossConfig.oapl_beta must be > 0, got {self.oapl_beta}")
        if self.oapl_beta1 is not None and not self.oapl_beta1 > 0:
            raise ValueError(f"LossConfig.oapl_beta1 must be > 0, got {self.oapl_beta1}")

    @property
    def eps_low(self) -> float:
        return _DEFAULTS[self.name][0] if self.clip_low is None else self.clip_low

    @property
    def eps_high(self) -> float:
        return _DEFAULTS[self.name][1] if self.clip_high is None else self.clip_high

    @property
    def agg_mode(self) -> str:
        return _DEFAULTS[self.name][2] if self.agg is None else self.agg

    @classmethod
    def from_dict(cls, values: dict) -> LossConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"LossConfig: unknown field(s) {sorted(unknown)}")
        return cls(**values)


# ----------------------------------------------------------------------------------------------- helpers


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ values·mask / max(Σ mask, 1); 0 for an empty mask. Scalar."""
    mask = mask.to(values.dtype)
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum() / mask.sum().clamp_min(1)


def _ratio(log_prob: Tensor, ref_log_prob: Tensor) -> tuple[Tensor, Tensor]:
    """(Δ = clamp(log π − log ref, ±20), exp(Δ))."""
    delta = torch.clamp(log_prob - ref_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return delta, torch.exp(delta)


def _detached(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------- aggregation


def aggregate(
    loss: Tensor,
    response_mask: Tensor,
    agg: str = "token-mean",
    *,
    denominator: str = "kept",
    denominator_mask: Tensor | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) — or a per-sequence loss (B,) — to a scalar.

    m = response_mask (kept tokens), m0 = denominator_mask (tokens before rejection; default m).
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
    Masked positions never reach the sum (torch.where), so padding NaN/inf cannot leak; a zero count
    gives exactly 0 with zero gradient.
    """
    if denominator not in DENOMINATORS:
        raise ValueError(f"unknown denominator {denominator!r}; choose one of {DENOMINATORS}")
    if agg not in AGG_MODES:
        raise ValueError(f"unknown aggregation {agg!r}; choose one of {AGG_MODES}")
    m = response_mask.bool()
    m0 = m if denominator_mask is None or denominator == "kept" else denominator_mask.bool()
    dtype = loss.dtype
    seq_count = {
        "kept": (m.sum(-1) > 0).sum(),
        "original": (m0.sum(-1) > 0).sum(),
        "batch": torch.tensor(m.shape[0], device=m.device),
    }[denominator].to(dtype)
    if loss.dim() == 1:
        rows = torch.where(m.any(-1), loss, torch.zeros_like(loss))
        return rows.sum() / seq_count.clamp_min(1)
    row_sum = torch.where(m, loss, torch.zeros_like(loss)).sum(-1)
    if agg == "token-sum":
        return row_sum.sum()
    if agg == "token-mean":
        return row_sum.sum() / m0.sum().to(dtype).clamp_min(1)
    if agg == "seq-mean-token-mean":
        row_sum = row_sum / m0.sum(-1).to(dtype).clamp_min(1)
    total = row_sum.sum() / seq_count.clamp_min(1)
    if agg == "seq-mean-token-sum-norm":
        total = total / (loss.shape[-1] if norm_constant is None else norm_constant)
    return total


# ----------------------------------------------------------------------------------------------- token losses


def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip (+ dual clip), times detached weights w. Returns per-token loss (B, T) and metrics.

    L1 = −A·r, L2 = −A·clip(r, 1−ε_lo, 1+ε_hi), L = max(L1, L2); for A<0 and c given: min(L, −A·c).
    """
    delta, ratio = _ratio(log_prob, old_log_prob)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss = clipped
    lower = torch.zeros_like(clipped, dtype=torch.bool)
    if clip_c is not None:
        loss3 = -advantages * clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss3, clipped), clipped)
        lower = (clipped > loss3) & (advantages < 0)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss2 > loss1).to(delta.dtype), response_mask),
        "actor/ppo_kl": masked_mean(-delta, response_mask),
        "actor/pg_clipfrac_lower": masked_mean(lower.to(delta.dtype), response_mask),
    }
    return loss, _detached(metrics)


def reinforce_loss(
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    weights: Tensor | None = None,
    ref_log_prob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE with detached weights: L = −A·sg(w)·log π_θ (B, T). ∇L = −A·w·∇log π_θ.

    `ref_log_prob` (μ in bypass) only feeds the `actor/ppo_kl` metric = mean(log ref − log π_θ).
    """
    loss = -advantages * log_prob
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {}
    if ref_log_prob is not None:
        metrics["actor/ppo_kl"] = masked_mean(ref_log_prob - log_prob, response_mask)
    return loss, _detached(metrics)


def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): L = −sg(clip(r, 1−ε_lo, 1+ε_hi))·A·log π_θ·w. Every token keeps a gradient."""
    delta, ratio = _ratio(log_prob, old_log_prob)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = -clipped.detach() * advantages * log_prob
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio != clipped).to(delta.dtype), response_mask),
        "actor/ppo_kl": masked_mean(-delta, response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), dtype=delta.dtype, device=delta.device),
    }
    return loss, _detached(metrics)


def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO token form. s_b = Σ_t m·Δ / max(Σ_t m, 1); log r_t = log π_θ − sg(log π_θ) + sg(s_b), ≤ 10.

    Forward value r_t = exp(s_b) (sequence ratio, geometric mean); gradient flows per token. PPO clip, no
    dual clip, times w. Aggregate with seq-mean-token-mean (GSPO's definition).
    """
    mask = response_mask.to(log_prob.dtype)
    delta = log_prob - old_log_prob
    seq_log_ratio = (torch.where(mask > 0, delta, torch.zeros_like(delta))).sum(-1) / mask.sum(-1).clamp_min(
        1
    )
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss1, loss2)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss2 > loss1).to(delta.dtype), response_mask),
        "actor/ppo_kl": masked_mean(-delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), dtype=delta.dtype, device=delta.device),
    }
    return loss, _detached(metrics)


def gmpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    weights: Tensor | None = None,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (verl `geo_mean`). Returns a per-sequence loss (B,) and metrics.

    Δ' = sgn(A)·min(sgn(A)·Δ, sgn(A)·clamp(Δ, −ε_lo, ε_hi))   (one-sided clip in log space)
    L_b = −(Σ m·A / n_b) · exp(Σ m·Δ' / n_b) · exp(Σ m·log(w + 1e-10) / n_b),   n_b = Σ m + 1e-8
    Δ is clamped to ±``log_ratio_clamp`` first (verl: None, unclamped), so extreme log-ratios stay finite.
    """
    mask = response_mask.to(log_prob.dtype)
    delta = log_prob - old_log_prob
    if log_ratio_clamp is not None:
        delta = torch.clamp(delta, -log_ratio_clamp, log_ratio_clamp)
    sign = torch.sign(advantages)
    delta_clamped = torch.clamp(delta, -clip_low, clip_high)
    delta_min = sign * torch.minimum(sign * delta, sign * delta_clamped)
    count = response_mask.sum(-1)  # verl adds its 1e-8 in the mask's sum dtype (float32 for bool/int)
    count = count if count.is_floating_point() else count.to(torch.get_default_dtype())
    n = (count + 1e-8).to(delta.dtype)
    zeros = torch.zeros_like(delta)
    ratio = torch.exp(torch.where(mask > 0, delta_min, zeros).sum(-1) / n)
    adv = torch.where(mask > 0, advantages, zeros).sum(-1) / n
    loss = -adv * ratio
    if weights is not None:
        log_w = torch.log(weights.detach() + 1e-10)
        loss = loss * torch.exp(torch.where(mask > 0, log_w, zeros).sum(-1) / n)
    clipped = (delta != delta_clamped).to(delta.dtype)
    metrics = {
        "actor/pg_clipfrac": masked_mean(clipped * (advantages > 0), response_mask),
        "actor/ppo_kl": masked_mean(-delta, response_mask),
        "actor/pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), response_mask),
    }
    return loss, _detached(metrics)


def _dppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
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
    delta, ratio = _ratio(log_prob, old_log_prob)
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
        "actor/pg_clipfrac": masked_mean((~keep).to(dtype), response_mask),
        "actor/ppo_kl": masked_mean(-delta, response_mask),
        "actor/pg_clipfrac_lower": masked_mean(capped.to(dtype), response_mask),
        "actor/dppo_masked_fraction": masked_mean((~keep).to(dtype), response_mask),
        "actor/dppo_masked_high": masked_mean(high.to(dtype), response_mask),
        "actor/dppo_masked_low": masked_mean(low.to(dtype), response_mask),
    }
    return loss, _detached(metrics)


def dppo_tv_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
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
        log_prob, old_log_prob, advantages, response_mask, keep, high, low,
        cap=cap, kl_coef=kl_coef, weights=weights, verl_value=verl_value,
    )  # fmt: skip


def dppo_kl_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
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
        log_prob, old_log_prob, advantages, response_mask, keep, high, low,
        cap=cap, kl_coef=kl_coef, weights=weights, verl_value=verl_value,
    )  # fmt: skip


def sapo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
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
    delta, ratio = _ratio(log_prob, old_log_prob)
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
        "actor/ppo_kl": masked_mean(-delta, response_mask),
        "actor/pg_clipfrac_lower": zero,
    }
    return loss, _detached(metrics)


def _smallest_k(keys: Tensor, k: Tensor) -> Tensor:
    """(B, T) bool: the ``k`` (0-d integer tensor) positions with the smallest keys; no host sync."""
    flat = keys.flatten()
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(flat.numel(), device=flat.device)
    return (rank < k).view_as(keys)


def _covariance(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """cov_t = (A_t − mean A)·(log π_θ,t − mean log π_θ), means over valid tokens; detached (B, T)."""
    lp = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))


def _count_share(mask: Tensor, share: float) -> Tensor:
    """max(⌊share · Σ m⌋, 1) as a 0-d int64 tensor (float64 product, as Python's int(share · n))."""
    n = mask.sum().to(torch.float64)
    return torch.floor(n * share).clamp_min(1).to(torch.int64)


def clip_cov_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl `clip_cov`).

    L_t = max(−A·r, −A·clip(r, 1−ε_lo, 1+ε_hi))·corr_t·w     (no dual clip)
    corr_t = 0 for k = max(⌊ratio·N⌋, 1) tokens drawn uniformly without replacement among the valid tokens
    that PPO did not clip and whose cov_t = (A − mean A)(log π_θ − mean sg(log π_θ)) lies in (lb, ub);
    all of them when fewer qualify. N = number of valid tokens. corr is detached: those tokens get no gradient.
    The draw uses ``generator`` (default: torch's global RNG, as verl); it is sync-free (a sort of uniform keys)
    so it is the same distribution as verl's randperm but not the same stream.
    Metrics (verl): pg_clipfrac = share of valid tokens zeroed by the draw, ppo_kl.
    Δ is clamped to ±20 before exp (verl leaves it unclamped).
    """
    mask = response_mask.bool()
    delta, r = _ratio(log_prob, old_log_prob)
    loss1 = -advantages * r
    loss2 = -advantages * torch.clamp(r, 1 - clip_low, 1 + clip_high)
    with torch.no_grad():
        cov = _covariance(advantages, log_prob, mask)
        candidate = mask & ~(loss2 > loss1) & (cov > cov_lb) & (cov < cov_ub)
        device = cov.device if generator is None else generator.device
        uniform = torch.rand(cov.shape, generator=generator, device=device).to(cov.device)  # float32 keys
        keys = torch.where(candidate, uniform, 2.0)  # non-candidates sort last
        zeroed = candidate & _smallest_k(keys, _count_share(mask, ratio))
    loss = torch.maximum(loss1, loss2) * (~zeroed).to(r.dtype)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {
        "actor/pg_clipfrac": masked_mean(zeroed.to(delta.dtype), response_mask),
        "actor/ppo_kl": masked_mean(-delta, response_mask),
    }
    return loss, _detached(metrics)


def kl_cov_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    ratio: float = 2e-4,
    kl_coef: float = 0.1,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025; verl `kl_cov`). No clipping; a |Δ| penalty on the highest-covariance tokens.

    L_t = (−A·r + kl_coef·|Δ|·1[t ∈ top-k cov])·w,   k = max(⌊ratio·N⌋, 1) valid tokens by
    cov_t = (A − mean A)(log π_θ − mean log π_θ) (means over valid tokens, detached).
    Deterministic (ties broken by position). Metric (verl): ppo_kl = mean |Δ| over valid tokens.
    r uses Δ clamped to ±20 (verl leaves it unclamped); |Δ| is not clamped.
    """
    mask = response_mask.bool()
    raw_delta = log_prob - old_log_prob
    _, r = _ratio(log_prob, old_log_prob)
    with torch.no_grad():
        cov = _covariance(advantages, log_prob, mask)
        keys = torch.where(mask, -cov, torch.full_like(cov, math.inf))
        top = mask & _smallest_k(keys, _count_share(mask, ratio))
    loss = -advantages * r + kl_coef * raw_delta.abs() * top.to(r.dtype)
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {"actor/ppo_kl": masked_mean(raw_delta.abs(), response_mask)}
    return loss, _detached(metrics)


def dro_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    beta: float = 0.1,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Richemond et al. 2024; Kimi k1.5; verl `dro`): REINFORCE with a quadratic trust region.

    L = −(A·log π_θ − ½β·(log π_θ − log π_old)²)·w,   ∇L = −(A − β·Δ)·∇log π_θ·w.   Δ is not clamped.
    """
    delta = log_prob - old_log_prob
    loss = -(log_prob * advantages - 0.5 * beta * delta.square())
    if weights is not None:
        loss = loss * weights.detach()
    metrics = {"actor/ppo_kl": masked_mean(-delta, response_mask)}
    return loss, _detached(metrics)


def oapl_loss(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    beta: float = 1e-3,
    beta1: float | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """OAPL squared regression, per sequence (B,).

    ℓ_b = (β · Σ_t m·(log π_θ − log μ) − (r_b − V̂(x)))²,  V̂(x) = β₁ · log mean_{j∈group} exp(r_j / β₁)
    β₁ = β when None; β₁ = inf → plain group mean. Token log-ratios are *summed* over the sequence; no IS,
    no clipping. `keep` (B,) removes rows from V̂ (default: rows with at least one kept token).
    """
    mask = response_mask.bool()
    if keep is None:
        keep = mask.any(-1)
    value = oapl_value(rewards, group_ids, beta1=beta if beta1 is None else beta1, keep=keep)
    target = rewards.to(log_prob.dtype) - value.to(log_prob.dtype)
    diff = torch.where(mask, log_prob - rollout_log_prob, torch.zeros_like(log_prob))
    pred = beta * diff.sum(-1)
    loss = (pred - target) ** 2
    metrics = {
        "actor/oapl_value_mean": masked_mean(value.to(log_prob.dtype), keep),
        "actor/oapl_target_mean": masked_mean(target, keep),
        "actor/oapl_pred_mean": masked_mean(pred, keep),
        "actor/ppo_kl": masked_mean(rollout_log_prob - log_prob, mask),
    }
    return loss, _detached(metrics)


# ----------------------------------------------------------------------------------------------- dispatcher


def _validate(
    log_prob: Tensor, response_mask: Tensor, denominator_mask: Tensor | None, check_values: bool, **named
) -> None:
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be (B, T), got shape {tuple(log_prob.shape)}")
    if not log_prob.is_floating_point():
        raise ValueError(f"log_prob must be floating point, got {log_prob.dtype}")
    shape = tuple(log_prob.shape)
    for name, value in {
        "response_mask": response_mask,
        "denominator_mask": denominator_mask,
        **named,
    }.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    if not check_values:
        return
    check_binary_mask("response_mask", response_mask)
    if denominator_mask is not None:
        check_binary_mask("denominator_mask", denominator_mask)
    mask = response_mask.bool()
    for name, value in {"log_prob": log_prob, **named}.items():
        if value is not None and value.is_floating_point() and not torch.isfinite(value.detach()[mask]).all():
            raise ValueError(f"{name} has NaN or ±inf on valid tokens")
    if denominator_mask is not None and (mask & ~denominator_mask.bool()).any():
        raise ValueError("response_mask keeps tokens that denominator_mask (pre-rejection) does not have")


def policy_loss(
    config: LossConfig,
    log_prob: Tensor,
    old_log_prob: Tensor | None,
    advantages: Tensor | None,
    response_mask: Tensor,
    *,
    weights: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
    denominator_mask: Tensor | None = None,
    rewards: Tensor | None = None,
    group_ids: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Compute `config.name`'s loss and aggregate it. Returns (scalar loss, detached metrics).

    response_mask: kept tokens (after rejection); denominator_mask: valid tokens before rejection (default
    response_mask). advantages: (B, T) or (B,) (broadcast). weights: detached correction weights w (B, T)
    for ppo_clip (decoupled), reinforce, cispo, gspo, gmpo and the verl losses (dppo_tv, dppo_kl, sapo, gpg,
    clip_cov, kl_cov, dro). rollout_log_prob (μ) is needed by
    ppo_is, vanilla_is, tis, areal and oapl; oapl also needs rewards (B,) and group_ids (B,) (advantages
    unused). If no token is kept the loss is exactly 0 with zero gradient and `actor/all_rejected` = 1.
    generator: clip_cov's random draw (default: a generator seeded with `clip_cov_seed` when that is set,
    else torch's global RNG). Pass one persistent generator per run for fresh, reproducible draws.
    """
    name = config.name
    if log_prob.dim() == 2:
        batch = log_prob.shape[0]
        for arg, value in (("advantages", advantages), ("rewards", rewards), ("group_ids", group_ids)):
            if value is not None and value.dim() == 1 and value.shape[0] != batch:
                raise ValueError(f"{arg} has shape {tuple(value.shape)}, expected ({batch},) for {batch} rows"
                                 + (f" or {tuple(log_prob.shape)}" if arg == "advantages" else ""))  # fmt: skip
    if advantages is not None and advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(log_prob)
    # fp16 / bf16 inputs are computed in float32 (as compute_correction does): exp of a log-ratio clamped to
    # ±20 is 4.9e8, beyond fp16's 65504, and bf16's 8-bit mantissa would round the ratios near 1
    if log_prob.dtype in (torch.float16, torch.bfloat16):
        log_prob = log_prob.float()
    old_log_prob, advantages, weights, rollout_log_prob = (
        x.float() if x is not None and x.dtype in (torch.float16, torch.bfloat16) else x
        for x in (old_log_prob, advantages, weights, rollout_log_prob)
    )
    _validate(
        log_prob,
        response_mask,
        denominator_mask,
        config.check_inputs,
        old_log_prob=old_log_prob,
        advantages=advantages,
        weights=weights,
        rollout_log_prob=rollout_log_prob,
    )
    # Zero every input outside the kept mask: padding may hold NaN / -inf, and a masked position must get
    # an exactly-zero gradient (0 · NaN in a backward would otherwise poison the parameters).
    kept_mask = response_mask.bool()

    def clean(value: Tensor | None) -> Tensor | None:
        return None if value is None else torch.where(kept_mask, value, torch.zeros_like(value))

    log_prob, old_log_prob, advantages = clean(log_prob), clean(old_log_prob), clean(advantages)
    weights, rollout_log_prob = clean(weights), clean(rollout_log_prob)
    needs_rollout = name in ("ppo_is", "vanilla_is", "tis", "areal", "oapl")
    if needs_rollout and rollout_log_prob is None:
        raise ValueError(f"loss {name!r} needs rollout_log_prob (log μ)")
    if name in ("ppo_is", "vanilla_is", "tis", "areal", "oapl") and weights is not None:
        raise ValueError(f"loss {name!r} builds its own weight (or none); do not pass weights")
    if name == "oapl":
        if rewards is None or group_ids is None:
            raise ValueError("loss 'oapl' needs rewards (B,) and group_ids (B,)")
    else:
        if advantages is None:
            raise ValueError(f"loss {name!r} needs advantages")
        if old_log_prob is None and name not in ("reinforce", "ppo_is", "gpg"):
            raise ValueError(f"loss {name!r} needs old_log_prob")

    lo, hi = config.eps_low, config.eps_high
    metrics: dict[str, Tensor] = {}
    if name in ("ppo_clip", "ppo_is", "vanilla_is", "tis", "areal"):
        anchor = rollout_log_prob if name == "ppo_is" else old_log_prob
        w = weights
        if name in ("vanilla_is", "tis", "areal"):
            with torch.no_grad():
                _, rho = _ratio(old_log_prob, rollout_log_prob)
                if name == "tis":
                    w = rho.clamp(min=config.tis_floor, max=config.tis_cap)
                elif name == "areal":
                    w = torch.where(rho <= config.areal_cap, rho, torch.zeros_like(rho))
                    metrics["actor/areal_capped_fraction"] = masked_mean(
                        (rho > config.areal_cap).to(rho.dtype), response_mask
                    )
                else:
                    w = rho
                metrics["actor/is_weight_mean"] = masked_mean(w, response_mask)
        loss, m = ppo_clip_loss(
            log_prob,
            anchor,
            advantages,
            response_mask,
            clip_low=lo,
            clip_high=hi,
            clip_c=config.clip_c,
            weights=w,
        )
    elif name == "reinforce":
        loss, m = reinforce_loss(
            log_prob, advantages, response_mask, weights=weights, ref_log_prob=old_log_prob
        )
    elif name == "cispo":
        loss, m = cispo_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi, weights=weights
        )
    elif name == "gspo":
        loss, m = gspo_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi, weights=weights
        )
    elif name == "gmpo":
        loss, m = gmpo_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi, weights=weights
        )
    elif name in ("dppo_tv", "dppo_kl"):
        fn = dppo_tv_loss if name == "dppo_tv" else dppo_kl_loss
        loss, m = fn(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi,
            cap=config.clip_c, kl_coef=config.dppo_kl_coef, weights=weights,
        )  # fmt: skip
    elif name == "sapo":
        loss, m = sapo_loss(
            log_prob, old_log_prob, advantages, response_mask,
            tau_pos=config.sapo_tau_pos, tau_neg=config.sapo_tau_neg, weights=weights,
        )  # fmt: skip
    elif name == "gpg":
        loss, m = reinforce_loss(log_prob, advantages, response_mask, weights=weights)
    elif name == "clip_cov":
        if generator is None and config.clip_cov_seed is not None:
            generator = torch.Generator(device=log_prob.device).manual_seed(config.clip_cov_seed)
        loss, m = clip_cov_loss(
            log_prob, old_log_prob, advantages, response_mask, clip_low=lo, clip_high=hi,
            ratio=config.clip_cov_ratio, cov_lb=config.clip_cov_lb, cov_ub=config.clip_cov_ub,
            generator=generator, weights=weights,
        )  # fmt: skip
    elif name == "kl_cov":
        loss, m = kl_cov_loss(
            log_prob, old_log_prob, advantages, response_mask,
            ratio=config.kl_cov_ratio, kl_coef=config.kl_cov_coef, weights=weights,
        )  # fmt: skip
    elif name == "dro":
        loss, m = dro_loss(
            log_prob, old_log_prob, advantages, response_mask, beta=config.dro_beta, weights=weights
        )
    else:
        loss, m = oapl_loss(
            log_prob,
            rollout_log_prob,
            rewards,
            group_ids,
            response_mask,
            beta=config.oapl_beta,
            beta1=config.oapl_beta1,
        )
    metrics.update(m)
    total = aggregate(
        loss,
        response_mask,
        config.agg_mode,
        denominator=config.denominator,
        denominator_mask=denominator_mask,
        norm_constant=config.norm_constant,
    )
    kept = response_mask.bool().sum()
    valid = kept if denominator_mask is None else denominator_mask.bool().sum()
    dtype = log_prob.dtype
    metrics["actor/pg_loss"] = total.detach()
    metrics["actor/kept_token_fraction"] = (kept.to(dtype) / valid.to(dtype).clamp_min(1)).detach()
    metrics["actor/all_rejected"] = (kept == 0).to(dtype)
    return total, metrics
