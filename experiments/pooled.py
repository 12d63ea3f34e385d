"""Exploratory, written after studies 6 and 7 had been seen — it decides nothing: the fp32 − q4_0 comparison of
uncorrected GRPO pooled over the studies that ran it, the same for half-precision samplers, and study 6's
one-evaluation dips counted in every run of both studies.

    python -m experiments.pooled        # experiments/results/pooled/results.json from the studies' results

Each study's difference of mean final scores uses its own endpoint (study 6: the last evaluation; study 7: the
mean of the last three), with its standard error √(s_a²/n_a + s_b²/n_b); the pooled difference is their
inverse-variance weighted mean, SE = 1 / √(Σ 1/SE_i²), and its 95 % interval ± 1.96 SE (a normal approximation,
treating the studies' runs as independent: study 7's rungs share seeds 10–19 but not their runs). A *dip* is
study 6's collapse criterion: one evaluation ≥ 0.10 below the best evaluation before it (step 0 included);
q4_0 runs against fp32, fp16 and bf16 runs, every arm, one-sided Fisher exact p.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from experiments.common import RESULTS, write_json
from experiments.long_mismatch import collapse_step
from experiments.power import fisher_greater

OUT = RESULTS / "pooled"
Z95 = 1.959964


def _study6() -> dict[str, list[float]]:
    """Study 6's final score per run, by arm (its endpoint: the last evaluation's eval/reward)."""
    r = json.loads((RESULTS / "long_mismatch/results.json").read_text())
    return {arm: next(iter(c.values()))["eval/reward"]["values"] for arm, c in r["final"].items()}


def _study7() -> dict[str, dict[str, list[float]]]:
    """Study 7's final score per run, by rung and arm (the mean of the last three evaluations)."""
    out: dict[str, dict[str, list[float]]] = {"1": {}, "2": {}}
    for path in sorted((RESULTS / "confirm_collapse/runs").glob("*.json")):
        run = json.loads(path.read_text())
        out[path.name[4]].setdefault(run["arm"], []).append(run["final_score"])
    return out


def difference(high: list[float], low: list[float]) -> dict[str, float]:
    se = math.sqrt(statistics.variance(high) / len(high) + statistics.variance(low) / len(low))
    return {"difference": statistics.fmean(high) - statistics.fmean(low), "se": se, "n": [len(high), len(low)]}


def pooled(parts: dict[str, dict[str, float]]) -> dict[str, Any]:
    weights = {k: 1 / p["se"] ** 2 for k, p in parts.items()}
    total = sum(weights.values())
    mean = sum(weights[k] * p["difference"] for k, p in parts.items()) / total
    se = 1 / math.sqrt(total)
    return {"studies": parts, "difference": mean, "ci95": [mean - Z95 * se, mean + Z95 * se]}


def dip_counts() -> dict[str, Any]:
    """Runs with a one-evaluation dip (study 6's criterion) in studies 6 and 7: q4_0 against fp32/fp16/bf16."""
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    r6 = json.loads((RESULTS / "long_mismatch/results.json").read_text())
    for arm, cells in r6["runs"].items():
        runs += [(arm, run["records"]) for run in next(iter(cells.values()))["runs"]]
    for path in sorted((RESULTS / "confirm_collapse/runs").glob("*.json")):
        run = json.loads(path.read_text())
        runs.append((run["arm"], [{"step": step, "eval/reward": score} for step, score in run["evals"]]))
    counts = {"q4_0": [0, 0], "fp32, fp16, bf16": [0, 0]}
    for arm, records in runs:
        group = "q4_0" if arm.startswith("q4_0") else "fp32, fp16, bf16" if arm.split("/")[0] in ("fp32", "fp16", "bf16") else None
        if group is not None:
            counts[group][0] += collapse_step(records) is not None
            counts[group][1] += 1
    (a, n_a), (b, n_b) = counts["q4_0"], counts["fp32, fp16, bf16"]
    return {"dips": counts, "fisher_p": fisher_greater(a, n_a, b, n_b)}


def compute() -> dict[str, Any]:
    s6, s7 = _study6(), _study7()
    q4 = {"6": difference(s6["fp32/ppo"], s6["q4_0/ppo"]),
          "7 rung 1": difference(s7["1"]["fp32/ppo"], s7["1"]["q4_0/ppo"]),
          "7 rung 2": difference(s7["2"]["fp32/ppo"], s7["2"]["q4_0/ppo"])}
    half = {"6 bf16": difference(s6["fp32/ppo"], s6["bf16/ppo"]),
            "7 rung 1 bf16": difference(s7["1"]["fp32/ppo"], s7["1"]["bf16/ppo"]),
            "7 rung 1 fp16": difference(s7["1"]["fp32/ppo"], s7["1"]["fp16/ppo"])}
    return {"what": "exploratory, written after studies 6 and 7 were seen; decides nothing (experiments/pooled.py)",
            "fp32_minus_q4_0": pooled(q4), "fp32_minus_half": pooled(half), **dip_counts()}


def paragraph(r: dict[str, Any]) -> str:
    """The exploratory paragraph of docs/results.md, from the results file."""
    q4, half = r["fp32_minus_q4_0"], r["fp32_minus_half"]

    def each(p: dict[str, Any]) -> str:
        return ", ".join(f"study {k} {v['difference']:+.3f}" for k, v in p["studies"].items())

    (a, n_a), (b, n_b) = r["dips"]["q4_0"], r["dips"]["fp32, fp16, bf16"]
    return (
        "**Exploratory: pooled across studies (written after studies 6 and 7 were seen; it decides nothing).** "
        f"fp32 − q4_0 of uncorrected GRPO is positive in every study that ran it ({each(q4)}); pooled by inverse "
        f"variance it is {q4['difference']:+.3f}, 95 % interval [{q4['ci95'][0]:+.3f}, {q4['ci95'][1]:+.3f}]. "
        f"fp32 − a half-precision sampler is not ({each(half)}; pooled {half['difference']:+.3f} "
        f"[{half['ci95'][0]:+.3f}, {half['ci95'][1]:+.3f}]). Study 6's one-evaluation dips (≥ 0.10 below the best "
        f"evaluation before it) happen in {a} of {n_a} q4_0 runs of studies 6 and 7 and in {b} of {n_b} fp32, fp16 "
        f"and bf16 runs (one-sided Fisher p = {r['fisher_p']:.3f}). The pattern looks like a dose — only the "
        "largest mismatch tested costs anything — which is what study 9 (docs/dose-study.md) was written to test. "
        "Each study's own endpoint is used; the interval is a normal approximation (`python -m experiments.pooled`)."
    )


def main() -> int:
    report = compute()
    write_json(report, OUT / "results.json")
    print(paragraph(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
