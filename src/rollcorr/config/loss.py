"""The one home of the policy losses' names, aggregation modes, per-loss defaults and ``LossConfig``.

A leaf module (nothing from rollcorr is imported): the loss registry (``rollcorr.losses``) and the trainer's
validation (``rollcorr.train.config``) both read these names, so a loss or an aggregation mode exists once.
What the trainer needs to know about a loss is a property of ``LossConfig`` (``per_sequence``,
``regresses_on_rollout``, ``has_ratio``), not a comparison of its name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

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
# Losses that build their own train/infer weight from log μ (π_old/μ); in the trainer that weight is the correction's.
IS_LOSSES = ("ppo_is", "vanilla_is", "tis", "areal")
# Per-sequence losses: one value per sequence, averaged over sequences whatever the aggregation says.
PER_SEQUENCE_LOSSES = ("gmpo", "oapl")
# Losses that regress log π_θ − log μ on the rewards (OAPL): they read μ, the rewards and the group ids, not
# π_old, the advantages or IS weights, and come with their own advantage estimator.
REGRESSION_LOSSES = ("oapl",)
# Losses that clip the ratio π_θ/π_old (or |Δp|) to [1 − ε_lo, 1 + ε_hi]: ε_lo > 1 is a bound that never binds.
RATIO_CLIP_LOSSES = ("ppo_clip", "ppo_is", "vanilla_is", "tis", "areal", "cispo", "gspo", "clip_cov", "dppo_tv")
# Losses with no ratio of their own (−A · w · log π_θ): the correction's weight must supply π_θ/μ in bypass mode.
RATIO_FREE_LOSSES = ("reinforce", "gpg")

# Per-loss defaults: (ε_lo, ε_hi, aggregation). Sources: PPO / DAPO 0.2; GSPO paper 3e-4 / 4e-4 with
# seq-mean-token-mean; GMPO paper ε = 0.4 (log space); CISPO as AReaL recommends (ε_lo = 1 → no lower bound,
# ε_hi = 4); dppo_tv as prime-rl's DefaultLossConfig (dppo_mask_low/high = 0.2, thresholds on Δp); the verl
# losses sapo / gpg / clip_cov / kl_cov / dppo_kl / dro as verl's ActorConfig (clip_ratio 0.2, token-mean; sapo
# forced to seq-mean-token-mean; dppo_kl's ε are binary-KL thresholds). ε is unused by sapo, gpg, kl_cov, dro.
LOSS_DEFAULTS: dict[str, tuple[float, float, str]] = {
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

    clip_low / clip_high / agg default (None) to the loss's own defaults (see `LOSS_DEFAULTS`). gmpo and oapl
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
        low = LOSS_DEFAULTS[self.name][0] if self.clip_low is None else self.clip_low
        if self.name in RATIO_CLIP_LOSSES and low > 1:  # 1 − ε_lo < 0: a ratio is never below it
            raise ValueError(f"LossConfig.clip_low: {low:g} makes the lower clip 1 − ε_lo = {1 - low:g} < 0, which "
                             f"never binds for {self.name}; use ε_lo in [0, 1] (1 = no lower bound)")  # fmt: skip
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
        return LOSS_DEFAULTS[self.name][0] if self.clip_low is None else self.clip_low

    @property
    def eps_high(self) -> float:
        return LOSS_DEFAULTS[self.name][1] if self.clip_high is None else self.clip_high

    @property
    def agg_mode(self) -> str:
        return LOSS_DEFAULTS[self.name][2] if self.agg is None else self.agg

    @property
    def per_sequence(self) -> bool:
        """One loss value per sequence (gmpo, oapl): a mean over sequences whatever ``agg`` says."""
        return self.name in PER_SEQUENCE_LOSSES

    @property
    def regresses_on_rollout(self) -> bool:
        """The loss regresses on log μ and the rewards (oapl) instead of taking π_old, A and w."""
        return self.name in REGRESSION_LOSSES

    @property
    def has_ratio(self) -> bool:
        """The loss has a ratio of its own (False for reinforce / gpg: −A · w · log π_θ)."""
        return self.name not in RATIO_FREE_LOSSES

    @property
    def token_level(self) -> bool:
        """The loss is a sum or mean over tokens of the batch (its micro-batch shares count tokens)."""
        return self.agg_mode in ("token-mean", "token-sum") and not self.per_sequence

    @classmethod
    def from_dict(cls, values: dict) -> LossConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"LossConfig: unknown field(s) {sorted(unknown)}")
        return cls(**values)
