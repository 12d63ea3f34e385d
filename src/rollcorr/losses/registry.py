"""The loss catalogue: every policy loss declares itself once, as a ``LossSpec`` in ``LOSSES``.

A spec holds the loss's name, the function ``policy_loss`` calls, its own defaults (clip range, aggregation and
its hyper-parameters such as ``oapl_beta``) and what it needs (π_old, advantages, log μ, rewards and group ids,
the correction's weights) and is (per-sequence, has a ratio, regresses on the rollout). ``policy_loss``
dispatches through this table, ``LossConfig`` and the trainer's validation (``rollcorr.train.config``) read
their defaults and names from it, and the verl drop-in (``rollcorr.compat.verl``) lists its losses from it.
A loss module registers its loss with ``register_loss`` when it is imported; a loss written outside the
package registers the same way and is then accepted everywhere a built-in one is (docs/architecture.md,
Recipes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from rollcorr.config.loss import AGG_MODES, DENOMINATORS

LossResult = tuple[Tensor, dict[str, Tensor]]
# a loss called under verl's convention: (loss (B, T) or (B,), metrics, the aggregation it forces (None: the
# caller's), its denominator ("kept"; "batch" for a plain mean over the batch's sequences))
VerlResult = tuple[Tensor, dict[str, Tensor], "str | None", str]


@dataclass(frozen=True)
class VerlCall:
    """A loss called as verl calls ``compute_policy_loss_<mode>`` (``rollcorr.compat.verl_losses``): the tensors,
    verl's clip fields and the loss's own verl fields (``options``: tau_pos, tau_neg, clip_cov_ratio, clip_cov_lb,
    clip_cov_ub, kl_cov_ratio, ppo_kl_coef, dro_beta), a generator for a random draw, and ``strict`` (verl's
    exact numbers: no log-ratio clamp where verl has none)."""

    log_prob: Tensor
    old_log_prob: Tensor
    advantages: Tensor
    response_mask: Tensor
    weights: Tensor | None
    clip_low: float
    clip_high: float
    clip_c: float
    options: Mapping[str, Any]
    generator: torch.Generator | None = None
    strict: bool = False

    @property
    def clamp(self) -> float | None:
        """The log-ratio clamp a loss applies (None: verl's unclamped numbers)."""
        from rollcorr.config.correction import LOG_RATIO_CLAMP

        return None if self.strict else LOG_RATIO_CLAMP


@dataclass(frozen=True)
class LossInputs:
    """What ``policy_loss`` hands a loss: (B, T) tensors already validated, upcast to ≥ float32 and zeroed off
    ``kept_mask`` (so padding never reaches a gradient). advantages is (B, T) (a (B,) input is broadcast).
    A tensor the loss does not need may be None (the spec's ``needs_*`` say which ones it gets)."""

    log_prob: Tensor  # log π_θ, with gradient
    kept_mask: Tensor  # tokens kept after rejection (bool or 0/1)
    old_log_prob: Tensor | None = None  # log π_old
    advantages: Tensor | None = None
    weights: Tensor | None = None  # the correction's detached weights w
    rollout_log_prob: Tensor | None = None  # log μ
    rewards: Tensor | None = None  # (B,)
    group_ids: Tensor | None = None  # (B,)
    generator: torch.Generator | None = None  # a loss's random draw (clip_cov)


@dataclass(frozen=True)
class LossSpec:
    """One policy loss, declared once.

    compute(inputs, config) → (per-token loss (B, T) or per-sequence loss (B,), detached metrics).
    clip_low / clip_high / agg: the loss's own ε and aggregation (what ``LossConfig`` takes when they are None).
    options: the loss's own hyper-parameters — ``LossConfig`` field → default — filled into a ``LossConfig``
    of this loss when left None.
    """

    name: str
    compute: Callable[[LossInputs, LossConfig], LossResult]
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_low_at_most: float | None = 1.0  # a ratio clipped below at 1 − ε_lo: ε_lo > 1 never binds (None:
    #                                       ε_lo is not a ratio bound, e.g. gmpo's log space)
    agg: str = "token-mean"
    options: Mapping[str, Any] = field(default_factory=dict)
    needs_old_log_prob: bool = True  # π_old, the ratio's anchor (reinforce reads it for a metric when given)
    needs_advantages: bool = True
    needs_rollout_log_prob: bool = False  # log μ
    needs_rewards: bool = False  # rewards and group ids (B,)
    takes_weights: bool = True  # multiplies the correction's weights w
    builds_own_weights: bool = False  # weights by π_old/μ itself (the IS losses): the trainer leaves that to
    #                                   the correction and refuses these
    per_sequence: bool = False  # one value per sequence: a mean over sequences whatever ``agg`` says
    has_ratio: bool = True  # False: −A · w · log π_θ (reinforce, gpg); the weight must supply π_θ/μ in bypass
    regresses_on_rollout: bool = False  # regresses log π_θ − log μ on the rewards (oapl): no π_old, A or w
    verl_name: str | None = None  # verl's ``loss_mode`` for the same loss, when verl has it
    # how verl's convention calls it (``VerlCall`` → ``VerlResult``); None: ``compute`` with verl's clip range
    verl_loss: Callable[[VerlCall], VerlResult] | None = None

    def call_as_verl(self, call: VerlCall) -> VerlResult:
        """This loss under verl's convention: its own adapter, or ``compute`` on a ``LossConfig`` of verl's clip
        range (a loss registered from outside with a ``verl_name`` and no adapter)."""
        if self.verl_loss is not None:
            return self.verl_loss(call)
        config = LossConfig(name=self.name, clip_low=call.clip_low, clip_high=call.clip_high)
        inputs = LossInputs(log_prob=call.log_prob, kept_mask=call.response_mask, old_log_prob=call.old_log_prob,
                            advantages=call.advantages, weights=call.weights, generator=call.generator)
        loss, metrics = self.compute(inputs, config)
        return loss, metrics, None, "batch" if self.per_sequence else "kept"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"LossSpec.name must be an identifier, got {self.name!r}")
        if self.agg not in AGG_MODES:
            raise ValueError(
                f"LossSpec {self.name!r}: unknown aggregation {self.agg!r}; choose one of {AGG_MODES}"
            )
        unknown = set(self.options) - _OPTION_FIELDS
        if unknown:
            raise ValueError(f"LossSpec {self.name!r}: options {sorted(unknown)} are not LossConfig fields")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


LOSSES: dict[str, LossSpec] = {}  # name → spec, in registration order


def register_loss(spec: LossSpec, *, replace: bool = False) -> LossSpec:
    """Add ``spec`` to the catalogue (``replace=True`` to redefine a name). Returns it."""
    if spec.name in LOSSES and not replace:
        raise ValueError(f"a loss named {spec.name!r} is already registered")
    LOSSES[spec.name] = spec
    return spec


def loss_spec(name: str) -> LossSpec:
    """The registered loss ``name``; a one-line error naming the known ones otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; choose one of {tuple(LOSSES)}") from None


@dataclass(frozen=True)
class LossConfig:
    """Which policy loss, its hyper-parameters and how it is aggregated. Validated when built.

    clip_low / clip_high / agg default (None) to the loss's own (its ``LossSpec``); the loss's own
    hyper-parameters left None are filled from its spec's ``options``. Per-sequence losses (gmpo, oapl)
    ignore ``agg`` (sequence mean under the denominator policy). `denominator`: `kept` (mean over kept
    tokens), `original` (pre-rejection counts) or `batch` (every sequence of the batch counts, TRM).
    `norm_constant` divides `seq-mean-token-sum-norm` (None → T).
    """

    name: str = "ppo_clip"
    clip_low: float | None = None
    clip_high: float | None = None
    clip_c: float | None = None  # dual clip for A < 0; dppo_tv / dppo_kl: cap on sg(r); None = off (verl 3.0)
    agg: str | None = None
    denominator: str = "kept"
    norm_constant: float | None = None
    # the losses' own hyper-parameters: None = the loss's default (its LossSpec.options)
    tis_cap: float | None = None  # tis: w = min(ρ, cap)
    tis_floor: float | None = None  # tis: optional lower bound w = max(w, floor)
    areal_cap: float | None = None  # areal: w = 0 where ρ > cap
    dppo_kl_coef: float | None = None  # dppo_tv / dppo_kl: + coef · (log r)² on every valid token
    sapo_tau_pos: float | None = None  # sapo: gate temperature for A > 0 (verl tau_pos)
    sapo_tau_neg: float | None = None  # sapo: gate temperature for A ≤ 0 (verl tau_neg)
    clip_cov_ratio: float | None = None  # clip_cov: share of tokens whose loss is zeroed (at least one)
    clip_cov_lb: float | None = None  # clip_cov: candidates have lb < cov < ub
    clip_cov_ub: float | None = None
    clip_cov_seed: int | None = None  # clip_cov: seed of the token draw when no generator is passed
    kl_cov_ratio: float | None = None  # kl_cov: share of tokens (top covariance, ≥ 1) given the KL term
    kl_cov_coef: float | None = None  # kl_cov: coefficient of |Δ| (verl policy_loss.ppo_kl_coef)
    dro_beta: float | None = None  # dro: β of the quadratic penalty ½β·Δ²
    oapl_beta: float | None = None  # OAPL β
    oapl_beta1: float | None = None  # OAPL β₁ of the soft value; None → β; inf → plain group mean
    check_inputs: bool = True  # NaN / mask checks (one host sync); turn off in tight loops

    def __post_init__(self) -> None:
        spec = LOSSES.get(self.name)
        if spec is None:
            raise ValueError(f"LossConfig.name: unknown loss {self.name!r}; choose one of {tuple(LOSSES)}")
        for key, default in spec.options.items():  # the loss's own defaults, from its one declaration
            if getattr(self, key) is None:
                object.__setattr__(self, key, default)
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
        low, bound = (spec.clip_low if self.clip_low is None else self.clip_low), spec.clip_low_at_most
        if bound is not None and low > bound:  # 1 − ε_lo < 0: a ratio is never below it
            raise ValueError(f"LossConfig.clip_low: {low:g} makes the lower clip 1 − ε_lo = {1 - low:g} < 0, which "
                             f"never binds for {self.name}; use ε_lo in [0, {bound:g}] (1 = no lower bound)")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ValueError(f"LossConfig.clip_c (dual clip / dppo ratio cap) must be > 1, got {self.clip_c}")
        if self.norm_constant is not None and not self.norm_constant > 0:
            raise ValueError(f"LossConfig.norm_constant must be > 0, got {self.norm_constant}")
        self._check_options()

    def _check_options(self) -> None:
        """Range checks of the losses' own hyper-parameters that are set (explicitly or by the spec)."""

        def check(name: str, ok: Callable[[float], bool], what: str) -> None:
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise ValueError(f"LossConfig.{name} must be {what}, got {value}")

        check("tis_cap", lambda v: v > 0, "> 0")
        if self.tis_floor is not None and not 0 <= self.tis_floor <= (
            math.inf if self.tis_cap is None else self.tis_cap
        ):
            raise ValueError(f"LossConfig.tis_floor must be in [0, tis_cap], got {self.tis_floor}")
        check("areal_cap", lambda v: v > 0, "> 0")
        check("dppo_kl_coef", lambda v: v >= 0, ">= 0")
        for name in ("sapo_tau_pos", "sapo_tau_neg", "dro_beta"):
            check(name, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
        check("kl_cov_coef", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            check(name, lambda v: 0 < v <= 1, "in (0, 1]")
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        if (lb is not None or ub is not None) and not (
            lb is not None and ub is not None and math.isfinite(lb) and math.isfinite(ub) and lb < ub
        ):
            raise ValueError(
                "LossConfig.clip_cov_lb and LossConfig.clip_cov_ub must be finite with clip_cov_lb < "
                f"clip_cov_ub, got {lb} and {ub}"
            )
        if self.clip_cov_seed is not None and (
            isinstance(self.clip_cov_seed, bool) or not isinstance(self.clip_cov_seed, int)
        ):
            raise ValueError(f"LossConfig.clip_cov_seed must be an int or None, got {self.clip_cov_seed!r}")
        check("oapl_beta", lambda v: v > 0, "> 0")
        check("oapl_beta1", lambda v: v > 0, "> 0")

    @property
    def spec(self) -> LossSpec:
        """The loss's catalogue entry."""
        return loss_spec(self.name)

    @property
    def eps_low(self) -> float:
        return self.spec.clip_low if self.clip_low is None else self.clip_low

    @property
    def eps_high(self) -> float:
        return self.spec.clip_high if self.clip_high is None else self.clip_high

    @property
    def agg_mode(self) -> str:
        return self.spec.agg if self.agg is None else self.agg

    @property
    def per_sequence(self) -> bool:
        """One loss value per sequence (gmpo, oapl): a mean over sequences whatever ``agg`` says."""
        return self.spec.per_sequence

    @property
    def regresses_on_rollout(self) -> bool:
        """The loss regresses on log μ and the rewards (oapl) instead of taking π_old, A and w."""
        return self.spec.regresses_on_rollout

    @property
    def has_ratio(self) -> bool:
        """The loss has a ratio of its own (False for reinforce / gpg: −A · w · log π_θ)."""
        return self.spec.has_ratio

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


# The LossConfig fields a LossSpec may declare as its own options (everything but the shared settings).
_OPTION_FIELDS = {f.name for f in fields(LossConfig)} - {
    "name", "clip_low", "clip_high", "clip_c", "agg", "denominator", "norm_constant", "check_inputs",
}
