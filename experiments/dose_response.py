"""Study 9 — dose-response: how much does a sampler/learner mismatch cost uncorrected RL, as the mismatch
grows, and does token TIS repair it? The protocol (doses, arms, seeds, endpoints, statistics, decision rules)
is docs/dose-study.md, committed before any run and never edited; this script carries it out.

    python -m experiments.dose_response --part 1/2        # one half of the 70 runs (one process per core)
    python -m experiments.dose_response --part 2/2        # the other half
    python -m experiments.dose_response --assemble        # results.json from the finished run files
    python -m experiments.dose_response --quick --out DIR # 2 steps, 1 seed per arm (smoke test)

Every finished run is one small JSON file under ``experiments/results/dose_response/runs/`` (its endpoint, its
evaluation curve, the per-step mismatch series, the machine, the code commit); a run whose file exists is never
run again, so the study resumes across processes, sessions and machines.
"""

from __future__ import annotations

import argparse
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
from experiments.confirm_collapse import (
    difference_ci,
    final_score,
    fisher_one_sided,
    holm,
    mean_ci,
    sustained_collapse,
    verdict,
)
from experiments.power import mde_from_sd, mde_two_sample

PROTOCOL = "docs/dose-study.md"
PRESET = "chain"  # task, model and rollout settings: src/rollcorr/train/configs/chain.yaml (as studies 6 and 7)
LR = 1e-4
STEPS = 300  # study 7's rung 2
SEEDS = tuple(range(20, 30))  # fresh: studies 6 and 7 used 0-2 and 10-19
# dose name -> (sampler, dose rank); the doses were fixed by experiments/dose_audit.py (doses.json) before any run
DOSES: dict[str, tuple[str, int]] = {"fp32": ("hf:fp32", 0), "rtn4": ("hf:rtn4", 1), "rtn3": ("hf:rtn3", 2),
                                     "rtn2": ("hf:rtn2", 3)}
METHODS = {"ppo": "{preset: disabled}", "tis": "{preset: tis, is_upper: 2.0}"}  # as study 7
ARMS = ("fp32/ppo", "rtn4/ppo", "rtn4/tis", "rtn3/ppo", "rtn3/tis", "rtn2/ppo", "rtn2/tis")
MISMATCHED = ("rtn4", "rtn3", "rtn2")
ALPHA, FAMILY = 0.05, 2  # Holm over H1 and H2
BOOTSTRAP = 10_000
PERMUTATIONS = 100_000  # Monte Carlo permutation tests (exact enumeration is out of reach: 4.7e21 / 6.3e15 splits)
STAT_SEED = 0
SCORE = "eval/reward"
LAST_EVALS = 3
DIP_DROP = 0.10
SERIES = ("reward/mean", "rollout_corr/k3_kl", "rollout_corr/prob_diff_seq_max_mean", "rollout_corr/prob_diff_max")
OUT = RESULTS / "dose_response"


# ---------------------------------------------------------------- statistics (pure functions)


def slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of y on x."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx


def trend_test(groups: Sequence[Sequence[float]], ranks: Sequence[int], n: int = PERMUTATIONS,
               seed: int = STAT_SEED) -> dict[str, Any]:
    """H1: the slope of the score on the dose rank over every run of ``groups`` (group i has rank ranks[i]),
    its two-sided permutation p (relabel the pooled scores among the groups, sizes fixed; (count + 1) / (n + 1)),
    a percentile-bootstrap 95 % interval (each group resampled on its own) and the MDE of the slope."""
    import numpy as np

    x = np.concatenate([[r] * len(g) for g, r in zip(groups, ranks)]).astype(float)
    y = np.concatenate([np.asarray(g, dtype=float) for g in groups])
    xc = x - x.mean()
    sxx = float((xc**2).sum())
    observed = float((xc * (y - y.mean())).sum() / sxx)
    rng = np.random.default_rng(seed)
    count = 0
    for start in range(0, n, 10_000):
        m = min(10_000, n - start)
        perm = y[np.argsort(rng.random((m, len(y))), axis=1)]
        count += int((np.abs(perm @ xc / sxx) >= abs(observed) - 1e-12).sum())
    p = (count + 1) / (n + 1)
    boot = np.empty(BOOTSTRAP)
    for i in range(BOOTSTRAP):
        yb = np.concatenate([rng.choice(np.asarray(g, float), size=len(g)) for g in groups])
        boot[i] = (xc * (yb - yb.mean())).sum() / sxx
    within = sum((len(g) - 1) * statistics.variance(g) for g in groups)
    df = len(y) - len(groups)
    sd = math.sqrt(within / df)
    return {"slope": observed, "ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
            "p_value": p, "mde_slope": mde_from_sd(sd, 1 / math.sqrt(sxx), df, ALPHA, FAMILY),
            "pooled_sd": sd}


def stratified_test(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], n: int = PERMUTATIONS,
                    seed: int = STAT_SEED) -> dict[str, Any]:
    """H2: the mean over strata of mean(a) − mean(b) (each stratum one dose: a = tis, b = ppo), its two-sided
    permutation p (a/b labels relabelled within each stratum), a bootstrap 95 % interval (each arm resampled on
    its own) and the MDE (the two-sample formula with the stratum-pooled sd and n per arm summed)."""
    import numpy as np

    def stat(values: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
        return float(np.mean([a.mean() - b.mean() for a, b in values]))

    arrays = [(np.asarray(a, float), np.asarray(b, float)) for a, b in pairs]
    observed = stat(arrays)
    rng = np.random.default_rng(seed)
    diffs = np.zeros(n)
    for a, b in arrays:
        pooled = np.concatenate([a, b])
        perm = pooled[np.argsort(rng.random((n, len(pooled))), axis=1)]
        diffs += perm[:, : len(a)].mean(axis=1) - perm[:, len(a) :].mean(axis=1)
    diffs /= len(arrays)
    p = float(((np.abs(diffs) >= abs(observed) - 1e-12).sum() + 1) / (n + 1))
    boot = np.zeros(BOOTSTRAP)
    for a, b in arrays:
        boot += rng.choice(a, size=(BOOTSTRAP, len(a))).mean(1) - rng.choice(b, size=(BOOTSTRAP, len(b))).mean(1)
    boot /= len(arrays)
    within = sum((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1) for a, b in arrays)
    df = sum(len(a) + len(b) - 2 for a, b in arrays)
    sd = math.sqrt(within / df)
    # the mean over k strata of a difference with n_a, n_b per arm: SE = sd · √(Σ (1/n_a + 1/n_b)) / k
    se_factor = math.sqrt(sum(1 / len(a) + 1 / len(b) for a, b in arrays)) / len(arrays)
    return {"difference": observed, "ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
            "p_value": p, "mde": mde_from_sd(sd, se_factor, df, ALPHA, FAMILY), "pooled_sd": sd}


def dips(evals: Sequence[tuple[int, float]], drop: float = DIP_DROP) -> int:
    """How many evaluations are each ≥ ``drop`` below the best evaluation before them (step 0 included)."""
    best, count = -math.inf, 0
    for _, score in evals:
        count += score <= best - drop
        best = max(best, score)
    return count


# ---------------------------------------------------------------- runs


def arm_overrides(arm: str, steps: int) -> list[str]:
    from rollcorr.train.config import preset_overrides

    dose, method = arm.split("/")
    return [*preset_overrides(PRESET), f"trainer.steps={steps}", f"optim.lr={LR}",
            f"model.sampler={DOSES[dose][0]}", f"algorithm.correction={METHODS[method]}"]


def schedule(seeds: Sequence[int] = SEEDS) -> list[tuple[str, int]]:
    """Seed-major order: every arm of seed 20, then of seed 21, …, so a partly finished study stays balanced."""
    return [(arm, seed) for seed in seeds for arm in ARMS]


def run_file(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm.replace('/', '-')}_s{seed}.json"


def protocol_commit() -> str | None:
    return first_commit(PROTOCOL)


def one_run(arm: str, seed: int, out: Path, quick: bool) -> dict[str, Any]:
    """Train one run (or read its file back) and return its record."""
    path = run_file(out, arm, seed)
    steps = 2 if quick else STEPS
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
    log(f"  {arm} seed {seed}")
    runs_root = out / "run_dirs" if not out.is_relative_to(RESULTS) else RESULTS.parent.parent / "runs" / "experiments" / out.name
    result = train(overrides, runs_root / f"{arm.replace('/', '-')}_s{seed}")
    if result["stopped"] and "--resume" in result["stopped"]:  # a signal, not the trainer's guard: no run file
        raise SystemExit(f"{arm} seed {seed} was interrupted ({result['stopped']}); run the part again to resume it")
    records = result["records"]
    evals = [(r["step"], float(r[SCORE])) for r in records if r.get(SCORE) is not None]
    by_step = {r["step"]: r for r in records if r["step"] >= 1}
    series = {k: [_round(by_step.get(t, {}).get(k)) for t in range(1, steps + 1)] for k in SERIES}
    record = {"arm": arm, "seed": seed, "steps": steps, "overrides": overrides,
              "final_score": final_score(evals, min(LAST_EVALS, len(evals))), "evals": evals, "series": series,
              "stopped": result["stopped"], "seconds": result["seconds"], "machine": machine(),
              "code_commit": code_commit()}
    write_json(record, path)
    return record


def _round(x: Any) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(f"{float(x):.6g}")


# ---------------------------------------------------------------- assembly


def read_runs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for arm, seed in schedule() if (p := run_file(out, arm, seed)).is_file()]


def collapsed(run: dict[str, Any]) -> bool:
    """A sustained collapse (study 7's rule), or a run the trainer stopped before its last step."""
    return sustained_collapse(run["evals"]) is not None or run.get("stopped") is not None


def _series_mean(run: dict[str, Any], key: str) -> float | None:
    values = [v for v in run["series"].get(key, []) if v is not None]
    return statistics.fmean(values) if values else None


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm endpoint, dips and collapses, training-time mismatch; H1 and H2 with Holm's rule; secondaries."""
    scores = {arm: [r["final_score"] for r in runs if r["arm"] == arm] for arm in ARMS}
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    complete = all(len(scores[a]) == len(SEEDS) for a in ARMS)
    arms: dict[str, Any] = {}
    for arm, values in scores.items():
        if not values:
            continue
        mism = {key.split("/")[-1]: [m for r in by_arm[arm] if (m := _series_mean(r, key)) is not None]
                for key in SERIES[1:]}
        arms[arm] = {"seeds": len(values), "final_score_mean": statistics.fmean(values),
                     "final_score_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                     "final_score_ci95": mean_ci(values) if len(values) > 1 else None,
                     "runs_with_a_dip": sum(dips(r["evals"]) > 0 for r in by_arm[arm]),
                     "collapses": sum(collapsed(r) for r in by_arm[arm]),
                     "stopped": sum(r.get("stopped") is not None for r in by_arm[arm]),
                     "training_mismatch_median": {k: statistics.median(v) if v else None for k, v in mism.items()}}
    tests: dict[str, Any] = {}
    ppo = [f"{d}/ppo" for d in DOSES]
    if all(len(scores[a]) > 1 for a in ppo):
        tests["H1"] = {"what": "harm: slope of the ppo arms' final score on the dose rank (fp32 = 0 … rtn2 = 3)",
                       **trend_test([scores[a] for a in ppo], [DOSES[a.split("/")[0]][1] for a in ppo])}
    if all(len(scores[f"{d}/{m}"]) > 1 for d in MISMATCHED for m in METHODS):
        tests["H2"] = {"what": "repair: tis − ppo, the mean over the three doses of the per-dose difference",
                       **stratified_test([(scores[f"{d}/tis"], scores[f"{d}/ppo"]) for d in MISMATCHED])}
    names = list(tests)
    for name, p_adj in zip(names, holm([tests[n]["p_value"] for n in names])):
        t = tests[name]
        effect = -t["slope"] if name == "H1" else t["difference"]  # H1 claims a negative slope (harm)
        t["p_holm"] = p_adj
        t["verdict"] = verdict(effect, p_adj) if complete and len(names) == FAMILY else "pending: the study is not complete"
    secondary: dict[str, Any] = {}
    reference = scores["fp32/ppo"]
    for arm in ARMS[1:]:
        if len(scores[arm]) > 1 and len(reference) > 1:
            secondary[f"{arm} vs fp32/ppo"] = {
                "difference": statistics.fmean(scores[arm]) - statistics.fmean(reference),
                "ci95": difference_ci(scores[arm], reference),
                "mde": mde_two_sample(scores[arm], reference, ALPHA, 1),
                "dip_runs": [arms[arm]["runs_with_a_dip"], arms["fp32/ppo"]["runs_with_a_dip"]],
                "dip_fisher_p": fisher_one_sided(arms[arm]["runs_with_a_dip"], len(scores[arm]),
                                                 arms["fp32/ppo"]["runs_with_a_dip"], len(reference)),
                "collapses": [arms[arm]["collapses"], arms["fp32/ppo"]["collapses"]],
                "collapse_fisher_p": fisher_one_sided(arms[arm]["collapses"], len(scores[arm]),
                                                      arms["fp32/ppo"]["collapses"], len(reference)),
            }
    return {"complete": complete, "runs": len(runs), "arms": arms, "tests": tests, "secondary": secondary}


def answer(summary: dict[str, Any], d3_ratio: float) -> str | None:
    """The study's answer in one sentence, as the protocol's rules give it (None until complete); ``d3_ratio``
    is rtn2's audited k3 over llamacpp:q4_0's (doses.json). Said within the data: the slope is over the dose
    *ranks* (unequal steps in k3), so the per-dose differences from fp32 follow it, and the first dose whose
    difference's interval lies below zero is where "below fp32" starts; TIS above uncorrected is not "repaired"
    (study 6's rule: above uncorrected *and* not below fp32), so its distance to fp32 at the largest dose is said."""
    from experiments.summary import unseen

    if not summary["complete"]:
        return None
    h1, h2, second = summary["tests"]["H1"], summary["tests"]["H2"], summary["secondary"]
    if h1["verdict"] == "reproduced":
        drops = ", ".join(f"{d} {second[f'{d}/ppo vs fp32/ppo']['difference']:+.3f}" for d in MISMATCHED)
        below = next((d for d in MISMATCHED if second[f"{d}/ppo vs fp32/ppo"]["ci95"][1] < 0), None)
        harm = (f"mismatch harms uncorrected RL on this task: the slope of the final score on the dose rank is "
                f"{h1['slope']:+.3f} (95 % CI [{h1['ci95'][0]:+.3f}, {h1['ci95'][1]:+.3f}]); against fp32 the "
                f"uncorrected arms end {drops}, below fp32 from {below} on")
    elif h1["verdict"] == "opposite":
        harm = f"the score rises with the dose (slope {h1['slope']:+.3f} per dose rank)"
    else:
        harm = (f"no harm is detected: even rtn2 (about {d3_ratio:.0f}× the k3 of llamacpp:q4_0) does not "
                f"measurably hurt this model class; {unseen(h1['mde_slope'], 'a slope')} per dose rank "
                f"({3 * h1['mde_slope']:.3f} from fp32 to rtn2)")
    if h2["verdict"] == "reproduced":
        last = MISMATCHED[-1]
        gap = second[f"{last}/tis vs fp32/ppo"]
        repair = (f"token TIS scores above uncorrected ({h2['difference']:+.3f} over the doses) but does not recover "
                  f"fp32's score at {last}, where it ends {gap['difference']:+.3f} against fp32 with "
                  f"{gap['collapses'][0]} of {summary['arms'][f'{last}/tis']['seeds']} runs in sustained collapse")
    elif h2["verdict"] == "opposite":
        repair = f"token TIS scores lower than uncorrected ({h2['difference']:+.3f} over the doses)"
    else:
        repair = (f"token TIS is not separated from uncorrected ({h2['difference']:+.3f}; "
                  f"{unseen(h2['mde'])})")
    return f"{harm}; {repair}."


def assemble(out: Path) -> dict[str, Any]:
    runs = read_runs(out)
    body = summarize(runs)
    summary = {"protocol": PROTOCOL, "protocol_commit": protocol_commit(), "alpha": ALPHA, **body}
    doses = json.loads((OUT / "doses.json").read_text())["choice"]["doses"]
    summary["answer"] = answer(summary, doses["D3"]["ratio_to_q4_0"])
    report = {"study": "dose_response", "summary": summary, "seeds": list(SEEDS), "doses": DOSES,
              "machines": [json.loads(m) for m in sorted({json.dumps(r["machine"], sort_keys=True) for r in runs})],
              "code_commits": sorted({r["code_commit"] or "" for r in runs}),
              "wall_seconds": [min((r["seconds"] for r in runs), default=None),
                               max((r["seconds"] for r in runs), default=None)]}
    write_json(report, out / "results.json")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        for arm, seed in schedule(SEEDS[:1] if args.quick else SEEDS)[k - 1 :: n]:
            one_run(arm, seed, out, args.quick)
    report = assemble(out)
    print(f"dose_response: {report['summary']['runs']} runs, wall time {clock.seconds:.1f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
