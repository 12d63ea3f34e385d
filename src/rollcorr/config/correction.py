"""``CorrectionConfig``: what the rollout correction does (docs/spec.md §2–3, §8), validated when built.

One frozen dataclass drives both the driver-side correction (decoupled mode) and the loss-side one
(bypass mode). Thresholds live in **ratio space** (ρ = π_old/μ) unless said otherwise:

- IS: ``is_level`` token | sequence | geometric (None = no IS weights), ``is_mode`` truncate | mask,
  bounds ``is_upper`` / ``is_lower``. Truncate: w ← clamp(w, is_lower, is_upper) (either bound may be None).
  Mask (IcePop / Seq-MIS): w ← w·1[is_lower ≤ w ≤ is_upper], is_lower None meaning 0.
- RS: ``rs`` names verl options (``token_k1`` … ``seq_max_k3``) combined with AND, ``rs_thresholds`` one per
  option (or one shared). K1 options take a ratio window (lo, hi) or a number C meaning [1/C, C]; k2/k3
  options take a single upper bound. ``*_binary_kl`` options (AReaL's ``metric="binary_kl"``: the symmetric
  KL between the Bernoulli distributions of the sampled token under π_old and μ) take a single upper bound.
- Sequence drops beyond verl: ``veto_threshold`` (any ρ_t below it), ``veto_upper`` (any ρ_t above it),
  TRM ``trm_max_k2`` / ``trm_mean_k3``, OPSM ``opsm_delta`` (needs advantages at call time).
- Rules registered from outside the package (``correction.rejection.register_rule``, docs/plugins.md): on only
  when ``rules`` names them, ``{rule name: {option: value}}`` (or a list of names: no options).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rollcorr.config.loss import DENOMINATORS

# |log-ratio| clamp before any exp: e^20 ≈ 4.9e8 stays finite in float32 and bf16. The one value used by
# the correction (safety_bound), the losses, the audit and the π_old strategies.
LOG_RATIO_CLAMP = 20.0

CORRECTION_MODES = ("decoupled", "bypass")
LOSS_TYPES = ("ppo_clip", "reinforce")
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
BATCH_NORM_SCOPES = ("batch", "mini_batch", "micro_batch")
# What log μ is compared with under top-k / top-p (docs/three-policies.md): keep_mask — the sampler records its
# kept sets and the learner renormalises π_old and π_θ over them (the correction sees μ as drawn); truncated —
# the learner's full π against μ as drawn (every ratio carries the kept mass); full — μ_full = μ · kept mass.
SAMPLER_DISTRIBUTIONS = ("keep_mask", "truncated", "full")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
    "token_binary_kl",
    "seq_sum_binary_kl",
    "seq_mean_binary_kl",
    "seq_max_binary_kl",
)

RSThreshold = float | tuple[float, float]


def _choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")


def _number(name: str, value: Any, *, positive: bool = True, allow_zero: bool = False) -> float:
    """A finite real number (never a bool); ``positive`` requires > 0 (or ≥ 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _optional(name: str, value: Any, **kw: Any) -> float | None:
    return None if value is None else _number(name, value, **kw)


def _parse_float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a number") from None


def parse_rs_threshold(option: str, spec: Any, *, name: str = "rs_thresholds") -> RSThreshold:
    """One RS threshold in canonical form: K1 options → ratio window (lo, hi); k2/k3/binary_kl → upper bound.

    Accepts a number, a (lo, hi) pair or a verl string (``"2.0"``, ``"0.5_2.0"``). For K1 a single
    number C means [1/C, C] and must be ≥ 1.
    """
    where = f"{name} for {option}"
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError(f"{where} is an empty string")
        if "_" in text:
            lo_s, hi_s = text.split("_", 1)
            spec = (_parse_float(where, lo_s), _parse_float(where, hi_s))
        else:
            spec = _parse_float(where, text)
    if option.endswith("k1"):
        if isinstance(spec, list | tuple):
            if len(spec) != 2:
                raise ValueError(f"{where} must be a (lo, hi) ratio window, got {spec!r}")
            lo = _number(f"{where} (lower)", spec[0])
            hi = _number(f"{where} (upper)", spec[1])
            if lo > hi:
                raise ValueError(f"{where}: lower bound {lo} > upper bound {hi}")
            return (lo, hi)
        c = _number(where, spec)
        if c < 1:
            raise ValueError(f"{where}: a single K1 threshold C means [1/C, C] and must be >= 1, got {c}")
        return (1.0 / c, c)
    if isinstance(spec, list | tuple):
        raise ValueError(
            f"{where}: {option} takes a single upper bound, not a 'lo_hi' window {spec!r} "
            "(only *_k1 options have a lower bound)"
        )
    return _number(where, spec)


def _normalise_rules(rules: Any) -> dict[str, dict[str, Any]]:
    """``rules`` as {rule name: {option: value}}: from such a mapping (options may be null: none), a list of
    names or one comma-separated string of them. Whether each name is a registered rule is the rule list's
    question (``correction.rejection.check_rules``): this leaf knows no rule."""
    if rules is None:
        return {}
    if isinstance(rules, str):
        rules = [part.strip() for part in rules.split(",") if part.strip()]
    if isinstance(rules, list | tuple):
        if len(set(rules)) != len(rules):
            raise ValueError(f"rules names a rule twice: {list(rules)!r:.120}")
        rules = dict.fromkeys(rules)
    if not isinstance(rules, Mapping):
        raise ValueError(f"rules must map rule names to their options, e.g. {{my_rule: {{limit: 1.05}}}}, got "
                         f"{rules!r:.80}")
    out: dict[str, dict[str, Any]] = {}
    for name, options in rules.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"rules: a rule name must be a non-empty string, got {name!r:.80}")
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"rules.{name}: its options must be a mapping {{option: value}}, got {options!r:.80}")
        if options is not None and not all(isinstance(key, str) for key in options):
            raise ValueError(f"rules.{name}: option names must be strings, got {list(options)!r:.80}")
        out[name] = dict(options or {})
    return out


@dataclass(frozen=True)
class CorrectionConfig:
    """How to weight and reject tokens given π_old (or π_θ in bypass) and the sampler's μ."""

    mode: str = "decoupled"  # "decoupled": ρ = π_old/μ; "bypass": π_old := μ, ratio π_θ/μ from log_prob
    loss_type: str = "ppo_clip"  # bypass + ppo_clip applies no weights (the PPO ratio already holds π_θ/μ)
    is_level: str | None = None  # None: no IS weights (metrics and RS only)
    is_mode: str = "truncate"
    is_upper: float | None = 2.0  # None or inf: no upper bound (verl's inf threshold; stored as None)
    is_lower: float | None = None
    batch_normalize: bool = False  # divide weights by their masked mean (after truncation / masking)
    batch_norm_scope: str = "batch"  # where the caller applies it: batch | mini_batch | micro_batch
    rs: tuple[str, ...] = ()
    rs_thresholds: tuple[RSThreshold, ...] = ()
    veto_threshold: float | None = None  # drop a sequence if any token has ρ_t < this (slime/ROLL: 1e-4)
    veto_upper: float | None = None  # drop a sequence if any token has ρ_t > this (SkyRL outlier high)
    trm_max_k2: float | None = None  # TRM: keep iff max_t ½ℓ² ≤ δ_max
    trm_mean_k3: float | None = None  # TRM: keep iff mean_t (e^ℓ − 1 − ℓ) ≤ δ_avg
    opsm_delta: float | None = None  # OPSM: drop iff A < 0 and mean_t(log μ − log π_θ) > δ
    rules: dict[str, dict[str, Any]] = field(default_factory=dict)  # rules from outside, by name: their options
    denominator: str = "kept"  # loss denominator after rejection: kept | original | batch
    # keep_mask: π renormalised over the sampler's kept sets before it gets here (μ as drawn); truncated: μ as drawn
    # against a full π; full: log μ_full = rollout_log_prob + log_kept_mass. Without top-k / top-p all three agree.
    sampler_distribution: str = "keep_mask"
    verl_compat: bool = False  # reproduce verl exactly (K1 window on −log ρ, all rows in seq metrics, …)
    safety_bound: float = LOG_RATIO_CLAMP  # |log-ratio| clamp before any exp

    def __post_init__(self) -> None:
        _choice("mode", self.mode, CORRECTION_MODES)
        _choice("loss_type", self.loss_type, LOSS_TYPES)
        if self.loss_type == "reinforce" and self.mode != "bypass":  # the trainer's rule, for every entry point
            raise ValueError("loss_type='reinforce' applies in bypass mode only (the weight π_θ/μ replaces the PPO "
                             "ratio; verl: bypass_mode: true); decoupled corrections use loss_type='ppo_clip'")
        _choice("is_level", self.is_level, (None, *IS_LEVELS))
        _choice("is_mode", self.is_mode, IS_MODES)
        _choice("batch_norm_scope", self.batch_norm_scope, BATCH_NORM_SCOPES)
        _choice("denominator", self.denominator, DENOMINATORS)
        _choice("sampler_distribution", self.sampler_distribution, SAMPLER_DISTRIBUTIONS)
        for flag in ("batch_normalize", "verl_compat"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        set_ = object.__setattr__  # normalise in place (frozen dataclass)

        no_bound = isinstance(self.is_upper, float) and self.is_upper == math.inf  # the bound of no bound
        upper = None if no_bound else _optional("is_upper", self.is_upper)
        lower = _optional("is_lower", self.is_lower, allow_zero=True)
        if upper is not None and lower is not None and lower > upper:
            raise ValueError(f"is_lower={lower} > is_upper={upper}")
        if self.is_mode == "mask" and upper is None and lower is None:
            raise ValueError("is_mode='mask' needs is_upper and/or is_lower (a band to keep)")
        set_(self, "is_upper", upper)
        set_(self, "is_lower", lower)
        if self.batch_normalize and self.is_level is None:
            raise ValueError("batch_normalize=True needs is_level (there are no IS weights to normalise)")

        rs, thresholds = self._normalise_rs(self.rs, self.rs_thresholds)
        set_(self, "rs", rs)
        set_(self, "rs_thresholds", thresholds)

        set_(self, "veto_threshold", _optional("veto_threshold", self.veto_threshold))
        set_(self, "veto_upper", _optional("veto_upper", self.veto_upper))
        if self.veto_threshold is not None and self.veto_threshold >= 1:
            raise ValueError(
                f"veto_threshold must be < 1 (a ratio floor, typical 1e-4), got {self.veto_threshold}"
            )
        if self.veto_upper is not None and self.veto_upper <= 1:
            raise ValueError(f"veto_upper must be > 1 (a ratio ceiling, typical 100), got {self.veto_upper}")
        set_(self, "trm_max_k2", _optional("trm_max_k2", self.trm_max_k2))
        set_(self, "trm_mean_k3", _optional("trm_mean_k3", self.trm_mean_k3))
        set_(self, "opsm_delta", _optional("opsm_delta", self.opsm_delta, allow_zero=True))
        set_(self, "rules", _normalise_rules(self.rules))
        bound = _number("safety_bound", self.safety_bound)
        if bound > 80:
            raise ValueError(f"safety_bound must be <= 80 so exp stays finite in float32, got {bound}")
        set_(self, "safety_bound", bound)

    @staticmethod
    def _normalise_rs(rs: Any, thresholds: Any) -> tuple[tuple[str, ...], tuple[RSThreshold, ...]]:
        if rs is None:
            rs = ()
        if isinstance(rs, str):
            rs = [part.strip() for part in rs.split(",") if part.strip()]
        if not isinstance(rs, list | tuple):
            raise ValueError(f"rs must be a list of options or a comma-separated string, got {rs!r}")
        options: list[str] = []
        for opt in rs:
            _choice("rs option", opt, RS_OPTIONS)
            if opt in options:
                raise ValueError(f"rs lists {opt!r} twice")
            options.append(opt)
        if thresholds is None:
            thresholds = ()
        if isinstance(thresholds, str):
            thresholds = [part.strip() for part in thresholds.split(",") if part.strip()]
        elif isinstance(thresholds, int | float) and not isinstance(thresholds, bool):
            thresholds = [thresholds]
        elif isinstance(thresholds, bool) or not isinstance(thresholds, list | tuple):
            raise ValueError(f"rs_thresholds must be a number, a string or a list, got {thresholds!r}")
        thresholds = list(thresholds)
        if not options:
            if thresholds:
                raise ValueError("rs_thresholds given but rs is empty")
            return (), ()
        if len(thresholds) == 1 and len(options) > 1:
            thresholds = thresholds * len(options)
        if len(thresholds) != len(options):
            raise ValueError(
                f"rs_thresholds needs one entry shared by all options or one per option "
                f"({len(options)} options: {options}), got {len(thresholds)}"
            )
        parsed = tuple(parse_rs_threshold(o, t) for o, t in zip(options, thresholds))
        return tuple(options), parsed

    def __hash__(self) -> int:
        """Hashable as before ``rules`` (a mapping) was a field: the rules count by their names."""
        return hash(tuple(frozenset(self.rules) if f.name == "rules" else getattr(self, f.name) for f in fields(self)))

    # ---- derived views -------------------------------------------------------------------------
    @property
    def applies_weights(self) -> bool:
        """True when ``compute_correction`` returns weights for the loss (bypass + ppo_clip never does)."""
        return self.is_level is not None and not (self.mode == "bypass" and self.loss_type == "ppo_clip")

    # ---- plain data ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, floats, strings) that round-trips through YAML / JSON."""
        out = asdict(self)
        out["rs"] = list(self.rs)
        out["rs_thresholds"] = [list(t) if isinstance(t, tuple) else t for t in self.rs_thresholds]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CorrectionConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"CorrectionConfig.from_dict needs a mapping, got {type(data).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"unknown CorrectionConfig keys {unknown}; allowed: {allowed}")
        return cls(**dict(data))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> CorrectionConfig:
        """Bounded YAML (``rollcorr.config.yaml_io``: aliases, depth, size; a key twice is refused)."""
        from rollcorr.config.yaml_io import load_yaml

        return cls.from_dict(load_yaml(text, "CorrectionConfig YAML") or {})

    def replace(self, **changes: Any) -> CorrectionConfig:
        return CorrectionConfig.from_dict({**self.to_dict(), **changes})
