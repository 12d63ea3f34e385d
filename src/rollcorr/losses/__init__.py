"""Policy losses and loss aggregation (docs/spec.md §5, denominator policy of §3).

Notation (docs/spec.md §1): `log_prob` = log π_θ (with gradient), `old_log_prob` = log π_old, `rollout_log_prob` =
log μ. Per token, Δ = log π_θ − log π_old and the PPO ratio r = exp(clamp(Δ, ±20)); the discrepancy ratio
ρ = exp(clamp(log π_old − log μ, ±20)) is never differentiated. All tensors are (B, T) right-padded;
`kept_mask` is the mask *after* rejection (kept tokens) and `denominator_mask` the mask *before*
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

Each loss declares itself once in the catalogue (registry.py: ``LossSpec`` — name, function, its own
defaults, what it needs — registered with ``register_loss``); ``policy_loss``, ``LossConfig``, the trainer's
validation and the verl drop-in read that table. Layout: registry.py (LossSpec, LOSSES, register_loss,
LossConfig) · aggregation.py (aggregate) · common.py (clamped ratio, masked mean) · ppo.py (ppo_clip, ppo_is,
clip_cov, kl_cov) · reinforce.py (reinforce / gpg, cispo, dro) · sequence.py (gspo, gmpo) · trust_region.py
(dppo_tv, dppo_kl, sapo) · oapl.py · is_weighted.py (vanilla_is / tis / areal: their weights from
correction/weights.py) · dispatch.py (policy_loss). Importing this package registers every built-in loss.
"""

from rollcorr.config.loss import AGG_MODES, DENOMINATORS
from rollcorr.losses.aggregation import aggregate
from rollcorr.losses.common import masked_mean
from rollcorr.losses.dispatch import policy_loss
from rollcorr.losses.is_weighted import is_loss_weights
from rollcorr.losses.oapl import oapl_loss
from rollcorr.losses.ppo import clip_cov_loss, kl_cov_loss, ppo_clip_loss
from rollcorr.losses.registry import LOSSES, LossConfig, LossInputs, LossSpec, loss_spec, register_loss
from rollcorr.losses.reinforce import cispo_loss, dro_loss, reinforce_loss
from rollcorr.losses.sequence import gmpo_loss, gspo_loss
from rollcorr.losses.trust_region import dppo_kl_loss, dppo_tv_loss, sapo_loss

# The built-in losses, in registration order (a snapshot: ``LOSSES`` also holds losses registered later).
LOSS_NAMES = tuple(LOSSES)

__all__ = [
    "AGG_MODES",
    "DENOMINATORS",
    "LOSSES",
    "LOSS_NAMES",
    "LossConfig",
    "LossInputs",
    "LossSpec",
    "aggregate",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "gmpo_loss",
    "gspo_loss",
    "is_loss_weights",
    "kl_cov_loss",
    "loss_spec",
    "masked_mean",
    "oapl_loss",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "register_loss",
    "sapo_loss",
]
