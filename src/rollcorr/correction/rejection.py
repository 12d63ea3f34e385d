"""Rejection (docs/spec.md §3): masks, not weights. Every rule returns a keep mask; rules combine with AND.

Per-token statistics from ℓ (clamped): k1 = −ℓ, k2 = ½ℓ², k3 = e^ℓ − 1 − ℓ. verl options:

    token_k{1,2,3}      the token statistic
    seq_sum_k{1,2,3}    Σ_t k   (seq_sum_k1 = −log Π ρ_t)
    seq_mean_k{1,2,3}   mean_t k (seq_mean_k1 = −log ρ_geo: Geo-RS)
    seq_max_k{2,3}      max_t k

K1 bounds a **ratio** window [lo, hi]: keep lo ≤ ρ ≤ hi (product for seq_sum, geometric mean for seq_mean),
i.e. −log hi ≤ k1 ≤ −log lo. verl's code instead keeps log lo ≤ k1 ≤ log hi (``verl=True``), which inverts
asymmetric windows (verl PR #6377, never merged). k2/k3 thresholds are upper bounds.

Binary KL (AReaL ``RejectionSamplingConfig(metric="binary_kl")``, "KPop"): with p = π_old(y_t), q = μ(y_t) the
probabilities of the sampled token, each clamped to [1e-8, 1 − 1e-8], and
KL_b(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)) (the KL of the Bernoulli "this token or not"),

    bkl_t = max(KL_b(p‖q), KL_b(q‖p))        (symmetric: a token is out if either direction exceeds u)

with the same four levels (``token_binary_kl``, ``seq_sum_binary_kl``, ``seq_mean_binary_kl``,
``seq_max_binary_kl``) and an upper bound u, like k2/k3. It is 0 on padding and where p = q.

Beyond verl: veto (any ρ_t < C drops the row), outlier ceiling (any ρ_t > C), TRM (max k2 ≤ δ_max and
mean k3 ≤ δ_avg) and OPSM (drop iff A < 0 and mean_t(log μ − log π_θ) > δ).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rollcorr.correction.ratios import Rows, RSOutcome, Tokens, any_per_row, kl_stats

if TYPE_CHECKING:
    from rollcorr.config.correction import CorrectionConfig


def k1_bounds(window: tuple[float, float], verl: bool) -> tuple[float, float]:
    """Statistic-space bounds on k1 = −log ρ for a ratio window (lo, hi)."""
    lo, hi = window
    return (math.log(lo), math.log(hi)) if verl else (-math.log(hi), -math.log(lo))


BINARY_KL_EPS = 1e-8


def split_option(option: str) -> tuple[str, str]:
    """``"seq_mean_k3"`` → ``("seq_mean", "k3")``; ``"token_binary_kl"`` → ``("token", "binary_kl")``."""
    if option.endswith("_binary_kl"):
        return option[: -len("_binary_kl")], "binary_kl"
    kind, stat = option.rsplit("_", 1)
    return kind, stat


def binary_kl(log_p: Tensor, log_q: Tensor, eps: float = BINARY_KL_EPS) -> Tensor:
    """KL_b(p‖q) = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)) elementwise, p and 1 − p clamped to [eps, 1 − eps].

    1 − p is computed as −expm1(log p): in float32, 1 − 1e-8 rounds to 1, and AReaL's 1 − clamp(p) would give
    0·log(0/0) = NaN for a token of probability ≈ 1 (e.g. on zero padding). Same value otherwise."""
    p, q = log_p.exp().clamp(eps, 1.0 - eps), log_q.exp().clamp(eps, 1.0 - eps)
    p_bar, q_bar = (-log_p.expm1()).clamp(eps, 1.0 - eps), (-log_q.expm1()).clamp(eps, 1.0 - eps)
    return p * (p / q).log() + p_bar * (p_bar / q_bar).log()


def rs_statistic(option: str, tok: Tokens) -> Tensor:
    """The per-token statistic (B, T) an RS option thresholds, 0 on padding: k1 = −ℓ, k2 = ½ℓ², k3 = ρ − 1 − ℓ
    (from the clamped ℓ) or the symmetric binary KL max(KL_b(p_old‖p_μ), KL_b(p_μ‖p_old))."""
    stat = split_option(option)[1]
    if stat != "binary_kl":
        return kl_stats(tok, stat)
    # tok.anchor / tok.rollout are 0 on padding: p = q there, so the statistic is exactly 0
    return torch.maximum(binary_kl(tok.anchor, tok.rollout), binary_kl(tok.rollout, tok.anchor))


def _row_max(x: Tensor, tok: Tokens) -> Tensor:
    """Masked row max; 0 for all-padding rows (verl's convention)."""
    m = tok.valid_max(x, dim=-1)
    return torch.where(tok.valid, m, torch.zeros_like(m))


def rs_option(
    option: str,
    threshold: float | tuple[float, float],
    x: Tensor | None,
    tok: Rows,
    *,
    row_sum: Tensor | None = None,
    row_max: Tensor | None = None,
) -> RSOutcome:
    """Apply one RS option to its per-token statistic ``x`` (k1, k2, k3 or binary KL; 0 on padding).
    ``seq_sum`` / ``seq_mean`` options need only Σ_t x: pass it as ``row_sum`` (B,) and ``x=None`` to skip
    building x (e.g. Σ_t k1 = −Σ_t ℓ, bit-identical since negation is exact); ``seq_max`` options likewise
    take the (B,) masked row max as ``row_max``. Sequence options then need only ``Rows``; token options
    need the ``Tokens``."""
    kind, k = split_option(option)
    if k == "k1":
        lower, upper = k1_bounds(threshold, tok.verl)  # type: ignore[arg-type]
    else:
        lower, upper = None, float(threshold)  # type: ignore[arg-type]

    def inside(v: Tensor) -> Tensor:
        keep = v <= upper
        return keep & (v >= lower) if lower is not None else keep

    if kind in ("seq_sum", "seq_mean") and row_sum is None:
        row_sum = x.sum(dim=-1)
    if kind == "token":
        return RSOutcome(option, inside(x), None, x, tok.row_mean(x), lower, upper)
    if kind == "seq_sum":
        row = row_sum
    elif kind == "seq_mean":
        row = tok.row_mean_of_sum(row_sum)
    elif kind == "seq_max":
        row = _row_max(x, tok) if row_max is None else torch.where(tok.valid, row_max, 0.0)
    else:  # config validation makes this unreachable
        raise ValueError(f"unknown rs option {option!r}")
    return RSOutcome(option, None, inside(row), None, row, lower, upper)


def veto_keep(tok: Tokens, floor: float | None, ceiling: float | None) -> tuple[Tensor, Tensor]:
    """(row keep (B,), per-token catastrophic flags (B, T)): a row is dropped if any valid ρ_t < floor or
    > ceiling. Compared in log space on the unclamped ℓ."""
    bad = torch.zeros_like(tok.mask)
    for limit, hit in ((floor, torch.lt), (ceiling, torch.gt)):
        if limit is not None:
            bad |= hit(tok.log_ratio, math.log(limit))
    bad &= tok.mask
    return ~any_per_row(bad), bad


def trm_keep(
    row_max_k2: Tensor, row_mean_k3: Tensor, valid: Tensor, max_k2: float | None, mean_k3: float | None
) -> Tensor:
    """Trust-region masking: keep a row iff max_t k2_t ≤ δ_max and mean_t k3_t ≤ δ_avg (either may be off),
    from the (B,) row max of k2 and row mean of k3. Returns the (B,) row keep."""
    keep = torch.ones_like(valid)
    if max_k2 is not None:
        keep = keep & (row_max_k2 <= max_k2)
    if mean_k3 is not None:
        keep = keep & (row_mean_k3 <= mean_k3)
    return keep


def opsm_keep(
    rollout_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, tok: Tokens, delta: float
) -> tuple[Tensor, Tensor]:
    """OPSM (DeepSeek-V3.2): drop a row iff A < 0 and mean_t(log μ − log π_θ) > δ.
    ``advantages`` is (B,) or (B, T) (then its masked row mean is the row's advantage).
    Returns (row keep, row divergence)."""
    diff = torch.where(tok.mask, rollout_log_prob.to(tok.dtype) - log_prob.to(tok.dtype), 0.0)
    row_div = tok.row_mean(diff)
    adv = advantages.to(tok.dtype)
    if adv.dim() == 2:
        adv = tok.row_mean(torch.where(tok.mask, adv, 0.0))
    return (adv >= 0) | (row_div <= delta), row_div


# ----------------------------------------------------------------------------------------------- the rule list


@dataclass(frozen=True)
class RuleOutcome:
    """One rejection rule of a config applied alone. Exactly one of ``token_keep`` / ``row_keep`` is set.

    rule: the RS option name, ``veto`` (ρ floor), ``veto_upper`` (ρ ceiling), ``trm_max_k2``, ``trm_mean_k3``
    or ``opsm``. stat: what the rule compares, (B, T) for token rules and (B,) for sequence rules, in the
    statistic's own space (RS: k1/k2/k3/binary KL; veto: ℓ; TRM: row max k2 / row mean k3; OPSM: row mean of
    log μ − log π_θ). lower / upper: its bounds there (None = unbounded). threshold: the configured value
    (RS: as in ``rs_thresholds``; veto: the ρ floor / ceiling; TRM, OPSM: δ). rs: the RS outcome (RS rules).
    flags: (B, T) tokens that trip a veto. trm: (row max k2, row mean k3) for the TRM metrics.
    """

    rule: str
    token_keep: Tensor | None
    row_keep: Tensor | None
    stat: Tensor
    lower: float | None
    upper: float | None
    threshold: float | tuple[float, float]
    rs: RSOutcome | None = None
    flags: Tensor | None = None
    trm: tuple[Tensor, Tensor] | None = None
    kind: str = ""  # the kind of rule (``Rule.kind``) that produced it


# ------------------------------------------------------------------------------------- per-row statistics
class Statistics:
    """Where the rules read their statistics: per-row reductions (``row_sum`` / ``row_max`` of k1, k2, k3 over
    valid tokens, named ``sum_k1`` … ``max_k3``) and, for rules that need them, the (B, T) tokens.

    This source computes them from the ``Tokens`` (``analyze`` uses it); ``statistics.BatchStatistics`` is
    ``compute_correction``'s, holding the reductions a configuration's rules declare from one pass over the batch
    and building the tokens only for a rule that reads them. ``rows``: the batch's ``Rows``."""

    def __init__(self, tok: Tokens, k3: Tensor | None = None) -> None:
        self.tok, self.rows, self._token = tok, tok, {} if k3 is None else {"k3": k3}

    def token(self, stat: str) -> Tensor:
        """(B, T) k1 / k2 / k3 (clamped ℓ) or the symmetric binary KL, 0 on padding."""
        if stat not in self._token:
            self._token[stat] = rs_statistic(f"token_{stat}", self.tok)
        return self._token[stat]

    def row_sum(self, stat: str) -> Tensor:
        """(B,) Σ_t over valid tokens (Σ_t k1 = −Σ_t ℓ_c: no (B, T) statistic needed)."""
        if stat == "k1":
            return -self.tok.log_ratio_safe.sum(dim=-1)
        return self.token(stat).sum(dim=-1)

    def row_max(self, stat: str) -> Tensor:
        """(B,) max_t over valid tokens, 0 for rows without one."""
        return _row_max(self.token(stat), self.tok)


# ------------------------------------------------------------------------------------------ the rule list
@dataclass(frozen=True)
class Rule:
    """One kind of rejection rule, declared once: ``rejection_rules`` applies every registered kind, for the
    default statistics and the compiled kernel's alike.

    instances(config) → [(rule name, threshold), …] the instances ``config`` sets (none: the rule is off). A
    built-in rule answers through ``active(config)``, which reads its ``CorrectionConfig`` fields; a rule
    registered from outside leaves ``active`` out and is on only where the config names it,
    ``config.rules[kind]`` (chosen by name, as a loss is): one instance named ``kind`` whose threshold is
    ``options(config.rules[kind])`` — the rule's own options, checked there (a ValueError says what is wrong) —
    or the options mapping itself when the rule has no ``options``.
    reductions(name, threshold) → the per-row reductions the instance reads (``sum_k1``, ``sum_k2``,
    ``sum_k3``, ``max_k2``, ``max_k3``) that the statistics pass computes for it, or None when it reads the
    (B, T) tokens instead (``Statistics.token`` / ``tok``, built on first use).
    apply(name, threshold, statistics, context) → ``RuleOutcome`` (context: log_prob, advantages).
    metrics(outcomes, rows) → its metrics (the rule's metric kind), from its instances' outcomes.
    """

    kind: str
    active: Callable[[CorrectionConfig], list[tuple[str, Any]]] | None = field(default=None, kw_only=True)
    reductions: Callable[[str, Any], frozenset[str] | None]
    apply: Callable[[str, Any, Statistics, dict[str, Tensor | None]], RuleOutcome]
    metrics: Callable[[list[RuleOutcome], Rows], dict[str, Tensor]]
    options: Callable[[Mapping[str, Any]], Any] | None = field(default=None, kw_only=True)

    @property
    def by_name(self) -> bool:
        """A rule from outside: on only where ``config.rules`` names it."""
        return self.active is None

    def instances(self, config: CorrectionConfig) -> list[tuple[str, Any]]:
        """[(rule name, threshold), …]: the instances ``config`` sets, none when the rule is off."""
        if self.active is not None:
            return self.active(config)
        if self.kind not in config.rules:
            return []
        options = config.rules[self.kind]
        if self.options is None:
            return [(self.kind, options)]
        try:
            return [(self.kind, self.options(options))]
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"rules.{self.kind}: {err}") from None


RULES: list[Rule] = []  # in the order they are applied and reported


def rejects(config: CorrectionConfig) -> bool:
    """Whether ``config`` sets any rejection rule: one registered rule with an active instance (``RULES`` is
    the one place that knows, built-in rules and registered ones alike)."""
    return any(rule.instances(config) for rule in RULES)


def check_rules(config: CorrectionConfig) -> None:
    """ValueError naming a rule ``config.rules`` names that is no rule registered from outside (a misspelt name,
    a plugin not imported, a built-in rule — set by its own fields), or options its rule refuses."""
    by_kind = {rule.kind: rule for rule in RULES}
    for name in config.rules:
        rule = by_kind.get(name)
        if rule is None or not rule.by_name:
            outside = sorted(kind for kind, r in by_kind.items() if r.by_name)
            why = "a built-in rule, set by its own fields" if rule is not None else "no registered rule"
            raise ValueError(f"rules: {name!r} is {why}; rules registered from outside: {outside or 'none'} (a "
                             "plugin registers one: docs/plugins.md)")
        rule.instances(config)  # its options, parsed by the rule


def register_rule(rule: Rule) -> Rule:
    """Add a kind of rejection rule (after the built-in ones). Returns it. A rule from outside (no ``active``)
    is on only where a config names it (``CorrectionConfig.rules``), never by being registered."""
    if any(r.kind == rule.kind for r in RULES):
        raise ValueError(f"a rejection rule of kind {rule.kind!r} is already registered")
    RULES.append(rule)
    return rule


def declared_reductions(config: CorrectionConfig) -> frozenset[str]:
    """The per-row reductions the rules of ``config`` declare (those that read the (B, T) tokens declare none:
    they read ``Statistics.token`` / ``tok``)."""
    needed: set[str] = set()
    for rule in RULES:
        for name, threshold in rule.instances(config):
            needed |= rule.reductions(name, threshold) or set()
    return frozenset(needed)


def rejection_rules(
    config: CorrectionConfig,
    source: Tokens | Statistics,
    *,
    k3: Tensor | None = None,
    log_prob: Tensor | None = None,
    advantages: Tensor | None = None,
) -> list[RuleOutcome]:
    """Every rejection rule ``config`` sets, each applied alone, in order (``RULES``: the RS options, veto
    floor, veto ceiling, TRM max k2, TRM mean k3, OPSM, then any registered later); each outcome names its
    ``kind``. ``compute_correction`` ANDs their keeps into the mask; ``analyze`` explains each. source: the
    ``Tokens`` (or a ``Statistics``: a batch's, from the statistics pass). k3: ``kl_stats(tok, "k3")`` if already
    built. log_prob: π_θ for OPSM (default: the anchor). advantages: (B,) or (B, T), needed by OPSM."""
    if config.rules:
        check_rules(config)  # a rule named but not registered would otherwise be silently off
    stats = source if not isinstance(source, Tokens) else Statistics(source, k3)
    context = {"log_prob": log_prob, "advantages": advantages}
    return [
        dataclasses.replace(rule.apply(name, threshold, stats, context), kind=rule.kind)
        for rule in RULES
        for name, threshold in rule.instances(config)
    ]


def rule_metrics(outcomes: list[RuleOutcome], rows: Rows) -> dict[str, Tensor]:
    """Each rule kind's metrics (its ``Rule.metrics``) from its instances' outcomes."""
    out: dict[str, Tensor] = {}
    for rule in RULES:
        mine = [outcome for outcome in outcomes if outcome.kind == rule.kind]
        if mine:
            out.update(rule.metrics(mine, rows))
    return out


# ---- the built-in rules ---------------------------------------------------------------------------------
def _rs_apply(option: str, threshold: Any, stats: Statistics, context: dict) -> RuleOutcome:
    kind, stat = split_option(option)
    if kind == "token":
        r = rs_option(option, threshold, stats.token(stat), stats.tok)  # token rules read the (B, T) tokens
    else:
        r = rs_option(
            option, threshold, None, stats.rows,
            row_sum=stats.row_sum(stat) if kind in ("seq_sum", "seq_mean") else None,
            row_max=stats.row_max(stat) if kind == "seq_max" else None,
        )
    stat_value = r.token_stat if r.token_keep is not None else r.row_stat
    return RuleOutcome(option, r.token_keep, r.row_keep, stat_value, r.lower, r.upper, threshold, rs=r)


def _rs_reductions(option: str, threshold: Any) -> frozenset[str] | None:
    kind, stat = split_option(option)
    if kind == "token" or stat == "binary_kl":
        return None
    return frozenset({f"{'max' if kind == 'seq_max' else 'sum'}_{stat}"})


def _rs_metrics(outcomes: list[RuleOutcome], rows: Rows) -> dict[str, Tensor]:
    from rollcorr.correction.metrics import rs_option_metrics

    out: dict[str, Tensor] = {}
    for o in outcomes:
        out.update(rs_option_metrics(o.rs, rows))
    return out


def _veto_active(config: CorrectionConfig) -> list[tuple[str, Any]]:
    limits = (("veto", config.veto_threshold), ("veto_upper", config.veto_upper))
    return [(name, limit) for name, limit in limits if limit is not None]


def _veto_apply(name: str, limit: float, stats: Statistics, context: dict) -> RuleOutcome:
    floor, ceiling = (limit, None) if name == "veto" else (None, limit)
    keep, bad = veto_keep(stats.tok, floor, ceiling)
    bound = math.log(limit)
    lower, upper = (bound, None) if floor is not None else (None, bound)
    return RuleOutcome(name, None, keep, stats.tok.log_ratio, lower, upper, limit, flags=bad)


def _veto_metrics(outcomes: list[RuleOutcome], rows: Rows) -> dict[str, Tensor]:
    """The floor and the ceiling are reported together."""
    keep, flags = outcomes[0].row_keep, outcomes[0].flags
    for o in outcomes[1:]:
        keep, flags = keep & o.row_keep, flags | o.flags
    return {
        "veto_token_fraction": rows.token_share(flags),
        "veto_seq_fraction": rows.over_rows((~keep & rows.valid).to(rows.dtype)),
    }


def _trm_active(config: CorrectionConfig) -> list[tuple[str, Any]]:
    return [(name, v) for name, v in (("trm_max_k2", config.trm_max_k2), ("trm_mean_k3", config.trm_mean_k3))
            if v is not None]


def _trm_apply(name: str, delta: float, stats: Statistics, context: dict) -> RuleOutcome:
    rows = stats.rows
    trm = (stats.row_max("k2"), rows.row_mean_of_sum(stats.row_sum("k3")))
    max_k2, mean_k3 = (delta, None) if name == "trm_max_k2" else (None, delta)
    keep = trm_keep(*trm, rows.valid, max_k2, mean_k3)
    stat = trm[0] if max_k2 is not None else trm[1]
    return RuleOutcome(name, None, keep, stat, None, delta, delta, trm=trm)


def _trm_metrics(outcomes: list[RuleOutcome], rows: Rows) -> dict[str, Tensor]:
    """Max k2 and mean k3 are reported together."""
    keep = outcomes[0].row_keep
    for o in outcomes[1:]:
        keep = keep & o.row_keep
    row_max_k2, row_mean_k3 = outcomes[-1].trm
    return {
        "trm_seq_masked_fraction": rows.over_rows((~keep & rows.valid).to(rows.dtype)),
        "trm_max_k2_max": rows.rows_max(row_max_k2),
        "trm_mean_k3_max": rows.rows_max(row_mean_k3),
    }


def _opsm_apply(name: str, delta: float, stats: Statistics, context: dict) -> RuleOutcome:
    advantages = context["advantages"]
    if advantages is None:
        raise ValueError("opsm_delta is set: OPSM needs advantages")
    tok = stats.tok
    pi_theta = context["log_prob"] if context["log_prob"] is not None else tok.anchor
    keep, row_div = opsm_keep(tok.rollout, pi_theta, advantages, tok, delta)
    return RuleOutcome(name, None, keep, row_div, None, delta, delta)


def _opsm_metrics(outcomes: list[RuleOutcome], rows: Rows) -> dict[str, Tensor]:
    (o,) = outcomes
    return {
        "opsm_seq_masked_fraction": rows.over_rows((~o.row_keep & rows.valid).to(rows.dtype)),
        "opsm_divergence_mean": rows.over_rows(o.stat),
    }


register_rule(Rule("rs", _rs_reductions, _rs_apply, _rs_metrics,
                   active=lambda c: list(zip(c.rs, c.rs_thresholds))))
register_rule(Rule("veto", lambda name, limit: None, _veto_apply, _veto_metrics, active=_veto_active))
register_rule(Rule("trm", lambda name, delta: frozenset({"max_k2", "sum_k3"}), _trm_apply, _trm_metrics,
                   active=_trm_active))
register_rule(Rule("opsm", lambda name, delta: None, _opsm_apply, _opsm_metrics,
                   active=lambda c: [] if c.opsm_delta is None else [("opsm", c.opsm_delta)]))
