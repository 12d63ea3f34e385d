"""Show an ``Analysis`` (``rollcorr.analyze.analysis``): the terminal report (rich), the one-line summary
and the JSON file. Nothing is computed here beyond formatting.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.rule import Rule
from rich.table import Table

from rollcorr.analyze.analysis import STATISTICS, Analysis, exp_or_inf, fmt, kept_range
from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction.api import PREFIX
from rollcorr.correction.rejection import RULES, rejects
from rollcorr.dumps import display_name


def _fmt_against(value: float, lo: float | None, hi: float | None) -> str:
    """``value`` with enough digits to tell it apart from the bounds it is compared with."""
    for digits in range(4, 10):
        text = f"{value:.{digits}g}"
        if all(b is None or f"{b:.{digits}g}" != text for b in (lo, hi)):
            return text if 1e-3 <= abs(value) < 1e5 or value == 0 else f"{value:.{digits - 1}e}"
    return repr(value)


# ---- JSON -------------------------------------------------------------------------------------------
def to_json(analysis: Analysis, top: int | None = None) -> dict[str, Any]:
    """Plain data: file, config, counts, every metric, per-rule summary, findings (all, or the ``top``),
    furthest outside their range first."""
    dump = analysis.dump
    findings = []
    for f in analysis.findings.by_excess():
        if top is not None and len(findings) >= top:
            break
        findings.append({k: _finite_or_str(v) for k, v in asdict(f).items()})
    return {
        "file": str(dump.path),
        "config_source": analysis.source,
        "config": analysis.config.to_dict(),
        "fields": dump.fields,
        "rows": dump.total_rows,
        "responses": analysis.responses,
        "tokens": analysis.tokens,
        "rejected_tokens": analysis.rejected_tokens,
        "rejected_sequences": analysis.rejected_sequences,
        "metrics": {k: _finite_or_str(v) for k, v in analysis.metrics.items()},
        "rules": [asdict(r) for r in analysis.rules],
        "findings": findings,
        "malformed": [asdict(m) for m in dump.malformed],
        "notes": analysis.notes,
        **({"turns": analysis.turns} if analysis.turns is not None else {}),
    }


def _percent(share: float) -> str:
    """A share as a percentage with 2 significant digits, never in exponent form ("1e+02%")."""
    value = 100 * share
    return f"{value:.0f}%" if abs(value) >= 10 else f"{value:.2g}%"


def _finite_or_str(v: Any) -> Any:
    """JSON has no NaN / inf: write them as the strings "nan", "inf", "-inf"."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def write_json(analysis: Analysis, path: str | Path) -> None:
    """Write ``to_json`` atomically (temp file in the same directory, then rename); a FIFO, a device or
    ``/dev/stdout`` is written in place (``rollcorr.safe_io.write_output``)."""
    from rollcorr.safe_io import write_output

    text = json.dumps(to_json(analysis), indent=1, allow_nan=False) + "\n"
    write_output(path, text.encode())


# ---- terminal report --------------------------------------------------------------------------------
# (metric key without prefix, what it means) in the order shown; sections separate the groups
HEADLINE: list[tuple[str, list[tuple[str, str]]]] = [
    (
        "mismatch μ vs π_old",
        [
            ("log_ratio_abs_mean", "mean |ℓ|, ℓ = log π_old − log μ"),
            ("log_ratio_mean", "mean ℓ (signed; near 0 can hide a large |ℓ|)"),
            ("kl", "KL(μ‖π_old), k1 estimate (verl)"),
            ("k3_kl", "KL(μ‖π_old), k3 estimate (verl)"),
            ("policy_kl", "KL(π_old‖μ)"),
            ("js_divergence", "Jensen–Shannon per sampled token"),
            ("token_mult_prob_error", "mean exp(|ℓ|) (NeMo-RL)"),
            ("chi2_token", "χ² token (E ρ² − 1)"),
            ("chi2_seq", "χ² sequence"),
            ("log_ppl_abs_diff", "mean |log PPL_μ − log PPL_old| per response"),
            ("training_ppl", "learner perplexity"),
            ("rollout_ppl", "sampler perplexity"),
        ],
    ),
    (
        "probability space",
        [
            ("prob_diff_mean", "mean |p_μ − p_old|"),
            ("prob_diff_max", "max |p_μ − p_old|"),
            ("prob_diff_seq_max_mean", "per-response max |Δp|, averaged"),
            ("prob_diff_frac_lt_1e-3", "share of tokens |Δp| < 1e-3"),
            ("prob_diff_frac_ge_0.01", "share of tokens |Δp| ≥ 0.01"),
            ("prob_diff_frac_ge_0.05", "share of tokens |Δp| ≥ 0.05"),
            ("prob_diff_frac_ge_0.1", "share of tokens |Δp| ≥ 0.1"),
            ("prob_pearson", "Pearson corr(p_μ, p_old)"),
        ],
    ),
    (
        "importance weights",
        [
            ("rollout_is_mean", "mean weight"),
            ("rollout_is_std", "std of the weights"),
            ("rollout_is_min", "min weight"),
            ("rollout_is_max", "max weight"),
            ("rollout_is_eff_sample_size", "effective sample size (share)"),
            ("rollout_is_ratio_fraction_high", "share above the upper bound"),
            ("rollout_is_ratio_fraction_low", "share below the lower bound"),
            ("rollout_is_oob_ratio", "share outside the band (zeroed)"),
            ("rollout_is_batch_norm_factor", "batch normalisation divisor"),
        ],
    ),
    (
        "rejection",
        [
            ("rollout_rs_masked_fraction", "share of tokens rejected"),
            ("rollout_rs_seq_masked_fraction", "share of sequences with a rejected token"),
            ("veto_seq_fraction", "share of sequences vetoed"),
            ("trm_seq_masked_fraction", "share of sequences dropped by TRM"),
            ("opsm_seq_masked_fraction", "share of sequences dropped by OPSM"),
        ],
    ),
    (
        "staleness",
        [("staleness_mean", "mean version lag per token"), ("staleness_max", "max version lag")],
    ),
]


def describe(config: CorrectionConfig) -> str:
    """One line: mode, IS and every rejection rule of the config."""
    parts = [config.mode + (f" ({config.loss_type})" if config.mode == "bypass" else "")]
    if config.is_level is None:
        parts.append("no IS weights")
    else:
        bound = (
            kept_range(config.is_lower, config.is_upper)
            if config.is_upper or config.is_lower
            else "untruncated"
        )
        kind = "truncate" if config.is_mode == "truncate" else "mask"
        applied = "" if config.applies_weights else " (not applied: the PPO ratio already holds π_θ/μ)"
        parts.append(f"IS {config.is_level} {kind} {bound}{applied}")
        if config.batch_normalize:
            parts.append(f"batch-normalised per {config.batch_norm_scope}")
    for rule in RULES:  # the one rule list, in the order compute_correction applies it
        for name, threshold in rule.instances(config):
            parts.append(_describe_rule(name, threshold))
    if rejects(config):
        parts.append(f"loss denominator: {config.denominator}")
    if config.verl_compat:
        parts.append("verl-compatible formulas")
    return " · ".join(parts)


def _describe_rule(name: str, threshold) -> str:
    """One rejection rule in words (a rule registered later: its name and threshold)."""
    if name in STATISTICS and isinstance(threshold, tuple):
        return f"RS {name} {STATISTICS[name]} ∈ {kept_range(*threshold)}"
    if name in STATISTICS:
        return f"RS {name} {STATISTICS[name]} ≤ {fmt(threshold)}"
    words = {
        "veto": f"veto ρ_t < {fmt(threshold)}",
        "veto_upper": f"veto ρ_t > {fmt(threshold)}",
        "trm_max_k2": f"TRM max ½ℓ² ≤ {fmt(threshold)}",
        "trm_mean_k3": f"TRM mean k3 ≤ {fmt(threshold)}",
        "opsm": f"OPSM δ = {fmt(threshold)}",
    }
    return words.get(name, f"{name} {fmt(threshold) if isinstance(threshold, float) else threshold}")


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100.0 * part / max(whole, 1):.1f}%)"


def _snippet(text: str | None, width: int = 24) -> str:
    if text is None:
        return ""
    text = text.replace("\n", "⏎")
    return repr(text if len(text) <= width else text[: width - 1] + "…")


def _table(title: str, columns: dict[str, str], **column_kw: Any):
    """A borderless rich table; ``columns`` maps a header to its justification ("left" / "right")."""
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for name, justify in columns.items():
        table.add_column(name, justify=justify, **column_kw.get(name, {}))
    return table


def render(analysis: Analysis, console: Any, *, top: int = 8, all_metrics: bool = False) -> None:
    """Print the report with rich: header, diagnostics, what the config does, the sequences and tokens it
    hits, the most mismatched tokens, malformed rows, notes and a short summary."""
    parts = [
        _header(analysis),
        _diagnostics(analysis, all_metrics),
        _config_effect(analysis),
        _findings(analysis, top),
        _mismatched_tokens(analysis, top),
        _turns(analysis),
        _malformed(analysis, top),
    ]
    for renderables in parts:
        for item in renderables:
            console.print(item, highlight=False)
    for note in analysis.notes:
        style = "bold yellow" if note.startswith("warning:") else "dim"
        console.print(f"[{style}]{'' if style != 'dim' else 'note: '}{escape(note)}[/]", highlight=False)
    console.print()
    console.print(f"[bold]In short[/]: {escape(summary(analysis))}", highlight=False)


def _turns(analysis: Analysis) -> list[Any]:
    """The per-turn table of a multi-turn dump: each turn's tokens, mismatch and what the config does to it."""
    t = analysis.turns
    if t is None:
        return []
    weighted = any("weight_mean" in r for r in t["turns"])
    columns = {"turn": "right", "responses": "right", "tokens": "right", "|Δp| ≥ 0.01": "right", "mean |Δp|": "right",
               "k3": "right", "rejected": "right", **({"mean weight": "right"} if weighted else {})}
    table = _table(f"Per turn (turns from {t['turns_from']})", columns)
    for r in t["turns"]:
        table.add_row(str(r["turn"] + 1), str(r["responses"]), str(r["tokens"]), _percent(r["prob_diff_frac_ge_0.01"]),
                      fmt(r["prob_diff_mean"]), fmt(r["k3_kl"]), _percent(r["rejected_share"]),
                      *([fmt(r["weight_mean"])] if weighted else []))
    return ["", table]


def _source_name(path) -> str:
    """The dump as the header names it: its path, or "stdin"."""
    return "stdin" if str(path) == "-" else str(path)


def _header(analysis: Analysis) -> list[Any]:
    dump = analysis.dump
    skipped = f" · [yellow]{len(dump.malformed)} malformed row(s) skipped[/]" if dump.malformed else ""
    used = ", ".join(f"{role}={name}" for role, name in dump.fields.items())
    return [
        Rule(f"[bold]rollcorr analyze[/] · {escape(display_name(dump.path))}"),
        f"{analysis.responses} responses, {analysis.tokens} tokens from {escape(_source_name(dump.path))}{skipped}",
        f"[dim]fields: {escape(used)}[/]",
        f"config: [bold]{escape(analysis.source or 'custom')}[/] → {escape(describe(analysis.config))}",
    ]


def _diagnostics(analysis: Analysis, all_metrics: bool) -> list[Any]:
    metrics = analysis.metrics
    table = _table(
        "Diagnostics (rollout_corr/…)",
        {"metric": "left", "value": "right", "meaning": "left"},
        metric={"style": "cyan", "no_wrap": True},
        meaning={"style": "dim"},
    )
    shown: set[str] = set()
    for section, entries in HEADLINE:
        present = [(key, meaning) for key, meaning in entries if PREFIX + key in metrics]
        if section == "staleness" and not metrics.get(PREFIX + "staleness_max"):
            present = []  # a single weight version: nothing to say
        if not present:
            continue
        table.add_row(f"[bold]{section}[/]", "", "")
        for key, meaning in present:
            table.add_row("  " + key, fmt(metrics[PREFIX + key]), meaning)
            shown.add(PREFIX + key)
        table.add_section()
    rest = [key for key in metrics if key not in shown]
    if all_metrics and rest:
        table.add_row("[bold]all other metrics[/]", "", "")
        for key in rest:
            table.add_row("  " + key.removeprefix(PREFIX), fmt(metrics[key]), "")
    out: list[Any] = ["", table]
    if rest and not all_metrics:
        out.append(f"[dim]  … {len(rest)} more metrics with --all-metrics (or --json OUT)[/]")
    return out


def _config_effect(analysis: Analysis) -> list[Any]:
    """The IS weights and rejection in one line each, then the per-rule table."""
    config, metrics = analysis.config, analysis.metrics
    n_rows, n_tokens = analysis.responses, analysis.tokens
    out: list[Any] = [""]
    if analysis.weights is not None:
        mean, low, high = analysis.weights
        spread = f"applied weights mean {fmt(mean)}, range [{fmt(low)}, {fmt(high)}]"
        head = ""
        if config.is_mode == "mask":  # rollout_is_oob_ratio is a share of tokens at every level
            share = metrics.get(PREFIX + "rollout_is_oob_ratio", 0.0)
            band = kept_range(config.is_lower, config.is_upper)
            head = f"{_percent(share)} of tokens zeroed (outside {band}); "
        elif config.is_upper is not None:  # ..._fraction_high counts tokens, or rows at sequence levels
            share = metrics.get(PREFIX + "rollout_is_ratio_fraction_high", 0.0)
            unit = "tokens" if config.is_level == "token" else "sequences"
            head = f"{_percent(share)} of {unit} truncated to {fmt(config.is_upper)}; "
        out.append(f"[bold]IS weights[/]: {head}{spread}")
    elif config.is_level is not None:
        out.append("[bold]IS weights[/]: computed for the metrics but not applied (bypass + ppo_clip)")
    if rejects(config):
        out.append(
            f"[bold]Rejection[/]: {_pct(analysis.rejected_tokens, n_tokens)} tokens in "
            f"{_pct(analysis.rejected_sequences, n_rows)} sequences would be masked out of the loss "
            f"(denominator: {config.denominator})"
        )
    elif not analysis.rules:
        out.append("[bold]Rejection[/]: none configured (no RS / veto / TRM / OPSM); nothing is masked")
    if analysis.rules:
        right = ("sequences hit", "tokens hit")
        columns = ("rule", "statistic", "keeps", "observed p5/p50/p95", *right)
        table = _table("Rules", {c: "right" if c in right else "left" for c in columns})
        for r in analysis.rules:
            table.add_row(
                r.rule if r.effect == "rejected" else f"{r.rule} ({r.effect})",
                r.statistic,
                r.threshold,
                " / ".join(fmt(v) for v in r.observed),
                _pct(r.sequences, n_rows),
                _pct(r.tokens, n_tokens),
            )
        out.append(table)
    return out


def _findings(analysis: Analysis, top: int) -> list[Any]:
    """The sequences and tokens the rules hit, furthest outside their range first."""
    seq, snippets, n_seq = analysis.findings.ranked("sequence", top)
    toks, _, n_toks = analysis.findings.ranked("token", top)
    out: list[Any] = []
    if seq and top:
        columns = ("line", "rule", "statistic", "keeps", "worst token", "response")
        table = _table(
            f"Sequences hit, worst first ({min(top, n_seq)} of {n_seq} findings)",
            {c: "right" if c == "line" else "left" for c in columns},
            **{c: {"no_wrap": True} for c in columns[:-1]},
        )
        for f, snippet in zip(seq, snippets):
            worst = f"{f.position}:{f.token!r}" if f.token is not None else str(f.position)
            table.add_row(
                str(f.line),
                f.rule,
                f"{f.statistic} = {_fmt_against(f.value, f.lower, f.upper)}",
                f.threshold,
                escape(worst),
                escape(_snippet(snippet)),
            )
        out += ["", table]
    if toks and top:
        columns = ("line", "pos", "token", "rule", "statistic", "keeps", "effect")
        table = _table(
            f"Tokens hit, worst first ({min(top, n_toks)} of {n_toks} findings)",
            {c: "right" if c in ("line", "pos") else "left" for c in columns},
        )
        for f in toks:
            table.add_row(
                str(f.line),
                str(f.position),
                escape(repr(f.token) if f.token is not None else ""),
                f.rule,
                f"{f.statistic} = {_fmt_against(f.value, f.lower, f.upper)}",
                f.threshold,
                f.effect,
            )
        out += ["", table]
    return out


def _mismatched_tokens(analysis: Analysis, top: int) -> list[Any]:
    """The valid tokens with the largest |ℓ| in the dump (ties: file order), whatever the config does with
    them (``Analysis.top_tokens``; padding is never listed)."""
    rows = analysis.top_tokens[:top]
    if not top or not rows:
        return []
    columns = ("line", "pos", "token", "p_μ", "p_old", "ρ = π_old/μ", "fate")
    table = _table(
        f"Most mismatched tokens (largest |ℓ|, {len(rows)} of {analysis.tokens})",
        {c: "left" if c in ("token", "fate") else "right" for c in columns},
    )
    for r in rows:
        if r.token_text is not None:
            label = repr(r.token_text)
        else:
            label = f"id {r.token_id}" if r.token_id is not None else ""
        table.add_row(
            str(r.line),
            str(r.position),
            escape(label),
            fmt(exp_or_inf(r.rollout_log_prob)),
            fmt(exp_or_inf(r.learner_log_prob)),
            fmt(exp_or_inf(r.learner_log_prob - r.rollout_log_prob)),
            r.fate,
        )
    return ["", table]


def _malformed(analysis: Analysis, top: int) -> list[Any]:
    dump = analysis.dump
    if not dump.malformed:
        return []
    table = _table(
        f"Malformed rows skipped ({len(dump.malformed)} of {dump.total_rows})",
        {"line": "right", "reason": "left"},
        reason={"style": "yellow"},
    )
    limit = max(top, 10)
    for m in dump.malformed[:limit]:
        table.add_row(str(m.line), escape(m.reason))
    out: list[Any] = ["", table]
    if len(dump.malformed) > limit:
        out.append(f"[dim]  … and {len(dump.malformed) - limit} more (see --json)[/]")
    return out


def summary(analysis: Analysis) -> str:
    """A few sentences: how large the mismatch is, what the config does about it, what was skipped."""
    m, config = analysis.metrics, analysis.config
    get = lambda key: m.get(PREFIX + key, math.nan)  # noqa: E731
    out = [
        f"sampler and learner differ by mean |ℓ| = {fmt(get('log_ratio_abs_mean'))} per token "
        f"({_percent(get('prob_diff_frac_ge_0.01'))} of tokens with |Δp| ≥ 0.01, max |Δp| {fmt(get('prob_diff_max'))})."
    ]
    stat = {"token": "ρ_t", "sequence": "Π ρ_t", "geometric": "geo-mean ρ"}.get(config.is_level or "", "ρ")
    if analysis.weights is not None and config.is_mode == "mask":
        share = get("rollout_is_oob_ratio")
        band = (
            f"outside {kept_range(config.is_lower, config.is_upper)}"
            if config.is_lower
            else f"> {fmt(config.is_upper)}"
        )
        out.append(f"IS zeroes {_percent(share)} of the token weights ({stat} {band}).")
    elif analysis.weights is not None and config.is_upper is not None:
        share = get("rollout_is_ratio_fraction_high")
        out.append(f"IS truncates {_percent(share)} of the weights ({stat} > {fmt(config.is_upper)}).")
    if rejects(config):
        n_tok, n_seq = analysis.tokens, analysis.responses
        out.append(
            f"Rejection removes {100 * analysis.rejected_tokens / n_tok:.3g}% of tokens in "
            f"{100 * analysis.rejected_sequences / n_seq:.3g}% of sequences."
        )
        if n_tok and analysis.rejected_tokens == n_tok:
            out.append("That is everything: a training step on this data would have no gradient.")
        worst = max(
            (r for r in analysis.rules if r.effect == "rejected"), key=lambda r: r.tokens, default=None
        )
        if worst is not None and worst.tokens > 0:
            p5, _, p95 = worst.observed
            out.append(
                f"Most of it is {worst.rule}: it keeps {worst.statistic} {worst.threshold}, "
                f"while 90% of the observed values lie in [{fmt(p5)}, {fmt(p95)}]."
            )
    if analysis.dump.malformed:
        out.append(f"{len(analysis.dump.malformed)} malformed row(s) were skipped.")
    return " ".join(out)
