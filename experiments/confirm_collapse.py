"""Study 7 — confirmatory: does a low-precision sampler break uncorrected RL on long responses, and does the
correction repair it? The protocol (arms, seeds, endpoint, statistics, decision rules, stress ladder) is
docs/confirm-collapse.md, committed before any run and never edited; this script carries it out.

    python -m experiments.confirm_collapse --part 1/2        # one half of rung 1's runs (one process per core)
    python -m experiments.confirm_collapse --part 2/2        # the other half
    python -m experiments.confirm_collapse --assemble        # results.json from the finished run files
    python -m experiments.confirm_collapse --rung 2 --part 1/2   # the stress rung, only when rung 1 calls for it
    python -m experiments.confirm_collapse --quick --out DIR # 2 steps, 1 seed per arm (smoke test)

Every finished run is one small JSON file under ``experiments/results/confirm_collapse/runs/`` (its endpoint,
its evaluation curve, the per-step series the early-warning rule reads, the machine, the code commit), so the
study resumes across processes, sessions and machines: a run whose file exists is never run again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import (
    RESULTS,
    Clock,
    code_commit,
    first_commit,
    log,
    machine,
    parse_part,
    train,
    write_json,
)

PROTOCOL = "docs/confirm-collapse.md"
PRESET = "chain"  # task, model and rollout settings: src/rollcorr/train/configs/chain.yaml (as study 6)
LR = 1e-4  # chain.yaml's, chosen on the fp32 arm alone for study 6
SEEDS = tuple(range(10, 20))  # fresh seeds: study 6 used 0-2
SAMPLERS = {"fp32": "hf:fp32", "q4_0": "llamacpp:q4_0", "fp16": "hf:fp16", "bf16": "hf:bf16"}
METHODS = {
    "ppo": "{preset: disabled}",  # PPO, π_old recomputed by the fp32 learner, no correction
    "tis": "{preset: tis, is_upper: 2.0}",  # token TIS: w_t = min(ρ_t, 2)
    "icepop": "{preset: icepop}",  # w_t = ρ_t · 1[0.5 ≤ ρ_t ≤ 5]
}
# rung -> (steps, arms); rung 2 runs only when rung 1's first comparison is not "reproduced"
RUNGS: dict[int, tuple[int, tuple[str, ...]]] = {
    1: (150, ("fp32/ppo", "q4_0/ppo", "q4_0/tis", "q4_0/icepop", "fp16/ppo", "bf16/ppo")),
    2: (300, ("fp32/ppo", "q4_0/ppo", "q4_0/tis")),
}
# (claimed higher, claimed lower): the primary comparisons of each rung, one Holm family per rung
COMPARISONS: dict[int, tuple[tuple[str, str], ...]] = {
    1: (("fp32/ppo", "q4_0/ppo"), ("q4_0/tis", "q4_0/ppo"), ("q4_0/icepop", "q4_0/ppo"), ("fp16/ppo", "bf16/ppo")),
    2: (("fp32/ppo", "q4_0/ppo"), ("q4_0/tis", "q4_0/ppo")),
}
SECONDARY = (("fp32/ppo", "q4_0/tis"), ("fp32/ppo", "q4_0/icepop"))  # reported with intervals, not decided
ALPHA = 0.05  # family-wise, Holm over each rung's primary comparisons
BOOTSTRAP = 10_000
EXACT_LIMIT = 250_000  # exact permutation test up to this many splits (10 vs 10: 184,756), else random
RANDOM_PERMUTATIONS = 100_000
STAT_SEED = 0
SCORE = "eval/reward"  # greedy score: share of the 14 numbers right, greedy responses, 200 held-out prompts
LAST_EVALS = 3  # endpoint: mean of the last three evaluations
COLLAPSE_DROP = 0.10
WARNING_KEYS = ("rollout_corr/prob_diff_seq_max_mean", "rollout_corr/k3_kl")
REWARD = "reward/mean"
SERIES = (REWARD, *WARNING_KEYS)
WARNING_BASELINE_STEPS, WARNING_FACTOR = 10, 3.0
REWARD_WINDOW = 10
MIN_COLLAPSES_TO_JUDGE, MIN_HIT_RATE, MAX_FALSE_ALARM_RATE = 3, 0.8, 0.2
OUT = RESULTS / "confirm_collapse"


# ---------------------------------------------------------------- statistics (pure functions)


def final_score(evals: Sequence[tuple[int, float]], last: int = LAST_EVALS) -> float:
    """The primary endpoint: mean greedy score of the last ``last`` evaluations."""
    if len(evals) < last:
        raise ValueError(f"a run needs at least {last} evaluations for the endpoint, got {len(evals)}")
    return statistics.fmean(score for _, score in evals[-last:])


def mean_ci(values: Sequence[float], n: int = BOOTSTRAP, seed: int = STAT_SEED) -> list[float]:
    """Percentile bootstrap 95 % interval of the mean."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    means = np.random.default_rng(seed).choice(x, size=(n, len(x)), replace=True).mean(axis=1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def difference_ci(a: Sequence[float], b: Sequence[float], n: int = BOOTSTRAP, seed: int = STAT_SEED) -> list[float]:
    """Percentile bootstrap 95 % interval of mean(a) − mean(b), each arm resampled on its own."""
    import numpy as np

    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = rng.choice(xa, size=(n, len(xa))).mean(axis=1) - rng.choice(xb, size=(n, len(xb))).mean(axis=1)
    return [float(np.quantile(d, 0.025)), float(np.quantile(d, 0.975))]


def permutation_p(a: Sequence[float], b: Sequence[float], seed: int = STAT_SEED) -> float:
    """Two-sided permutation p-value of mean(a) − mean(b): the share of relabellings of the pooled values whose
    |difference| is at least the observed one. Exact over every split when there are at most ``EXACT_LIMIT``,
    else ``RANDOM_PERMUTATIONS`` random ones ((count + 1) / (N + 1))."""
    import numpy as np

    pooled = np.asarray([*a, *b], dtype=float)
    na, n = len(a), len(a) + len(b)
    observed = abs(statistics.fmean(a) - statistics.fmean(b)) - 1e-12
    total = pooled.sum()
    if math.comb(n, na) <= EXACT_LIMIT:
        idx = np.array(list(itertools.combinations(range(n), na)))
        sum_a = pooled[idx].sum(axis=1)
        diffs = np.abs(sum_a / na - (total - sum_a) / (n - na))
        return float((diffs >= observed).mean())
    rng = np.random.default_rng(seed)
    perms = np.argsort(rng.random((RANDOM_PERMUTATIONS, n)), axis=1)[:, :na]
    sum_a = pooled[perms].sum(axis=1)
    diffs = np.abs(sum_a / na - (total - sum_a) / (n - na))
    return float(((diffs >= observed).sum() + 1) / (RANDOM_PERMUTATIONS + 1))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values (step-down, monotone, capped at 1), in the input order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def verdict(difference: float, p_adjusted: float, alpha: float = ALPHA) -> str:
    """The decision rule: "reproduced" when the Holm-adjusted p is below α and the claimed-higher arm is higher,
    "opposite" when it is below α the other way, else "not reproduced"."""
    if p_adjusted < alpha:
        return "reproduced" if difference > 0 else "opposite"
    return "not reproduced"


def fisher_one_sided(collapsed_low: int, n_low: int, collapsed_high: int, n_high: int) -> float:
    """One-sided Fisher exact p that the claimed-lower arm collapses more often: P(X ≥ collapsed_low) under the
    hypergeometric law of the 2×2 table with fixed margins."""
    k, n = collapsed_low + collapsed_high, n_low + n_high
    denom = math.comb(n, n_low)
    return sum(math.comb(k, x) * math.comb(n - k, n_low - x) for x in range(collapsed_low, min(k, n_low) + 1)) / denom


def sustained_collapse(evals: Sequence[tuple[int, float]], drop: float = COLLAPSE_DROP) -> int | None:
    """The onset step of a sustained collapse, or None. A run collapses when two consecutive evaluations are each
    ≥ ``drop`` below the best evaluation before them (step 0 included), or when its last evaluation is below its
    first (the starting score); the onset is the first evaluation of that pair, or the last evaluation."""
    best = -math.inf
    below = []
    for _, score in evals:
        below.append(score <= best - drop)
        best = max(best, score)
    for i in range(len(evals) - 1):
        if below[i] and below[i + 1]:
            return evals[i][0]
    if len(evals) > 1 and evals[-1][1] < evals[0][1]:
        return evals[-1][0]
    return None


def warning_step(values: Sequence[float | None], baseline: int = WARNING_BASELINE_STEPS,
                 factor: float = WARNING_FACTOR) -> int | None:
    """Steps are 1, 2, …: the first step after the first ``baseline`` steps where |value| exceeds ``factor`` ×
    the median of |value| over them (absolute values: a signed estimator's median near 0 or below would make
    any threshold meaningless). None when it never fires or the run is shorter than the baseline."""
    if len(values) <= baseline or any(v is None for v in values[:baseline]):
        return None
    threshold = factor * statistics.median(abs(v) for v in values[:baseline])
    return next((t for t, v in enumerate(values[baseline:], baseline + 1) if v is not None and abs(v) > threshold),
                None)


def reward_decline_step(rewards: Sequence[float | None], window: int = REWARD_WINDOW,
                        drop: float = COLLAPSE_DROP) -> int | None:
    """The first step where the trailing ``window``-step mean of the sampled reward is ≥ ``drop`` below the
    largest trailing mean before it (None if never): when the collapse shows in the training signal."""
    best = -math.inf
    for t in range(window, len(rewards) + 1):
        chunk = [r for r in rewards[t - window : t] if r is not None]
        if not chunk:
            continue
        m = statistics.fmean(chunk)
        if m <= best - drop:
            return t
        best = max(best, m)
    return None


def early_warning(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The secondary early-warning judgement over the runs of mismatched samplers (q4_0, fp16, bf16): a metric
    warns a collapsed run when it fires strictly before both the collapse onset and the sampled-reward decline;
    it fires falsely in a run without a sustained collapse. Judged only with ≥ ``MIN_COLLAPSES_TO_JUDGE``
    collapsed runs: "useful" when hits ≥ 80 % of them and false alarms ≤ 20 % of the others."""
    per_run, judged = [], [r for r in runs if not r["arm"].startswith("fp32/")]
    for r in judged:
        onset = sustained_collapse(r["evals"])
        decline = reward_decline_step(r["series"][REWARD])
        entry = {"arm": r["arm"], "seed": r["seed"], "collapse_step": onset, "reward_decline_step": decline}
        for key in WARNING_KEYS:
            entry[key] = warning_step(r["series"][key])
        per_run.append(entry)
    collapsed = [p for p in per_run if p["collapse_step"] is not None]
    steady = [p for p in per_run if p["collapse_step"] is None]
    metrics = {}
    for key in WARNING_KEYS:
        hits = sum(
            p[key] is not None and p[key] < min(s for s in (p["collapse_step"], p["reward_decline_step"]) if s is not None)
            for p in collapsed
        )
        false_alarms = sum(p[key] is not None for p in steady)
        if len(collapsed) < MIN_COLLAPSES_TO_JUDGE:
            call = f"not judged: {len(collapsed)} sustained collapse(s), the rule needs {MIN_COLLAPSES_TO_JUDGE}"
        else:
            useful = hits >= MIN_HIT_RATE * len(collapsed) and false_alarms <= MAX_FALSE_ALARM_RATE * max(len(steady), 1)
            call = "useful" if useful else "not useful"
        metrics[key] = {"hits": hits, "collapsed": len(collapsed), "false_alarms": false_alarms,
                        "steady": len(steady), "verdict": call}
    return {"runs": per_run, "metrics": metrics}


# ---------------------------------------------------------------- runs


def arm_overrides(arm: str, steps: int) -> list[str]:
    from rollcorr.train.config import preset_overrides

    sampler, method = arm.split("/")
    return [*preset_overrides(PRESET), f"trainer.steps={steps}", f"optim.lr={LR}",
            f"model.sampler={SAMPLERS[sampler]}", f"algorithm.correction={METHODS[method]}"]


def schedule(rung: int, seeds: Sequence[int] = SEEDS) -> list[tuple[str, int]]:
    """Seed-major order: every arm of seed 10, then of seed 11, …, so a partly finished study stays balanced."""
    return [(arm, seed) for seed in seeds for arm in RUNGS[rung][1]]


def run_file(out: Path, rung: int, arm: str, seed: int) -> Path:
    return out / "runs" / f"rung{rung}_{arm.replace('/', '-')}_s{seed}.json"


def protocol_commit() -> str | None:
    """The commit that added the protocol file (its first commit)."""
    return first_commit(PROTOCOL)


def one_run(rung: int, arm: str, seed: int, out: Path, quick: bool) -> dict[str, Any]:
    """Train one run (or read its file back) and return its record."""
    path = run_file(out, rung, arm, seed)
    steps = 2 if quick else RUNGS[rung][0]
    overrides = arm_overrides(arm, steps)
    if quick:
        overrides += ["trainer.eval_every=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                      "task.eval_prompts=4", "rollout.max_new_tokens=10"]
    overrides.append(f"trainer.seed={seed}")
    if path.is_file():
        record = json.loads(path.read_text())
        if record["overrides"] != overrides:
            raise SystemExit(f"{path} holds a run of other settings; move it away to rerun")
        return record
    log(f"  rung {rung} {arm} seed {seed}")
    runs_root = out / "run_dirs" if not out.is_relative_to(RESULTS) else RESULTS.parent.parent / "runs" / "experiments" / out.name
    result = train(overrides, runs_root / f"rung{rung}_{arm.replace('/', '-')}_s{seed}")
    records = result["records"]
    evals = [(r["step"], float(r[SCORE])) for r in records if r.get(SCORE) is not None]
    by_step = {r["step"]: r for r in records if r["step"] >= 1}
    series = {k: [_round(by_step.get(t, {}).get(k)) for t in range(1, steps + 1)] for k in SERIES}
    record = {"rung": rung, "arm": arm, "seed": seed, "steps": steps, "overrides": overrides,
              "final_score": final_score(evals, min(LAST_EVALS, len(evals))), "evals": evals, "series": series,
              "stopped": result["stopped"], "seconds": result["seconds"], "machine": machine(),
              "code_commit": code_commit()}
    write_json(record, path)
    return record


def _round(x: Any) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(f"{float(x):.6g}")


# ---------------------------------------------------------------- assembly


def read_runs(out: Path, rung: int) -> list[dict[str, Any]]:
    runs = []
    for arm, seed in schedule(rung):
        path = run_file(out, rung, arm, seed)
        if path.is_file():
            runs.append(json.loads(path.read_text()))
    return runs


def rung_summary(runs: Sequence[dict[str, Any]], rung: int) -> dict[str, Any]:
    """Per-arm endpoint and collapses, the primary comparisons with Holm's rule, the secondary ones."""
    arms: dict[str, Any] = {}
    scores = {arm: [r["final_score"] for r in runs if r["arm"] == arm] for arm in RUNGS[rung][1]}
    collapses = {arm: sum(sustained_collapse(r["evals"]) is not None for r in runs if r["arm"] == arm) for arm in scores}
    for arm, values in scores.items():
        if not values:
            continue
        arms[arm] = {"seeds": len(values), "final_score_mean": statistics.fmean(values),
                     "final_score_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                     "final_score_ci95": mean_ci(values) if len(values) > 1 else None,
                     "collapses": collapses[arm]}
    complete = all(len(scores[a]) == len(SEEDS) for a in RUNGS[rung][1])
    tests: dict[str, Any] = {}
    pairs = [(hi, lo) for hi, lo in COMPARISONS[rung] if len(scores[hi]) > 1 and len(scores[lo]) > 1]
    raw = [permutation_p(scores[hi], scores[lo]) for hi, lo in pairs]
    for (hi, lo), p, p_adj in zip(pairs, raw, holm(raw)):
        d = statistics.fmean(scores[hi]) - statistics.fmean(scores[lo])
        tests[f"{hi} vs {lo}"] = {
            "difference": d, "ci95": difference_ci(scores[hi], scores[lo]), "p_value": p, "p_holm": p_adj,
            "verdict": verdict(d, p_adj) if complete else "pending: the study is not complete",
            "collapses": [collapses[hi], collapses[lo]],
            "collapse_fisher_p": fisher_one_sided(collapses[lo], len(scores[lo]), collapses[hi], len(scores[hi])),
        }
    secondary = {}
    for hi, lo in SECONDARY:
        if len(scores.get(hi, [])) > 1 and len(scores.get(lo, [])) > 1:
            secondary[f"{hi} vs {lo}"] = {"difference": statistics.fmean(scores[hi]) - statistics.fmean(scores[lo]),
                                          "ci95": difference_ci(scores[hi], scores[lo])}
    return {"steps": RUNGS[rung][0], "complete": complete, "runs": len(runs), "arms": arms, "tests": tests,
            "secondary": secondary, "early_warning": early_warning(runs)}


def rung2_called(rung1: dict[str, Any]) -> bool | None:
    """The stress ladder's rule: rung 2 runs when rung 1 is complete and its first comparison is not reproduced
    (None while rung 1 is incomplete)."""
    if not rung1["complete"]:
        return None
    first = "{} vs {}".format(*COMPARISONS[1][0])
    return rung1["tests"][first]["verdict"] != "reproduced"


def assemble(out: Path) -> dict[str, Any]:
    rung1 = rung_summary(read_runs(out, 1), 1)
    summary: dict[str, Any] = {"protocol": PROTOCOL, "protocol_commit": protocol_commit(), "alpha": ALPHA,
                               "complete": rung1["complete"], "arms": rung1["arms"], "tests": rung1["tests"],
                               "secondary": rung1["secondary"], "rung2_called": rung2_called(rung1)}
    runs2 = read_runs(out, 2)
    if runs2:
        summary["rung2"] = rung_summary(runs2, 2)
    machines = sorted({json.dumps(r["machine"], sort_keys=True) for r in read_runs(out, 1) + runs2})
    report = {"study": "confirm_collapse", "summary": summary, "rung1": rung1, "seeds": list(SEEDS),
              "machines": [json.loads(m) for m in machines],
              "code_commits": sorted({r["code_commit"] or "" for r in read_runs(out, 1) + runs2})}
    write_json(report, out / "results.json")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rung", type=int, choices=sorted(RUNGS), default=1)
    parser.add_argument("--part", default="1/1", help="K/N: run every N-th run of the schedule from the K-th")
    parser.add_argument("--assemble", action="store_true", help="only assemble results.json from the run files")
    parser.add_argument("--quick", action="store_true", help="2 steps, first seed (smoke test); needs --out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick writes its tiny runs elsewhere than the study's results: give --out")
    k, n = parse_part(parser, args.part)
    out = (args.out or OUT).resolve()
    clock = Clock()
    if not args.assemble:
        if args.rung == 2 and not args.quick and rung2_called(rung_summary(read_runs(out, 1), 1)) is not True:
            parser.error("rung 2 runs only when rung 1 is complete and its first comparison is not reproduced")
        todo = schedule(args.rung, SEEDS[:1] if args.quick else SEEDS)[k - 1 :: n]
        for arm, seed in todo:
            one_run(args.rung, arm, seed, out, args.quick)
    report = assemble(out)
    rung2 = report["summary"].get("rung2")
    runs = f"{report['rung1']['runs']} rung-1 runs" + (f", {rung2['runs']} rung-2 runs" if rung2 else "")
    print(f"confirm_collapse: {runs}, wall time {clock.seconds:.1f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
