"""The audit's four figures (matplotlib, Agg backend, PNG). Each function draws one figure into ``path``.

- ``scatter``: p_sampler vs p_learner per token, with the diagonal where the two engines agree;
- ``histogram``: |Δp| on log-spaced bins with a log count axis, thresholds of the ABEJA table marked;
- ``position``: |Δp| along the response (mean and max per position bucket; the worst response token by token);
- ``per_response``: each response's max and mean |Δp| against its length;
- ``levels``: this audit's k3 among the levels published for other models (``levels.K3_BANDS``), with what the
  ``--whatif`` changes left;
- ``localization`` (with ``--localize``): the hidden states' relative error by depth, each layer's components'
  shares of the mismatch, and the largest shares named — on a layer axis, so it reads at any depth.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from rollcorr.audit.stats import (  # noqa: E402
    TokenView,
    per_response,
    position_profile,
    probability_mismatch,
)
from rollcorr.plotting import save_figure  # noqa: E402

# threshold -> (comparison, key of the share in probability_mismatch)
THRESHOLDS = {
    1e-3: ("<", "prob_diff_frac_lt_1e-3"),
    0.01: ("≥", "prob_diff_frac_ge_0.01"),
    0.05: ("≥", "prob_diff_frac_ge_0.05"),
    0.1: ("≥", "prob_diff_frac_ge_0.1"),
}
HIST_FLOOR = 1e-8  # |Δp| below this (including exact agreement) lands in the first bin
DPI = 110


def log_axis(ax, values, floor: float = HIST_FLOOR, label: str = "|Δp|") -> None:
    """A readable log y axis for ``values`` ≥ 0: values below ``floor`` (exact agreement) are drawn at the floor,
    and the limits are whole decades around the data, so at least two labelled ticks always show."""
    import math

    vals = [max(float(v), floor) for v in values] or [floor]
    lo = 10.0 ** math.floor(math.log10(min(vals)))
    hi = 10.0 ** math.ceil(math.log10(max(vals)) + 1e-9)
    ax.set_yscale("log")
    ax.set_ylim(lo, max(hi, 10 * lo))
    ax.set_ylabel(f"{label} (log scale, floor {floor:g})")


def scatter(view: TokenView, path: Path, title: str = "") -> Path:
    """p_sampler (x) vs p_learner (y) for every valid token; points off the diagonal disagree."""
    p_mu = view.log_mu[view.mask].exp().numpy()
    p_old = view.log_old[view.mask].exp().numpy()
    diff = abs(p_mu - p_old)
    order = diff.argsort()  # draw the largest mismatches last, on top
    fig, ax = plt.subplots(figsize=(5.6, 5.2))
    points = ax.scatter(
        p_mu[order],
        p_old[order],
        c=diff[order],
        s=7,
        cmap="viridis",
        vmin=0,
        vmax=max(diff.max(), 1e-6),
        alpha=0.7,
    )
    ax.plot([0, 1], [0, 1], "r--", lw=1, zorder=3, label="p_sampler = p_learner")
    ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel="p_sampler  (μ)", ylabel="p_learner  (π_old)")
    ax.set_title(title or f"Same tokens, two engines ({len(p_mu)} tokens)")
    ax.set_aspect("equal")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.colorbar(points, ax=ax, label="|Δp|", shrink=0.8)
    return save_figure(fig, path, dpi=DPI)


def histogram(view: TokenView, path: Path) -> Path:
    """Histogram of |Δp| on log-spaced bins and a log count axis; the ABEJA thresholds as dashed lines."""
    d = view.abs_diff[view.mask]
    bins = torch.logspace(torch.log10(torch.tensor(HIST_FLOOR)), 0, 57).numpy()
    clipped = d.clamp(min=HIST_FLOOR * 1.0001).numpy()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    ax.hist(clipped, bins=bins, color="#4c72b0", edgecolor="white", linewidth=0.3)
    ax.set_xscale("log")
    counts, _ = np.histogram(clipped, bins=bins)
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(10.0, 10.0 ** np.ceil(np.log10(max(counts.max(), 1)) + 1e-9)))  # ≥ 2 decade ticks
    shares = probability_mismatch(view)
    for (c, (op, key)), color in zip(THRESHOLDS.items(), ("#2ca02c", "#ff7f0e", "#d62728", "#9467bd")):
        ax.axvline(c, color=color, ls="--", lw=1, label=f"{op} {c:g}: {100 * shares[key]:.1f} %")
    below = int((d < HIST_FLOOR).sum())
    if below:
        ax.annotate(
            f"{below} tokens with |Δp| < {HIST_FLOOR:g}\n(incl. exact agreement)",
            xy=(HIST_FLOOR * 1.6, below),
            xytext=(HIST_FLOOR * 8, max(1.2, below / 3)),
            fontsize=8,
            arrowprops={"arrowstyle": "->", "lw": 0.8},
        )
    ax.set(xlabel="|p_sampler − p_learner|  (log scale)", ylabel="tokens (log scale)")
    ax.set_title(f"How far the engines disagree, token by token (max {d.max().item():.3g})")
    ax.legend(fontsize=8, title="share of tokens", title_fontsize=8)
    ax.grid(alpha=0.3, which="major")
    return save_figure(fig, path, dpi=DPI)


def position(view: TokenView, path: Path, n_buckets: int = 20) -> Path:
    """Top: mean and max |Δp| per bucket of response positions. Bottom: |Δp| token by token in the response
    holding the largest mismatch (where along the response the big deviations sit)."""
    prof = position_profile(view, n_buckets=n_buckets)
    centers = [(s + e - 1) / 2 for s, e in zip(prof["start"], prof["end"])]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.2, 6.0), constrained_layout=True)
    clip = lambda xs: [max(x, HIST_FLOOR) for x in xs]  # noqa: E731
    top.plot(centers, clip(prof["max"]), "o-", color="#d62728", ms=3, label="max")
    top.plot(centers, clip(prof["mean"]), "o-", color="#4c72b0", ms=3, label="mean")
    log_axis(top, prof["max"] + prof["mean"])
    top.set(xlabel="position in response (token index)")
    top.set_title(f"|Δp| along the response, {len(centers)} position buckets")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)

    abs_diff = view.abs_diff
    row = int(abs_diff.max(dim=1).values.argmax())
    trace = abs_diff[row][view.mask[row]].numpy()
    bottom.vlines(range(len(trace)), 0, trace, color="#4c72b0", lw=1)
    bottom.plot(range(len(trace)), trace, ".", color="#4c72b0", ms=3)
    peak = int(trace.argmax())
    bottom.plot([peak], [trace[peak]], "o", color="#d62728", ms=6, label=f"max {trace[peak]:.3g} at {peak}")
    bottom.set(xlabel="position in response (token index)", ylabel="|Δp|", ylim=(0, None))
    bottom.set_title(f"Token by token: response #{row} (the one with the largest |Δp|, {len(trace)} tokens)")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    for ax in (top, bottom):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return save_figure(fig, path, dpi=DPI)


def per_response_plot(view: TokenView, path: Path) -> Path:
    """Each response's max |Δp| and mean |Δp| (the TIS paper's two metrics) against its length."""
    rows = per_response(view)
    length = rows["length"].numpy()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    ax.scatter(
        length, rows["max_abs_diff"].clamp(min=HIST_FLOOR).numpy(), s=14, color="#d62728", label="max |Δp|"
    )
    ax.scatter(
        length,
        rows["mean_abs_diff"].clamp(min=HIST_FLOOR).numpy(),
        s=14,
        color="#4c72b0",
        marker="s",
        label="mean |Δp|",
    )
    log_axis(ax, [*rows["max_abs_diff"].tolist(), *rows["mean_abs_diff"].tolist()])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="response length (tokens)")
    ax.set_title(f"Mismatch per response ({len(length)} responses)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=DPI)


FP16_PAPER_FACTOR = 24  # "Defeating the Training-Inference Mismatch via FP16": ~24× lower KL with fp16 both sides
BAND_COLORS = ("#c8dcf0", "#f3d9c4")


def _level_rows(summary: dict) -> list[tuple[str, float, dict]]:
    """(kind, k3, what to draw) per row of the levels figure, top to bottom: each band of ``K3_BANDS`` then the
    pairs measured on its kind of model, this audit, each --whatif change."""
    from rollcorr.audit.levels import K3_BANDS

    rows: list[tuple[str, float, dict]] = []
    for band, color in zip(K3_BANDS, BAND_COLORS):
        rows.append(("band", band.edges[0], {"band": band, "color": color}))
        rows += [("measured", m.k3, {"label": f"{m.label} ({m.source.split(' (')[0].split(',')[0]})"})
                 for m in band.measured]
    level = summary.get("k3_level") or {"robust": summary["divergence"]["k3_kl"], "mean": summary["divergence"]["k3_kl"]}
    rows.append(("audit label", level["robust"], level))  # its own row: the label is long, the interval wide
    rows.append(("audit", level["robust"], level))
    rows += [("whatif", r["k3_kl"], r) for r in summary.get("whatif", [])]
    return rows


def levels_figure(summary: dict):
    """This audit's k3 of KL(μ ‖ π_old) on a log axis among the levels published for other models: each band of
    ``levels.K3_BANDS`` (the range its source states, darker, and as far as the pairs measured on that kind of
    model go), those pairs, this audit — the median of group means that places it, the token mean with its 95 %
    bootstrap interval, the FP16 paper's ~24× reduction drawn from it — and what each --whatif change left.
    Every label is inside the axes (``_inside``)."""
    rows = _level_rows(summary)
    values = [v for kind, v, _ in rows if v > 0] + [r.get("mean", 0) for k, _, r in rows if k == "audit"]
    floor = min([v for v in values if v > 0] + [1e-5]) / 100  # where an exact 0 is drawn (log axis)
    ends = [max(v, floor) for _, v, _ in rows] + [e for k, _, d in rows if k == "band" for e in d["band"].edges]
    ends += [x for k, _, d in rows if k == "audit" for x in d.get("ci95", []) if x > 0]
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.3 * len(rows)))
    fig.subplots_adjust(left=0.02, right=0.98, top=1 - 0.35 / (1.0 + 0.3 * len(rows)), bottom=0.55 / (1.0 + 0.3 * len(rows)))
    ax.set_xscale("log")
    ax.set_xlim(min(ends) / 10, max(ends) * 10)
    labels = []
    for y, (kind, value, d) in enumerate(rows):
        y = len(rows) - 1 - y
        if kind.startswith("audit") and "ci95" in d:  # an exact 0 is drawn at the floor on the log axis
            d = {**d, "mean": max(d["mean"], floor), "ci95": [max(v, floor) for v in d["ci95"]]}
        labels.append(_draw_level_row(ax, y, kind, max(value, floor), d))
    ax.set_yticks([])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set(xlabel="k3 of KL(μ ‖ π_old): a token mean (×, the bands), the median of group means (●)")
    ax.set_title("Is this level normal? This audit among published levels (other models, other stacks)")
    ax.grid(alpha=0.3, axis="x")
    _inside(fig, ax, [t for t in labels if t is not None])
    return fig


def _draw_level_row(ax, y: float, kind: str, x: float, d: dict):
    """One row of ``levels_figure``; returns its label (a matplotlib Text)."""
    if kind == "band":
        band = d["band"]
        ax.fill_betweenx([y - 0.38, y + 0.38], *band.edges, color=d["color"], alpha=0.55, lw=0)
        ax.fill_betweenx([y - 0.38, y + 0.38], *band.quoted, color=d["color"], lw=0)
        lo, hi = band.edges
        said = f"{band.name}: {band.quoted[0]:.0e} to {band.quoted[1]:.0e} (Miles / LMSYS)"
        said += f"; measured pairs to {hi:.2g}" if hi > band.quoted[1] else ""
        return ax.text((lo * hi) ** 0.5, y, said, va="center", ha="center", fontsize=8)
    if kind == "measured":
        ax.plot([x], [y], "s", color="#555", ms=5)
        return _label(ax, x, y, f"{d['label']}: k3 {x:.2g}", color="#333")
    if kind == "audit label":
        said = f"this audit: k3 {x:.2g}" + (f" (●, the median of {d['groups']} group means)" if "groups" in d else "")
        if "ci95" in d:
            said += f"; token mean {d['mean']:.2g} (×) with its 95 % interval [{d['ci95'][0]:.2g}, {d['ci95'][1]:.2g}]"
        return ax.text(ax.get_xlim()[0] * 1.5, y - 0.15, said, va="center", ha="left", fontsize=8, color="#c44e52")
    if kind == "audit":
        if d.get("ci95"):
            lo, hi = d["ci95"]
            ax.errorbar([max(d["mean"], lo)], [y], xerr=[[max(d["mean"] - lo, 0)], [max(hi - d["mean"], 0)]], fmt="x",
                        color="#c44e52", alpha=0.7, capsize=3, ms=6)
        ax.plot([x], [y], "o", color="#c44e52", markersize=8)
        ax.annotate("", xy=(x / FP16_PAPER_FACTOR, y), xytext=(x, y),
                    arrowprops={"arrowstyle": "->", "color": "#c44e52", "alpha": 0.5})
        return _label(ax, x / FP16_PAPER_FACTOR, y, f"FP16 paper: ~{FP16_PAPER_FACTOR}× lower", span=d.get("ci95"),
                      color="#c44e52", alpha=0.7)
    ax.plot([x], [y], "D", color="#4c72b0")
    said = f"k3 {d['k3_kl']:.2g}" if d["k3_kl"] > 0 else "k3 exactly 0 (drawn at the left)"
    return _label(ax, x, y, f"--whatif {d['change']}: {said}")


def _label(ax, x: float, y: float, text: str, span: list[float] | None = None, **kw):
    """A label beside the point at (x, y) — beyond its interval ``span`` when it has one — on the side of the axis
    with more room (log x)."""
    import math

    lo, hi = ax.get_xlim()
    left_end, right_end = min([x, *(span or [])]), max([x, *(span or [])])
    right = math.log(hi / right_end) >= math.log(left_end / lo)
    at = right_end * 1.4 if right else left_end / 1.4
    return ax.text(at, y, text, va="center", ha="left" if right else "right", fontsize=8, **kw)


def _inside(fig, ax, texts) -> None:
    """Keep each label inside the axes: one that runs past an edge shrinks until it fits (at 5 points the
    least), and is clipped to the axes beyond that."""
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    for text in texts:
        text.set_clip_on(True)
        while text.get_fontsize() > 5:
            extent = text.get_window_extent(renderer)
            if extent.x0 >= box.x0 and extent.x1 <= box.x1:
                break
            text.set_fontsize(text.get_fontsize() - 0.5)


def levels(summary: dict, path: Path) -> Path:
    """``levels_figure`` saved to ``path``."""
    return save_figure(levels_figure(summary), path, dpi=DPI)


LOCALIZATION_NAMED = 10  # components named in the localization figure's right panel (the largest shares)


def localization_figure(loc: dict):
    """Three panels on a layer axis (ticks chosen by matplotlib, so 4 or 60 layers read alike). Left: ‖h_sampler −
    h_learner‖ / ‖h_learner‖ at each layer's input, attention and MLP output, the final norm and the logits
    drawn after the last layer. Middle: each layer's attention and MLP share of the sampler forward's k3 (swapped
    alone into the fp32 learner; routers too; hatched where it is the first-order estimate). Right: the
    ``LOCALIZATION_NAMED`` largest shares by name ("(est.)": estimated), the embedding, final norm, lm-head and
    residual stream among them where they are large."""
    sites, comps = loc["sites"], loc["components"]
    depth = 1 + max([s["layer"] for s in sites if s["layer"] is not None] + [0])
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    for site, marker in (("input", "o"), ("attention", "s"), ("mlp", "^")):
        at = [s for s in sites if s["site"] == site]
        left.plot([s["layer"] for s in at], [max(s["rel_error"], 1e-12) for s in at], f"{marker}-", ms=4, label=site)
    for i, s in enumerate(s for s in sites if s["layer"] is None):  # the final norm, the logits: after the layers
        left.plot([depth + i], [max(s["rel_error"], 1e-12)], "D*"[i % 2], color=("#555", "#000")[i % 2], ms=6,
                  ls="", label=s["site"])
    left.set_yscale("log")
    left.set(xlabel="layer", ylabel="relative error of the hidden state")
    left.set_title("Divergence by depth (includes everything upstream)", fontsize=10)
    left.legend(fontsize=8, loc="best")
    width = 0.4
    for kind, offset, color in (("attention", -width / 2, "#4c72b0"), ("mlp", width / 2, "#c44e52"),
                                ("router", width / 2, "#8172b3")):
        at = [(int(c["component"].split()[1]), c["share"], c.get("method") == "estimate") for c in comps
              if c["component"].startswith("layer ") and c["component"].endswith(kind)]
        if at:
            middle.bar([i + offset for i, _, _ in at], [100 * v for _, v, _ in at], width, color=color, label=kind,
                       hatch=[("//" if est else "") for _, _, est in at], edgecolor="white", linewidth=0)
    middle.axhline(0, color="#333", lw=0.6)
    middle.set(xlabel="layer", ylabel="% of the sampler forward's k3")
    estimated = any(c.get("method") == "estimate" for c in comps)
    middle.set_title("What each layer's components add" + (" (hatched: first-order estimate)" if estimated else
                                                            ", swapped in alone"), fontsize=10)
    middle.legend(fontsize=8)
    for ax in (left, middle):
        ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
        ax.grid(alpha=0.3)
    named = sorted(comps, key=lambda c: -c["share"])[:LOCALIZATION_NAMED][::-1]
    right.barh(range(len(named)), [100 * c["share"] for c in named], color="#c44e52",
               hatch=["//" if c.get("method") == "estimate" else "" for c in named], edgecolor="white", linewidth=0)
    right.set_yticks(range(len(named)), [c["component"] + (" (est.)" if c.get("method") == "estimate" else "")
                                         for c in named], fontsize=8)
    right.set(xlabel="% of the sampler forward's k3")
    right.set_title(f"The {len(named)} largest shares", fontsize=10)
    right.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def localization(loc: dict, path: Path) -> Path:
    """``localization_figure`` saved to ``path``."""
    return save_figure(localization_figure(loc), path, dpi=DPI)


def draw_all(view: TokenView, out_dir: Path, summary: dict | None = None) -> dict[str, Path]:
    """The four figures into ``out_dir`` (and, given the ``summary``, the levels and localization figures);
    returns name -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = {
        "scatter": scatter(view, out_dir / "scatter.png"),
        "histogram": histogram(view, out_dir / "histogram.png"),
        "position": position(view, out_dir / "position.png"),
        "per_response": per_response_plot(view, out_dir / "per_response.png"),
    }
    if summary is not None:
        out["levels"] = levels(summary, out_dir / "levels.png")
        if "localization" in summary:
            out["localization"] = localization(summary["localization"], out_dir / "localization.png")
    return out
