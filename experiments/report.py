"""Markdown tables of the studies' results.json files (what docs/results.md shows), printed to stdout.

    python -m experiments.report                      # every study whose results.json exists
    python -m experiments.report quantised_rollouts   # one study

Each cell is mean ± sample std over seeds of a run's last logged value (studies 2–4) or of a per-run
number (cost, throughput). Under each table: the pairs of arms whose greedy accuracy differs by more than
the combined spread (``experiments.common.separated``), higher first.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from experiments import common
from experiments.common import RESULTS, separated


def cell(s: dict[str, Any] | None, fmt: str = ".3f", scale: float = 1.0) -> str:
    if not s or s.get("mean") is None:
        return "–"
    return f"{s['mean'] * scale:{fmt}} ± {s['std'] * scale:{fmt}}"


def one_minus(s: dict[str, Any] | None) -> dict[str, Any] | None:
    """1 − x of a summary (keep ratio from a rejected fraction); the spread is unchanged."""
    if not s or s.get("mean") is None:
        return None
    return {**s, "mean": 1.0 - s["mean"]}


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def separations(acc: dict[str, dict[str, Any]]) -> str:
    pairs = []
    for a, b in itertools.combinations(acc, 2):
        if separated(acc[a], acc[b]):
            hi, lo = (a, b) if acc[a]["mean"] > acc[b]["mean"] else (b, a)
            pairs.append(f"{hi} > {lo}")
    return "Separated beyond the spread: " + ("; ".join(pairs) if pairs else "none") + "."


def by_label(final: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{grid label: {arm: metrics}} from {arm: {grid label: metrics}}."""
    out: dict[str, dict[str, Any]] = {}
    for arm, cells in final.items():
        for label, metrics in cells.items():
            out.setdefault(label, {})[arm] = metrics
    return out


def run_mean(r: dict[str, Any], arm: str, label: str, key: str) -> dict[str, Any]:
    """``common.run_mean`` over the seeds of one arm and grid label of a results file."""
    return common.run_mean(r["runs"][arm][label]["runs"], key)


def code_labels(r: dict[str, Any], arm: str) -> str:
    """The code versions (``common.code_label``) of an arm's runs, each once."""
    runs = [run for cell in r["runs"][arm].values() for run in cell["runs"]]
    return ", ".join(dict.fromkeys(common.code_label(run) for run in runs))


def quantised_rollouts(r: dict[str, Any]) -> str:
    parts = []
    for label, arms in by_label(r["final"]).items():
        rows = [
            [arm, cell(m["eval/accuracy"]), cell(m["reward/mean"]), cell(m.get("actor/entropy")),
             cell(run_mean(r, arm, label, "actor/ppo_kl"), ".1e"),
             cell(run_mean(r, arm, label, "rollout_corr/kl"), ".1e"),
             cell(run_mean(r, arm, label, "rollout_corr/prob_diff_max"), ".2f")]
            for arm, m in arms.items()
        ]
        header = ["arm", "greedy accuracy", "sampled reward", "entropy", "actor/ppo_kl (run mean)",
                  "rollout_corr/kl (run mean)", "max \\|Δp\\| (run mean)"]
        parts.append(f"**{label}**, last step of {r['steps']}\n\n" + table(header, rows))
        parts.append(separations({a: m["eval/accuracy"] for a, m in arms.items()}))
    return "\n\n".join(parts)


def staleness(r: dict[str, Any]) -> str:
    final = {arm: next(iter(cells.values())) for arm, cells in r["final"].items()}
    rows = []
    for arm, m in final.items():
        cost = r["cost"][arm]
        label = next(iter(r["runs"][arm]))
        masked = run_mean(r, arm, label, "rollout_corr/rollout_rs_masked_fraction")
        keep = cell(one_minus(masked)) if masked["mean"] is not None else "1 (no rule)"
        rows.append([arm, cell(m["eval/accuracy"]), keep,
                     cell(m["actor/pg_clipfrac"]), cell(m["proximal/ewma_resets"], ".1f"),
                     f"{cost['time/step_s']['mean']:.3f}", f"{cost['proximal/seconds']['mean']:.3f}",
                     f"{cost['proximal/extra_bytes']['mean'] / 2**20:.2f}", code_labels(r, arm)])
    header = ["arm", "greedy accuracy", "keep ratio (run mean)", "PPO clip fraction", "EWMA resets", "s / step",
              "π_old s / step", "extra MiB", "code"]
    parts = [f"last step of {r['steps']}\n\n" + table(header, rows)]
    blocks = sorted({arm.split("/")[0] for arm in final})
    for block in blocks:
        acc = {a: m["eval/accuracy"] for a, m in final.items() if a.split("/")[0] in (block, "lag0")}
        parts.append(f"{block} (with lag0): " + separations(acc))
    return "\n\n".join(parts)


def oapl_lag(r: dict[str, Any]) -> str:
    final = {arm: next(iter(cells.values())) for arm, cells in r["final"].items()}
    held = {arm: next(iter(cells.values())) for arm, cells in r["held_out"].items()}
    ks = list(next(iter(held.values()))["pass_at_k"])
    rows = [
        [arm, cell(m["eval/accuracy"]), cell(m["reward/mean"]), cell(m.get("actor/entropy")),
         cell(held[arm]["entropy"]), *(cell(held[arm]["pass_at_k"][k]) for k in ks)]
        for arm, m in final.items()
    ]
    header = ["arm", "greedy accuracy", "sampled reward", "entropy (train)", "entropy (held-out)",
              *(f"pass@{k}" for k in ks)]
    out = f"last step of {r['steps']} ({r['steps'] * (r['samples_per_step'] or 0)} samples)\n\n"
    out += table(header, rows) + "\n\n" + separations({a: m["eval/accuracy"] for a, m in final.items()})
    return out


def throughput(r: dict[str, Any]) -> str:
    speed = {arm: next(iter(cells.values())) for arm, cells in r["speed"].items()}
    rows = []
    for arm, s in speed.items():
        runs = next(iter(r["runs"][arm].values()))["runs"]
        finals = [run["final_accuracy"] for run in runs]
        mean_acc = sum(finals) / len(finals) if all(f is not None for f in finals) else None
        rows.append([arm, cell(s["samples_per_s"], ".0f"), cell(s["step_seconds_mean"]),
                     cell(s["time_to_target_s"], ".1f"), cell(s["step_to_target"], ".0f"),
                     f"{mean_acc:.3f}" if mean_acc is not None else "–"])
    header = ["mode", "samples / s", "s / step", f"s to accuracy ≥ {r['target_accuracy']}", "step reached",
              "final accuracy (mean)"]
    return table(header, rows)


def long_mismatch(r: dict[str, Any]) -> str:
    final = {arm: next(iter(cells.values())) for arm, cells in r["final"].items()}
    rows = []
    for arm, m in final.items():
        label = next(iter(r["runs"][arm]))
        rejected = [
            run_mean(r, arm, label, k)
            for k in (
                "rollout_corr/rollout_rs_seq_masked_fraction",
                "rollout_corr/rollout_is_seq_fraction_high",
            )
        ]
        rejected = next((x for x in rejected if x["mean"] is not None), None)
        rows.append([arm, cell(m["eval/reward"]), cell(m["reward/mean"]), cell(m.get("actor/entropy")),
                     cell(run_mean(r, arm, label, "rollout_corr/k3_kl"), ".1e"),
                     cell(run_mean(r, arm, label, "rollout_corr/prob_diff_seq_max_mean"), ".3f"),
                     cell(run_mean(r, arm, label, "rollout_corr/rollout_is_eff_sample_size"), ".3f"),
                     cell(rejected), cell(run_mean(r, arm, label, "response/length_mean"), ".1f")])
    header = ["arm", "greedy score", "sampled reward", "entropy", "k3 KL (run mean)",
              "max \\|Δp\\| per seq. (run mean)", "ESS (run mean)", "rejected share (run mean)",
              "response length"]
    out = f"last step of {r['steps']}, lr {r['lr']}\n\n" + table(header, rows)
    out += "\n\n" + separations({a: m["eval/reward"] for a, m in final.items()})
    return out + "\n\n" + early_warning_table(r.get("early_warning", {}))


def early_warning_table(warnings: dict[str, Any]) -> str:
    """Per arm: which runs collapsed (step), and per warning metric whether it fired before every collapse and
    in how many runs that did not collapse it fired anyway."""
    keys = ("rollout_corr/k3_kl", "rollout_corr/prob_diff_seq_max_mean")
    rows = []
    for arm, w in warnings.items():
        steps = [str(p["collapse_step"]) for p in w["runs"] if p["collapse_step"] is not None]
        collapsed = f"{len(steps)} of {len(w['runs'])}" + (f" (steps {', '.join(steps)})" if steps else "")
        cells = []
        for k in keys:
            first = ("yes" if w["warned_first"][k] else "no") if w["collapsed"] else "–"
            cells.append(f"{first}; {w['false_alarms'][k]} of {w['steady']}")
        rows.append([arm, collapsed, *cells])
    header = ["arm", "collapsed (eval ≥ 10 points below its best)",
              "k3 KL > 3× its first-10-step median before every collapse; fired in runs without one (post-hoc)",
              "max \\|Δp\\| per seq.: the same"]
    return table(header, rows)


STUDIES = {"quantised_rollouts": quantised_rollouts, "staleness": staleness, "oapl_lag": oapl_lag,
           "throughput": throughput, "long_mismatch": long_mismatch}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", default=list(STUDIES), help=f"any of {', '.join(STUDIES)}")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    unknown = [s for s in args.studies if s not in STUDIES]
    if unknown:
        parser.error(f"unknown study {unknown[0]!r}; choose from {', '.join(STUDIES)}")
    for name in args.studies:
        path = args.results / name / "results.json"
        if not path.is_file():
            print(f"## {name}: no results.json\n")
            continue
        r = json.loads(path.read_text())
        print(f"## {name} (wall time of the last invocation {r['wall_seconds']:.0f} s)\n")
        print(STUDIES[name](r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
