"""The end-of-run PNG: reward, greedy accuracy, staleness, and the sampler/learner mismatch over steps."""

from __future__ import annotations

from pathlib import Path

from rollcorr.plotting import save_figure

PANELS = (
    ("reward", ("reward/mean",)),
    ("greedy accuracy (held out)", ("eval/accuracy",)),
    ("version lag (tokens)", ("staleness/lag_mean", "staleness/lag_max")),
    ("mismatch", ("rollout_corr/kl", "rollout_corr/log_ppl_abs_diff")),
    (
        "discrepancy / drift (|log| mean)",
        ("factors/discrepancy_log_abs_mean", "factors/drift_log_abs_mean"),
    ),
    (
        "rejected / truncated fraction",
        ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_ratio_fraction_high"),
    ),
)


def plot_run(records: list[dict], path: Path) -> Path:
    """Write the curves of ``records`` (metrics.jsonl rows) to ``path`` (temp file then rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout()
    return save_figure(fig, path)
