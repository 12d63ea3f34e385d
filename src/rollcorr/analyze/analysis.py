"""Apply a correction config to a dump and explain it: what is rejected and why (no rendering here:
``rollcorr.analyze.render`` prints and writes an ``Analysis``).

``analyze(dump, config)`` runs ``compute_correction`` once for the weights, mask and metrics, then takes the
config's rules one by one from the list ``compute_correction`` ANDs (``rollcorr.correction.rejection.
rejection_rules``) to say which rule removed which sequence or token, with the statistic and the threshold. The
union of the findings is checked against the mask ``compute_correction`` returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollcorr.analyze.dumps import Dump
from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction import compute_correction, metrics_to_floats
from rollcorr.correction.ratios import kl_stats, make_tokens
from rollcorr.correction.rejection import rejection_rules
from rollcorr.correction.weights import apply_threshold, raw_weights

# statistic shown for each RS option; K1 statistics are shown as ratios (ρ = exp(−k1)), k3 = ρ − 1 − ℓ
STATISTICS = {
    "token_k1": "ρ_t",
    "seq_sum_k1": "Π ρ_t",
    "seq_mean_k1": "geo-mean ρ",
    "token_k2": "½ℓ_t²",
    "token_k3": "k3_t",
    "seq_sum_k2": "Σ ½ℓ²",
    "seq_sum_k3": "Σ k3",
    "seq_mean_k2": "mean ½ℓ²",
    "seq_mean_k3": "mean k3",
    "seq_max_k2": "max ½ℓ²",
    "seq_max_k3": "max k3",
    "token_binary_kl": "bkl_t",
    "seq_sum_binary_kl": "Σ bkl",
    "seq_mean_binary_kl": "mean bkl",
    "seq_max_binary_kl": "max bkl",
}


@dataclass(frozen=True)
class Finding:
    """One sequence or token that a rule removes (rejection) or zeroes (IcePop / Seq-MIS weight mask).

    ``position`` is the token for token rules, and the most mismatched token (largest |ℓ|) of the row for
    sequence rules. ``excess`` ≥ 1 says how far outside the threshold the statistic is (ratio), for ranking.
    """

    row: int
    line: int
    rule: str
    level: str  # "sequence" | "token"
    position: int
    token: str | None
    statistic: str
    value: float
    threshold: str  # the kept range, e.g. "[0.999, 1.001]" or "≤ 0.01"
    lower: float | None  # its bounds, in the statistic's units (None = unbounded)
    upper: float | None
    excess: float
    tokens: int  # valid tokens removed by this finding
    effect: str  # "rejected" (mask) | "zero weight" (IS mask)


@dataclass(frozen=True)
class RuleSummary:
    """One rule on its own: the range it keeps, what it removes, and the statistic's observed spread
    (5th / 50th / 95th percentile over valid sequences or tokens) to compare the range with."""

    rule: str
    statistic: str
    threshold: str
    level: str
    effect: str
    sequences: int
    tokens: int
    observed: tuple[float, float, float]


def _spread(values: Tensor, valid: Tensor) -> tuple[float, float, float]:
    x = values[valid].double()
    return tuple(torch.quantile(x, torch.tensor([0.05, 0.5, 0.95], dtype=x.dtype)).tolist())


@dataclass
class Analysis:
    """A dump with a config applied: the metrics (floats), applied weights, mask after rejection, the
    findings and per-rule summaries that explain them, and notes (stand-ins used, warnings)."""

    dump: Dump
    config: CorrectionConfig
    source: str
    metrics: dict[str, float]
    is_weights: Tensor | None  # (B, T) or None
    kept_mask: Tensor  # (B, T) bool after rejection
    findings: list[Finding]
    rules: list[RuleSummary]
    notes: list[str] = field(default_factory=list)

    @property
    def rejected_tokens(self) -> int:
        return int((self.dump.response_mask & ~self.kept_mask).sum())

    @property
    def rejected_sequences(self) -> int:
        return int((self.dump.response_mask & ~self.kept_mask).any(dim=-1).sum())


ALL_REJECTED = (
    "the correction rejects every token of this dump ({tokens} tokens in {seqs} sequences): a training step "
    "on it would have a zero loss and an exactly-zero gradient. Its thresholds are tighter than this "
    "mismatch; widen them or choose a looser preset (docs/configuration.md, Presets)."
)


def analyze(dump: Dump, config: CorrectionConfig, source: str = "") -> Analysis:
    """Run the correction on the dump and explain every rejection and zeroed weight."""
    notes: list[str] = []
    # Bypass mode needs π_θ (ratio π_θ/μ); a dump's learner log-probs are the only learner numbers there are,
    # so they stand in for it (exact on the first mini-batch of a step). OPSM in decoupled mode uses π_old.
    log_prob = dump.old_log_prob if config.mode == "bypass" else None
    if log_prob is not None:
        notes.append(f"bypass mode: the dump's learner log-probs ({dump.fields['learner']}) stand in for π_θ")
    if config.opsm_delta is not None and dump.advantages is None and "advantages" in dump.partial:
        missing = dump.partial["advantages"]
        raise ValueError(
            f"the config uses OPSM (opsm_delta), which needs advantages in every row, but {len(missing)} of "
            f"{len(dump)} rows have no {dump.fields.get('advantages', 'advantages')!r} (line "
            f"{', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''})"
        )
    if config.opsm_delta is not None and dump.advantages is None:
        raise ValueError(
            "the config uses OPSM (opsm_delta), which needs advantages, but the dump has no "
            f"{dump.fields.get('advantages', 'advantages')!r} field (name it with --advantages-field)"
        )
    version = current_version = None
    if dump.version is not None:
        version = dump.version
        current_version = int(dump.version.masked_fill(~dump.response_mask, -(2**62)).max())
        if int(dump.version.masked_fill(~dump.response_mask, 2**62).min()) != current_version:
            notes.append(f"staleness is measured against the newest version in the dump ({current_version})")
    res = compute_correction(
        dump.old_log_prob,
        dump.rollout_log_prob,
        dump.response_mask,
        config,
        log_prob=log_prob,
        advantages=dump.advantages,
        version=version,
        current_version=current_version,
        warn=False,  # said below, in the report's words
    )
    mask = res.kept_mask.bool()
    if config.rejects and dump.num_tokens > 0 and not mask.any():
        notes.insert(0, f"warning: {ALL_REJECTED.format(tokens=dump.num_tokens, seqs=len(dump))}")
    findings, rules = explain(dump, config, res.is_weights)
    explained = torch.zeros_like(mask)
    for f in findings:
        if f.effect != "rejected":
            continue
        if f.level == "token":
            explained[f.row, f.position] = True
        else:
            explained[f.row] = dump.response_mask[f.row]
    if not torch.equal(explained, dump.response_mask & ~mask):
        notes.append(
            "warning: the per-rule explanation does not match the correction's mask "
            f"({int(explained.sum())} vs {int((dump.response_mask & ~mask).sum())} rejected tokens)"
        )
    return Analysis(
        dump, config, source, metrics_to_floats(res.metrics), res.is_weights, mask, findings, rules, notes
    )


def fmt(x: float) -> str:
    """A number as shown in reports: 4 significant digits (ints as they are)."""
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def exp_or_inf(x: float) -> float:
    """math.exp that gives inf instead of raising for x > 709 (vLLM writes -9999.0 for a -inf log-prob)."""
    return math.exp(x) if x < 709.0 else math.inf


def kept_range(lo: float | None, hi: float | None) -> str:
    """The range a rule keeps, as text: "≤ hi", "≥ lo" or "[lo, hi]"."""
    if lo is None or lo == 0:
        return f"≤ {fmt(hi)}"
    if hi is None or math.isinf(hi):
        return f"≥ {fmt(lo)}"
    return f"[{fmt(lo)}, {fmt(hi)}]"


def _outside(value: float, lo: float | None, hi: float | None) -> float:
    """How far ``value`` lies outside [lo, hi] as a ratio (≥ 1 when outside; inf for a zero value)."""
    out = 1.0
    if hi is not None and hi > 0 and value > hi:
        out = value / hi
    if lo is not None and lo > 0 and value < lo:
        out = lo / value if value > 0 else math.inf
    return out


def explain(
    dump: Dump, config: CorrectionConfig, weights: Tensor | None
) -> tuple[list[Finding], list[RuleSummary]]:
    """Findings (every rejected / zeroed sequence or token, with its rule) and a per-rule summary.

    Each rule runs alone through the correction library's rule functions on ℓ = log π_old − log μ (in bypass
    mode the dump's learner log-probs are π_θ, so the same ℓ). ``weights`` are the applied IS weights.
    """
    tok = make_tokens(
        dump.old_log_prob,
        dump.rollout_log_prob,
        dump.response_mask,
        bound=config.safety_bound,
        verl=config.verl_compat,
    )
    k2, k3 = kl_stats(tok, "k2"), kl_stats(tok, "k3")
    worst = tok.log_ratio.abs().masked_fill(~tok.mask, -1.0).argmax(dim=-1).tolist()
    lengths = tok.mask.sum(dim=-1).tolist()
    findings: list[Finding] = []
    rules: list[RuleSummary] = []

    def token_text(b: int, t: int) -> str | None:
        if dump.token_text is not None:
            return dump.token_text[b][t]
        if dump.tokens is not None:
            return f"id {int(dump.tokens[b, t])}"
        return None

    def finding(b, t, level, rule, statistic, value, threshold, lo, hi, tokens, effect) -> Finding:
        return Finding(
            row=b,
            line=dump.line_numbers[b],
            rule=rule,
            level=level,
            position=t,
            token=token_text(b, t),
            statistic=statistic,
            value=value,
            threshold=threshold,
            lower=lo,
            upper=hi,
            excess=_outside(value, lo, hi),
            tokens=tokens,
            effect=effect,
        )

    def add_rows(rule, statistic, threshold, drop, values, lo, hi, *, positions=None, effect="rejected"):
        """One finding per valid row in ``drop`` (B,) bool; ``values`` (B,) is the statistic shown;
        ``positions`` (B,) the token to name (default: the row's largest |ℓ|)."""
        rows = (drop & tok.valid).nonzero()[:, 0].tolist()
        shown = values.tolist()
        for b in rows:
            t = worst[b] if positions is None else positions[b]
            findings.append(
                finding(b, t, "sequence", rule, statistic, shown[b], threshold, lo, hi, lengths[b], effect)
            )
        removed = sum(lengths[b] for b in rows)
        observed = _spread(values, tok.valid)
        rules.append(
            RuleSummary(rule, statistic, threshold, "sequence", effect, len(rows), removed, observed)
        )

    def add_tokens(rule, statistic, threshold, drop, values, lo, hi, *, effect="rejected"):
        """One finding per valid token in ``drop`` (B, T) bool; ``values`` (B, T) is the statistic shown."""
        idx = (drop & tok.mask).nonzero().tolist()
        for b, t in idx:
            findings.append(
                finding(b, t, "token", rule, statistic, float(values[b, t]), threshold, lo, hi, 1, effect)
            )
        hit_rows = len({b for b, _ in idx})
        observed = _spread(values, tok.mask)
        rules.append(RuleSummary(rule, statistic, threshold, "token", effect, hit_rows, len(idx), observed))

    for rule in rejection_rules(config, tok, k3=k3, advantages=dump.advantages):
        name, drop = rule.rule, ~rule.row_keep if rule.row_keep is not None else ~rule.token_keep
        if rule.rs is not None:
            r = rule.rs
            if name.endswith("k1"):  # statistic space k1 = −log ρ → show ratios
                lo, hi = exp_or_inf(-r.upper), exp_or_inf(-r.lower)
                shown = torch.exp(-rule.stat)
            else:
                lo, hi, shown = None, r.upper, rule.stat
            if r.token_keep is not None:
                add_tokens(name, STATISTICS[name], kept_range(lo, hi), drop, shown, lo, hi)
            else:
                add_rows(name, STATISTICS[name], kept_range(lo, hi), drop, shown, lo, hi)
        elif rule.flags is not None:  # veto: the row's smallest (floor) or largest (ceiling) ρ_t
            floor = rule.lower is not None
            ell = rule.stat.masked_fill(~tok.mask, math.inf if floor else -math.inf)
            value, pos = ell.min(dim=-1) if floor else ell.max(dim=-1)
            lo, hi = (rule.threshold, None) if floor else (None, rule.threshold)
            statistic, window = ("min ρ_t", f"≥ {fmt(lo)}") if floor else ("max ρ_t", f"≤ {fmt(hi)}")
            add_rows(name, statistic, window, drop, value.exp(), lo, hi, positions=pos.tolist())
        elif name == "trm_max_k2":
            pos = k2.masked_fill(~tok.mask, -1.0).argmax(dim=-1).tolist()
            add_rows(
                name, "max ½ℓ²", f"≤ {fmt(rule.upper)}", drop, rule.stat, None, rule.upper, positions=pos
            )
        else:
            statistic = {"trm_mean_k3": "mean k3", "opsm": "mean(log μ − log π_θ), A<0"}.get(name, name)
            add_rows(name, statistic, f"≤ {fmt(rule.upper)}", drop, rule.stat, None, rule.upper)

    if config.is_level is not None and config.is_mode == "mask" and weights is not None:
        raw, row_log = raw_weights(tok, config.is_level, config.safety_bound)
        masked = apply_threshold(raw, tok.mask_f, "mask", config.is_upper, config.is_lower)
        zeroed = (masked == 0) & (raw != 0) & tok.mask
        lo, hi = config.is_lower, config.is_upper
        name = {"token": "icepop", "sequence": "seq_mis", "geometric": "geo_mis"}[config.is_level]
        if config.is_level == "token":
            add_tokens(name, "ρ_t", kept_range(lo, hi), zeroed, raw, lo, hi, effect="zero weight")
        else:
            stat = "Π ρ_t" if config.is_level == "sequence" else "geo-mean ρ"
            add_rows(
                name,
                stat,
                kept_range(lo, hi),
                zeroed.any(dim=-1),
                row_log.exp(),
                lo,
                hi,
                effect="zero weight",
            )

    return findings, rules
