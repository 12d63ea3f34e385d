"""The audit report: ``summary.json``, four PNGs, a self-contained ``report.html`` and a rich table.

``write_report(data, out_dir)`` does everything and returns the summary dict. Files are written to a
temporary name and renamed, so a folder never holds a half-written report file.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rollcorr.audit import plots
from rollcorr.audit.collect import AuditData
from rollcorr.audit.stats import audit_stats, check_inputs, median_max_over
from rollcorr.audit.verdict import SHARE_KEYS, conclude, max_over, reference_token_counts, references_for
from rollcorr.turns import turn_summary

CONTEXT_TOKENS = 12  # tokens shown on each side of a worst token
PRINT_CONTEXT_CHARS = 24  # characters of that context printed on each side in the terminal


def _visible(text: str) -> str:
    """Make whitespace in a token visible in one line."""
    return text.replace("\n", "⏎").replace("\t", "⇥")


def token_context(data: AuditData, row: int, position: int, window: int = CONTEXT_TOKENS) -> dict[str, str]:
    """The decoded text around one response token: ``before``, ``token``, ``after`` (empty when unknown).

    ``position`` counts valid tokens of the row (responses are right-padded, so it is the column index).
    When the token is within ``window`` of the response start, the end of the prompt is shown before it.
    """
    if data.tokens is None:
        return {"before": "", "token": "", "after": ""}
    toks = data.tokens[row]
    before = "".join(toks[max(0, position - window) : position])
    if position < window and data.prompts is not None:
        before = data.prompts[row][-(window - position) * 4 :] + "│" + before
    return {
        "before": _visible(before),
        "token": _visible(toks[position]),
        "after": _visible("".join(toks[position + 1 : position + 1 + window])),
    }


def max_over_tokens(data: AuditData) -> dict[str, float | None]:
    """{str(N): the median max |Δp| over N of this audit's tokens} for each token count N a reference's max is over
    (``stats.median_max_over``; ``verdict.max_over`` reads it)."""
    view = check_inputs(data.rollout_log_prob, data.old_log_prob, data.response_mask)
    tokens = view.abs_diff[view.mask].sort(descending=True).values
    return {str(n): median_max_over(tokens, tokens.numel(), n) for n in reference_token_counts()}


def build_summary(data: AuditData, worst_k: int = 10) -> dict[str, Any]:
    """Statistics (``audit_stats``), the source description, the worst tokens' context and the verdict."""
    stats = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask, worst_k=worst_k)
    for item in stats["worst_tokens"]:
        item.update(token_context(data, item["row"], item["position"]))
    summary = {"source": data.source, **stats, **data.diagnosis}
    summary["max_over_tokens"] = max_over_tokens(data)
    if data.routed_experts is not None and data.learner_routed_experts is not None:
        from rollcorr.moe import routing_summary

        summary["routing"] = routing_summary(data.routed_experts, data.learner_routed_experts,
                                             data.rollout_log_prob, data.old_log_prob, data.response_mask)
    turns = turn_summary(data.rollout_log_prob, data.old_log_prob, data.response_mask, data.turn)
    if turns is not None:  # multi-turn trajectories: the mismatch per turn and by place in the turn
        summary["turns"] = turns
    if data.tito is not None:  # trajectories played through an environment: the token-in-token-out check
        summary["tito"] = data.tito
    conclude(summary)  # the verdict, the commands it points to, the suggested preset
    return summary


def _atomic_write(path: Path, text: str) -> None:
    from rollcorr.safe_io import atomic_write_bytes

    atomic_write_bytes(path, text.encode("utf-8"))


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(section, metric, value) rows shared by the printed table and the HTML page."""
    p, d = summary["probability"], summary["divergence"]
    rows = [
        ("data", "responses / tokens", f"{summary['n_responses']} / {summary['n_tokens']}"),
        ("|Δp|", "share < 0.001", _pct(p["prob_diff_frac_lt_1e-3"])),
        ("|Δp|", "share ≥ 0.01", _pct(p["prob_diff_frac_ge_0.01"])),
        ("|Δp|", "share ≥ 0.05", _pct(p["prob_diff_frac_ge_0.05"])),
        ("|Δp|", "share ≥ 0.1", _pct(p["prob_diff_frac_ge_0.1"])),
        ("|Δp|", "max", _num(p["prob_diff_max"])),
        ("|Δp|", "mean", _num(p["prob_diff_mean"])),
        ("|Δp|", "Pearson(p_μ, p_old)", _num(p["prob_pearson"])),
    ]
    for key, label in (("max_abs_diff", "max |Δp|"), ("mean_abs_diff", "mean |Δp|")):
        q = summary["per_response"][key]
        rows.append(
            (
                "per response",
                f"{label} mean/median/p90/max",
                " / ".join(_num(q[k]) for k in ("mean", "median", "p90", "max")),
            )
        )
    rows += [
        ("ℓ = log π_old − log μ", "mean (signed)", _num(d["log_ratio_mean"])),
        ("ℓ = log π_old − log μ", "mean |ℓ|", _num(d["log_ratio_abs_mean"])),
        ("ℓ = log π_old − log μ", "min / max", f"{_num(d['log_ratio_min'])} / {_num(d['log_ratio_max'])}"),
        ("KL(μ ‖ π_old)", "k1 / k3", f"{_num(d['kl'])} / {_num(d['k3_kl'])}"),
        ("KL(π_old ‖ μ)", "k1 / k3", f"{_num(d['policy_kl_k1'])} / {_num(d['policy_kl'])}"),
        ("JS(π_old, μ)", "per sampled token", _num(d["js_divergence"])),
        ("χ²", "token / sequence", f"{_num(d['chi2_token'])} / {_num(d['chi2_seq'])}"),
        ("ESS / N", "token / sequence", f"{_num(d['ess_token'])} / {_num(d['ess_seq'])}"),
    ]
    r = summary.get("routing")
    if r:  # mixture of experts: the sampler's vs the learner's own expert choice
        rows += [
            ("routing (MoE)", "flip share: token × layer / token",
             f"{_pct(r['routing_flip_share'])} / {_pct(r['routing_flip_token_share'])}"),
            ("routing (MoE)", "flip rate per layer", " / ".join(_pct(x) for x in r["routing_layer_flip_rate"])),
            ("routing (MoE)", "mean |Δp| flipped / unflipped tokens",
             f"{_num(r['abs_dp_mean_flipped'])} / {_num(r['abs_dp_mean_unflipped'])}"),
            ("routing (MoE)", "tokens flipped / unflipped", f"{r['tokens_flipped']} / {r['tokens_unflipped']}"),
            ("routing (MoE)", "share of Σ|Δp| on flipped tokens", _pct(r["abs_dp_share_flipped"])),
        ]
    return rows


TURN_COLUMNS = (("tokens", "tokens", None), ("share ≥ 0.01", "prob_diff_frac_ge_0.01", _pct),
                ("share ≥ 0.05", "prob_diff_frac_ge_0.05", _pct), ("mean |Δp|", "prob_diff_mean", _num),
                ("max |Δp|", "prob_diff_max", _num), ("k3", "k3_kl", _num))


def turn_tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the per-turn tables of a multi-turn audit (``summary["turns"]``): by turn, and
    by place in the turn; empty for a single-turn audit."""
    t = summary.get("turns")
    if not t:
        return []
    keys = [(name, key, show or str) for name, key, show in TURN_COLUMNS]
    by_turn = [[str(r["turn"] + 1), str(r["responses"]), *(show(r[key]) for _, key, show in keys)] for r in t["turns"]]
    p = t["position_in_turn"]
    by_place = [[f"{p['start'][i]}–{p['end'][i] - 1}", *(show(p[key][i]) for _, key, show in keys)]
                for i in range(len(p.get("start", [])))]
    names = [name for name, _, _ in keys]
    return [(f"per turn (turns from {t['turns_from']})", ["turn", "responses", *names], by_turn),
            ("by place in the turn (model tokens before it in its turn)", ["places", *names], by_place)]


def new_table(title: str, columns: list[tuple[str, bool]]) -> Table:
    """A rich table of (name, holds values) columns; ``print_table`` prints it so that no value is wrapped or cut
    (value columns are the right-justified ones) and only labels wrap — a narrow terminal or a redirected output
    loses no digit of a number (rich's own layout cut ``2.049e-06`` to ``2.049…`` at 80 columns)."""
    table = Table(title=title, title_justify="left")
    for name, value in columns:
        table.add_column(name, justify="right" if value else "left", overflow="fold")
    return table


LABEL_WIDTH = 16  # a label column narrows to its longest word, up to this many characters, before the table widens


def _column_widths(console: Console, table: Table) -> list[int]:
    """Widths that keep every value whole: a value column as wide as its widest value (its header wraps at words),
    the label columns narrowed from their natural widths (widest first) to fit the console, down to their
    longest word (at most ``LABEL_WIDTH``)."""
    plain = lambda c: console.render_str(c).plain if isinstance(c, str) else str(c)  # noqa: E731
    widths, floors = [], []
    for column in table.columns:
        texts, header = [plain(c) for c in column.cells], str(column.header)
        words = [len(w) for text in (header, *texts) for w in text.split()] or [1]
        if column.justify == "right":  # values
            widths.append(max([len(t) for t in texts] + [min(max(words), LABEL_WIDTH), 1]))
            floors.append(widths[-1])
        else:
            widths.append(max([len(line) for text in (header, *texts) for line in text.splitlines()] + [1]))
            floors.append(min(max(words), LABEL_WIDTH))
    room = console.width - (3 * len(widths) + 1)  # borders and one space of padding on each side of a cell
    while sum(widths) > room:
        shrink = [i for i, (w, f) in enumerate(zip(widths, floors)) if w > f]
        if not shrink:
            break
        i = max(shrink, key=lambda j: widths[j])
        widths[i] -= 1
    return widths


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` at ``_column_widths``; when even those need more than the console's width, the output is
    made that wide (a terminal then wraps the lines on screen: nothing is cut)."""
    for column, width in zip(table.columns, _column_widths(console, table)):
        column.width = width
    need = sum(column.width for column in table.columns) + 3 * len(table.columns) + 1
    width = console.width
    if need <= width:
        console.print(table)
        return
    console.width = need
    try:
        console.print(table)
    finally:
        console.width = width


def print_line(console: Console, text: str, **kwargs: Any) -> None:
    """A paragraph: wrapped at words in a terminal, one whole line otherwise (a log file, a pipe)."""
    console.print(text, soft_wrap=not console.is_terminal, highlight=False, **kwargs)


def print_commands(console: Console, summary: dict[str, Any]) -> None:
    """Each command the verdict points to (``summary["commands"]``): its label, then the command alone on one
    line, never wrapped by rich whatever the width (a terminal may fold it on screen; copied, it is one line)."""
    for item in summary.get("commands", []):
        console.print(f"{item['label']}:", style="bold", highlight=False, markup=False)
        console.print(f"  {item['command']}", soft_wrap=True, highlight=False, markup=False)


def tito_lines(summary: dict[str, Any]) -> list[str]:
    """The token-in-token-out check in words (``summary["tito"]``): what differs, where first, and the k3 the
    learner would see on the re-tokenised sequences; empty when the audit played no environment."""
    t = summary.get("tito")
    if not t:
        return []
    head = (f"Re-tokenising each conversation through {t['template']} gives back the sampled ids of "
            f"{t['trajectories'] - t['trajectories_differing']} of {t['trajectories']} trajectories")
    if not t["trajectories_differing"]:
        extra = f" ({t['trailing_tokens']} tokens added after the last sampled one, which change no score)" if t["trailing_tokens"] else ""
        return [f"{head}{extra}: the learner would score what the sampler sampled (k3 {_num(t['k3_sampled'])})."]
    e, n = t["example"], lambda count, what: f"{count} {what}{'' if count == 1 else 's'}"  # noqa: E731
    return [
        f"{head}: {n(t['sampled_tokens_differing'], 'sampled token')} without a counterpart in the re-tokenised "
        f"sequences ({t['model_tokens_without_counterpart']} of them the model's, which that pipeline would never "
        f"train) and {n(t['retokenized_tokens_differing'], 'token')} there that were never sampled.",
        f"First difference: trajectory {e['row']}, position {e['position']} ({e['in']}):",
        f"  sampled      …{e['before']}⟦{e['sampled']}⟧",
        f"  re-tokenised …{e['before']}⟦{e['retokenized']}⟧",
        f"On the {t['tokens_compared']} model tokens both sequences hold, the learner's k3 against the sampler is "
        f"{_num(t['k3_sampled'])} on the sampled sequence and {_num(t['k3_retokenized'])} on the re-tokenised one: "
        "keep the sampled ids end to end (docs/multi-turn.md).",
    ]


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """The summary table, the worst tokens, the per-turn and what-if tables, the verdict and its commands,
    printed with rich (``print_table``: no number is cut; ``print_commands``: each command whole on a line)."""
    console = console or Console()
    table = new_table("sampler vs learner mismatch", [("", False), ("metric", False), ("value", True)])
    previous = None
    for section, metric, value in summary_rows(summary):
        table.add_row(section if section != previous else "", metric, value)
        previous = section
    print_table(console, table)
    worst = new_table("worst tokens", [(name, True) for name in ("resp", "pos", "p_sampler", "p_learner", "|Δp|")]
                      + [("context", False)])
    for w in summary["worst_tokens"]:
        before, after = escape(w["before"][-PRINT_CONTEXT_CHARS:]), escape(w["after"][:PRINT_CONTEXT_CHARS])
        context = f"{before}[bold red]⟦{escape(w['token'])}⟧[/]{after}" if w["token"] else ""
        worst.add_row(str(w["row"]), str(w["position"]), f"{w['p_sampler']:.4f}", f"{w['p_learner']:.4f}",
                      f"{w['abs_diff']:.4f}", context)
    print_table(console, worst)
    for title, header, rows in turn_tables(summary):
        table = new_table(title, [(name, True) for name in header])
        for row in rows:
            table.add_row(*map(escape, row))
        print_table(console, table)
    for i, line in enumerate(tito_lines(summary)):  # the example's two lines whole, each on one line
        text = f"[bold]Token in, token out[/]: {escape(line)}" if i == 0 else escape(line)
        if line.startswith("  "):
            console.print(text, soft_wrap=True, highlight=False)
        else:
            print_line(console, text)
    if summary.get("whatif"):
        names = ("change", "sampler", *(c[0] for c in WHATIF_COLUMNS), "level")
        table = new_table("what would remove it (--whatif)",
                          [(name, name not in ("change", "sampler", "level")) for name in names])
        for row in whatif_rows(summary):
            table.add_row(*map(escape, row))
        print_table(console, table)
    if "localization" in summary:
        print_line(console, f"[bold]Where it enters[/]: {escape(summary['localization']['entry'])}")
    if sentence := level_sentence(summary):
        print_line(console, f"[bold]Is this level normal?[/] {escape(sentence)}")
    print_line(console, f"[bold]In short[/]: {escape(' '.join(summary['verdict']))}")
    print_commands(console, summary)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0;font-size:.92em}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.src td:first-child{color:#555}.ctx{font-family:ui-monospace,monospace;white-space:pre-wrap}
.tok{background:#fdd;color:#b00;font-weight:bold;border-radius:2px}
.verdict{background:#f6f8fa;border-left:4px solid #4c72b0;padding:.2em 1em;margin:1em 0}
.verdict h2{border:none;margin-top:.5em}.refs,.note{color:#555;font-size:.9em}
.cmd{position:relative;margin:.6em 0}.cmd .label{font-weight:600;font-size:.92em}
.cmd pre{background:#fff;border:1px solid #ddd;padding:.5em 4.5em .5em .7em;margin:.2em 0;overflow-x:auto;white-space:pre}
.cmd button{position:absolute;right:.4em;bottom:.45em;font-size:.8em;cursor:pointer}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:.9em}
"""

CAPTIONS = {
    "scatter": "Each point is one sampled token: its probability under the sampler (x) and under the learner "
    "(y). On the red diagonal the two engines agree; vertical distance from it is |Δp|.",
    "histogram": "Distribution of |Δp| over tokens, log-spaced bins and log counts. Dashed lines mark the "
    "thresholds of the summary table; the legend gives the share of tokens beyond each.",
    "position": "Top: mean and max |Δp| in buckets of response positions — does mismatch grow along the "
    "context? Bottom: the response with the largest |Δp|, token by token — isolated spikes or a drift?",
    "per_response": "Each response's largest and average |Δp| (the TIS paper's two metrics) against its "
    "length. Max mismatch tends to grow with length even when the mean does not.",
    "levels": "This audit's k3 among the levels reported for other models and stacks (sources below): a band is "
    "where those models sit — the range its source states, darker, and as far as the pairs measured on that kind "
    "of model go — not a threshold for this one. ● places this audit: the median of the token-mean k3 of groups of "
    "its responses, which one token cannot move across a band; × is the token mean with its 95 % bootstrap "
    "interval over responses; the arrow, the FP16 paper's ~24× lower KL. Diamonds: what each --whatif change left.",
    "localization": "Left: how far the sampler's hidden state is from the learner's at each layer (an error there "
    "includes everything upstream). Middle: each layer's attention and MLP own contribution — the sampler's version "
    "of that component alone swapped into the fp32 learner — as a share of the sampler forward's k3, measured or, "
    "hatched, estimated to first order. Right: the largest shares by name ((est.): estimated; the embedding, final "
    "norm, lm-head and residual stream among them when large).",
}

WHATIF_COLUMNS = (("share < 0.001", "prob_diff_frac_lt_1e-3", True), ("share ≥ 0.01", "prob_diff_frac_ge_0.01", True),
                  ("share ≥ 0.05", "prob_diff_frac_ge_0.05", True), ("max", "prob_diff_max", False),
                  ("mean", "prob_diff_mean", False), ("k3", "k3_kl", False))


def whatif_rows(summary: dict[str, Any]) -> list[tuple[str, ...]]:
    """(change, sampler, each WHATIF_COLUMNS value, level) rows: the audit itself first, then each change."""
    p = {**summary["probability"], "k3_kl": summary["divergence"]["k3_kl"]}
    audited = ("(as audited)", str(summary["source"].get("sampler", "")),
               *(_pct(p[k]) if pct else _num(p[k]) for _, k, pct in WHATIF_COLUMNS), summary.get("verdict_level", {}).get("level", ""))
    rows = [audited]
    for r in summary.get("whatif", []):
        rows.append((r["change"], r["sampler"], *(_pct(r[k]) if pct else _num(r[k]) for _, k, pct in WHATIF_COLUMNS),
                     r["verdict_level"]))
    return rows


SHARE_LABELS = ("share |Δp| < 0.001", "share ≥ 0.01", "share ≥ 0.05", "share ≥ 0.1")


def _uncompared_max(reference: dict[str, Any]) -> str:
    """For a reference whose max is over a token count its source does not give: its max, and why the table
    does not compare it."""
    if reference.get("tokens"):
        return ""
    return (f". Its max |Δp| {reference['prob_diff_max']:.3g} is over a number of tokens the source does not give, "
            "so it is compared with nothing: a max grows with the number of tokens")


def reference_rows(summary: dict[str, Any]) -> list[tuple[str, ...]]:
    """(metric, this audit, each reference level) rows: the |Δp| shares, and for each token count a reference's max
    is over, the max over that many tokens (this audit's: the median max of that many of its tokens, ``max_over``;
    a reference measured over another count, or an unknown one: —)."""
    p, refs = summary["probability"], list(references_for(summary).values())
    rows = [
        (label, _pct(p[key]), *(_pct(r[key]) for r in refs)) for label, key in zip(SHARE_LABELS, SHARE_KEYS)
    ]
    for n in sorted({r["tokens"] for r in refs if r.get("tokens")}):  # a max only against one over as many tokens
        ours = max_over(summary, n)
        rows.append((f"max |Δp| over {n} tokens", "—" if ours is None else _num(ours),
                     *(_num(r["prob_diff_max"]) if r.get("tokens") == n else "—" for r in refs)))
    return rows


MONTE_CARLO_NOTE = (
    "KL, χ² and ESS are Monte-Carlo estimates over the sampled tokens only: the engines report the log-prob "
    "of the token they drew, not the whole vocabulary. The k1 estimates (mean −ℓ, mean ρ·ℓ) and χ² "
    "(mean ρ² − 1) are unbiased but noisy, so when the true divergence is close to 0 they can come out "
    "slightly negative on a finite sample; read a negative value as “about zero, within sampling noise”. "
    "k3 (mean ρ − 1 − ℓ), policy_kl and JS are non-negative token by token. χ²_seq = −1 means every sequence "
    "weight exp(Σℓ) underflowed: the sample has no support there, read it as unbounded."
)


COPY = "navigator.clipboard.writeText(this.parentElement.querySelector('code').textContent)"


def commands_html(summary: dict[str, Any]) -> str:
    """Each command of ``summary["commands"]`` as a labelled code block with a copy button (the button's only
    script is its onclick: the page stays self-contained)."""
    esc = html.escape
    return "".join(f"<div class='cmd'><div class='label'>{esc(c['label'])}:</div><pre><code>{esc(c['command'])}</code>"
                   f"</pre><button type='button' onclick=\"{COPY}\">copy</button></div>"
                   for c in summary.get("commands", []))



LOCALIZATION_METHODS = {"exact": "exact: swapped in alone", "estimate": "first-order estimate"}


def _localization_html(loc: dict[str, Any], figure_html: str) -> str:
    """The "Where it enters" section: the sentence, the figure, and each component's k3 and share, each said as
    measured (swapped in alone) or estimated (first order), with the estimate beside a measured share."""
    esc = html.escape

    def row(c: dict[str, Any]) -> str:
        estimate = f"{100 * c['estimate']:.1f} %" if "estimate" in c else ""
        return (f"<tr><td>{esc(c['component'])}</td><td class='num'>{c['k3']:.3g}</td>"
                f"<td class='num'>{100 * c['share']:.1f} %</td><td>{LOCALIZATION_METHODS[c.get('method', 'exact')]}</td>"
                f"<td class='num'>{estimate}</td></tr>")

    rows_html = "".join(row(c) for c in loc["components"])
    return (f"<h2>Where it enters</h2><p>{esc(loc['entry'])}</p>{figure_html}"
            f"<p class='note'>{loc['responses']} responses, {loc['tokens']} tokens (those holding the largest |Δp|). "
            "Measured: the component swapped alone into the fp32 learner, its k3 against the learner's; estimated: "
            "the same k3 to first order, from the component's error at its output and the learner's gradient there "
            "(one backward for every component; the largest estimates are then measured).</p><table><tr>"
            "<th>component</th><th>k3</th>"
            f"<th>share</th><th>how</th><th>first-order estimate</th></tr>{rows_html}</table>")


def render_html(summary: dict[str, Any], images: dict[str, Path]) -> str:
    """One self-contained page: inline CSS, PNGs as base64 data URIs, no external resource."""
    esc = html.escape
    verdict_html = "".join(f"<p>{esc(sentence)}</p>" for sentence in summary["verdict"]) + commands_html(summary)
    refs = references_for(summary)
    ref_head = "".join(f"<th title='{esc(r['source'])}'>{esc(r['label'])}</th>" for r in refs.values())
    ref_rows = "".join(
        "<tr>" + f"<td>{esc(row[0])}</td>" + "".join(f"<td class='num'>{esc(v)}</td>" for v in row[1:]) + "</tr>"
        for row in reference_rows(summary)
    )
    ref_sources = "".join(f"<li>{esc(r['label'])}: {esc(r['source'])}{esc(_uncompared_max(r))}</li>" for r in refs.values())
    source = "".join(
        f"<tr><td>{esc(str(k))}</td><td>{esc(json.dumps(v) if isinstance(v, dict | list) else str(v))}</td></tr>"
        for k, v in summary["source"].items()
    )
    rows = "".join(
        f"<tr><td>{esc(s)}</td><td>{esc(m)}</td><td class='num'>{esc(v)}</td></tr>"
        for s, m, v in summary_rows(summary)
    )
    worst = "".join(
        f"<tr><td class='num'>{w['row']}</td><td class='num'>{w['position']}</td>"
        f"<td class='num'>{w['p_sampler']:.4f}</td><td class='num'>{w['p_learner']:.4f}</td>"
        f"<td class='num'>{w['abs_diff']:.4f}</td><td class='ctx'>{esc(w['before'])}"
        f"<span class='tok'>{esc(w['token'])}</span>{esc(w['after'])}</td></tr>"
        for w in summary["worst_tokens"]
    )
    def figure(name: str) -> str:
        data = base64.b64encode(Path(images[name]).read_bytes()).decode()
        return (f"<figure><img alt='{esc(name)}' src='data:image/png;base64,{data}'><figcaption>"
                f"{esc(CAPTIONS[name])}</figcaption></figure>")

    diagnosis = ""
    if "levels" in images:
        diagnosis += f"<h2>Is this level normal?</h2>{figure('levels')}{_level_html(summary)}"
    if summary.get("whatif"):
        head = "".join(f"<th>{esc(h)}</th>" for h in ("change", "sampler", *(c[0] for c in WHATIF_COLUMNS), "level"))
        body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>" for row in whatif_rows(summary))
        diagnosis += (f"<h2>What would remove it (measured on this model)</h2><table><tr>{head}</tr>{body}</table>"
                      "<p class='note'>Each change reruns the sampler side with that one thing different, on the same "
                      "prompts and seed; <code>batch</code> scores the same tokens with each response alone against "
                      "one batch.</p>")
    if "localization" in summary:
        diagnosis += _localization_html(summary["localization"], figure("localization"))
    figures = "".join(figure(name) for name in images if name not in ("levels", "localization"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rollcorr audit</title><style>{CSS}</style></head><body>
<h1>rollcorr audit: sampler vs learner mismatch</h1>
<div class="verdict"><h2>In short</h2>{verdict_html}</div>
<table><tr><th>|Δp| over tokens</th><th>this audit</th>{ref_head}</tr>{ref_rows}</table>
<ul class="refs">{ref_sources}</ul>
<p>The same sampled tokens scored by the sampler (μ, what the tokens were drawn from) and by the learner
(π_old). Δp = p_sampler − p_learner per token; ℓ = log π_old − log μ.</p>
<table class="src">{source}</table>
{diagnosis}
<h2>Summary</h2><table><tr><th></th><th>metric</th><th>value</th></tr>{rows}</table>
<p class="note">{esc(MONTE_CARLO_NOTE)}</p>
{_turns_html(summary)}
<h2>Worst tokens</h2>
<table><tr><th>resp</th><th>pos</th><th>p_sampler</th><th>p_learner</th><th>|Δp|</th><th>context</th></tr>
{worst}</table>
<h2>Plots</h2>{figures}
</body></html>
"""


def level_sentence(summary: dict[str, Any]) -> str | None:
    """Where ``summary["k3_level"]`` places this audit among the published bands, in words (None without it)."""
    level = summary.get("k3_level")
    if not level:
        return None
    where = (" and ".join(f"the band of {name}" for name in level["bands"]) if level["bands"]
             else "no published band")
    lo, hi = level["ci95"]
    return (f"This audit's k3 is {level['robust']:.2g} (the median of {level['groups']} group means of its "
            f"responses), in {where}; the token mean is {level['mean']:.2g}, 95 % interval {lo:.2g} to {hi:.2g}.")


def _level_html(summary: dict[str, Any]) -> str:
    """The placement sentence and the sources of every band and measured pair of the levels figure."""
    from rollcorr.audit.levels import K3_BANDS

    esc = html.escape
    items = "".join(f"<li>{esc(b.name)}: {esc(b.quoted_source)}; measured: "
                    + "; ".join(esc(f"{m.label} {m.k3:.3g} ({m.source})") for m in b.measured) + "</li>"
                    for b in K3_BANDS)
    sentence = level_sentence(summary)
    return (f"<p>{esc(sentence)}</p>" if sentence else "") + f"<ul class='refs'>{items}</ul>"


def _turns_html(summary: dict[str, Any]) -> str:
    """The per-turn tables (multi-turn audits), or nothing."""
    esc, out = html.escape, ""
    for title, header, rows in turn_tables(summary):
        head = "".join(f"<th>{esc(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td class='num'>{esc(v)}</td>" for v in row) + "</tr>" for row in rows)
        out += f"<h2>{esc(title[0].upper() + title[1:])}</h2><table><tr>{head}</tr>{body}</table>"
    lines = tito_lines(summary)
    if lines:
        out += "<h2>Token in, token out</h2>" + "".join(
            f"<p class='ctx'>{esc(line)}</p>" if line.startswith("  ") else f"<p>{esc(line)}</p>" for line in lines)
    return out


def write_report(data: AuditData, out_dir: str | Path, *, worst_k: int = 10) -> dict[str, Any]:
    """Write summary.json, the PNGs and report.html into ``out_dir``; return the summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = build_summary(data, worst_k=worst_k)
    view = check_inputs(data.rollout_log_prob, data.old_log_prob, data.response_mask)
    images = plots.draw_all(view, out_dir, summary)
    summary["files"] = sorted([*(p.name for p in images.values()), "report.html", "summary.json"])
    _atomic_write(out_dir / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    _atomic_write(out_dir / "report.html", render_html(summary, images))
    return summary
