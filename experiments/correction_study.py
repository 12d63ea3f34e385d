"""Study 11 — which correction, where mismatch really hurts: a head-to-head of token TIS against sequence-level
MIS, IcePop, sequence-level IS + rejection and *removing* the mismatch (the learner's forward through the
sampler's rounded weights), at the dose where uncorrected RL collapses (hf:rtn2) and one below it (hf:rtn3).
The protocol (arms, seeds, order, endpoints, statistics, decision rules) is docs/correction-study.md,
committed before any run and never edited; this script carries it out.

    python -m experiments.correction_study --part 1/2        # one half of the 165 runs (one process per core)
    python -m experiments.correction_study --part 2/2        # the other half
    python -m experiments.correction_study --assemble        # results.json from the finished run files
    python -m experiments.correction_study --quick --out DIR # 2 steps, one seed per arm (smoke test)

Every finished run is one small JSON file under ``experiments/results/correction_study/runs/`` (its endpoints,
its evaluation curve, the per-step mismatch series, when it started, the machine, the code commit); a run whose
file exists is never run again, so the study resumes across processes, sessions and machines.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
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
from experiments.confirm_collapse import difference_ci, final_score, holm, mean_ci, sustained_collapse
from experiments.power import mde_two_sample

PROTOCOL = "docs/correction-study.md"
PRESET = "chain"  # task, model and rollout settings: src/rollcorr/train/configs/chain.yaml (as studies 6, 7 and 9)
LR = 1e-4
STEPS = 300  # study 9's length
PRIMARY_SEEDS = tuple(range(40, 55))  # 15 fresh seeds (studies 6-10 used 0-2, 10-39)
SECONDARY_SEEDS = tuple(range(40, 50))  # 10 of them for the rtn3 block
SAMPLERS = {"fp32": "hf:fp32", "rtn3": "hf:rtn3", "rtn2": "hf:rtn2"}
# method -> (the learner: None = hf:fp32, "sampler" = the sampler's own spec; algorithm.correction)
METHODS: dict[str, tuple[str | None, str]] = {
    "ppo": (None, "{preset: disabled}"),  # uncorrected: PPO with π_old recomputed by the fp32 learner
    "tis": (None, "{preset: tis, is_upper: 2.0}"),  # token TIS, w_t = min(ρ_t, 2) (study 9's)
    "seq_mis": (None, "{preset: seq_mis}"),  # sequence-level MIS: w = ρ_seq · 1[ρ_seq ≤ 2]
    "icepop": (None, "{preset: icepop}"),  # w_t = ρ_t · 1[0.5 ≤ ρ_t ≤ 5]
    "seq_is_rs": (None, "{preset: decoupled_seq_is_rs}"),  # w = min(ρ_seq, 2), rejected unless ρ_seq ∈ [0.5, 2]
    "removed": ("sampler", "{preset: disabled}"),  # the learner computes with the sampler's rounded weights
}
ALTERNATIVES = ("seq_mis", "icepop", "seq_is_rs", "removed")  # each tested against tis: the primary family
PRIMARY_ARMS = ("fp32/ppo", *(f"rtn2/{m}" for m in METHODS))
SECONDARY_ARMS = tuple(f"rtn3/{m}" for m in METHODS)
ALPHA = 0.05
BOOTSTRAP = 10_000
STAT_SEED = 0
SCORE = "eval/reward"
LAST_EVALS = 3
SERIES = ("reward/mean", "rollout_corr/k3_kl", "rollout_corr/num_kept_seqs", "rollout_corr/num_valid_seqs")
SERVED_PROMPTS = 200  # the final weights' greedy score through the dose's own rounded sampler
OUT = RESULTS / "correction_study"


# ---------------------------------------------------------------- statistics (pure functions)


def exact_permutation_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided exact permutation p of mean(a) − mean(b): the share of all C(n_a + n_b, n_a) splits of the pooled
    values whose |difference| is at least the observed one (1e-12 below it counts, for summation order).

    Counted by meeting in the middle: the pooled values are cut into halves L and R; a split takes k values of L
    and n_a − k of R, so for each k the subset sums of L (k values) are matched against the sorted subset sums of
    R (n_a − k values) with a binary search — the difference is increasing in the split's sum s,
    d(s) = s/n_a − (S − s)/n_b, so |d| ≥ δ ⇔ s ≥ s_hi or s ≤ s_lo. 15 vs 15 is 1.6e8 splits in 2 × 2^15 sums."""
    import numpy as np

    pooled = np.asarray([*a, *b], dtype=float)
    na, nb = len(a), len(b)
    total = float(pooled.sum())
    delta = abs(statistics.fmean(a) - statistics.fmean(b)) - 1e-12
    if delta <= 0:  # no difference: every split is at least as far
        return 1.0
    slope = 1 / na + 1 / nb
    s_hi, s_lo = (delta + total / nb) / slope, (-delta + total / nb) / slope
    left, right = pooled[: len(pooled) // 2], pooled[len(pooled) // 2 :]
    sums_left, sums_right = _subset_sums(left), _subset_sums(right)
    count = 0
    for k, values in sums_left.items():
        other = sums_right.get(na - k)
        if other is None:
            continue
        for s in values:
            count += len(other) - int(np.searchsorted(other, s_hi - s, side="left"))
            count += int(np.searchsorted(other, s_lo - s, side="right"))
    return count / math.comb(na + nb, na)


def _subset_sums(values) -> dict[int, Any]:
    """{k: sorted sums of every k-subset of ``values``} (2^len values in all)."""
    import numpy as np

    n = len(values)
    masks = np.arange(2**n)
    bits = (masks[:, None] >> np.arange(n)) & 1
    sums, sizes = bits @ np.asarray(values, dtype=float), bits.sum(axis=1)
    return {k: np.sort(sums[sizes == k]) for k in range(n + 1)}


def fisher_two_sided(x_a: int, n_a: int, x_b: int, n_b: int) -> float:
    """Two-sided Fisher exact p of a 2×2 table (x_a of n_a against x_b of n_b): the total hypergeometric
    probability of the tables with the same margins that are at most as likely as the observed one."""
    k, n = x_a + x_b, n_a + n_b

    def prob(x: int) -> float:
        return math.comb(k, x) * math.comb(n - k, n_a - x) / math.comb(n, n_a)

    observed = prob(x_a)
    support = range(max(0, k - n_b), min(k, n_a) + 1)
    return min(1.0, sum(p for x in support if (p := prob(x)) <= observed * (1 + 1e-9)))


def gap_recovered(arm: Sequence[float], ppo: Sequence[float], fp32: Sequence[float], n: int = BOOTSTRAP,
                  seed: int = STAT_SEED) -> dict[str, Any]:
    """The share of the fp32 − uncorrected gap an arm recovers, R = (m_arm − m_ppo) / (m_fp32 − m_ppo) (1 = all of
    it, 0 = none), with a percentile bootstrap 95 % interval (each of the three arms resampled on its own)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    xs = [np.asarray(v, dtype=float) for v in (arm, ppo, fp32)]
    means = [rng.choice(x, size=(n, len(x))).mean(axis=1) for x in xs]
    boot = (means[0] - means[1]) / (means[2] - means[1])
    share = (statistics.fmean(arm) - statistics.fmean(ppo)) / (statistics.fmean(fp32) - statistics.fmean(ppo))
    return {"share": share, "ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]}


def versus(a: Sequence[float], b: Sequence[float], family: int) -> dict[str, Any]:
    """mean(a) − mean(b) with its bootstrap interval, exact permutation p and MDE (80 % power, Holm family)."""
    return {"difference": statistics.fmean(a) - statistics.fmean(b), "ci95": difference_ci(a, b),
            "p_value": exact_permutation_p(a, b), "mde": mde_two_sample(a, b, ALPHA, family)}


def primary_verdict(difference: float, p_holm: float) -> str:
    """The decision rule of each alternative against token TIS at rtn2."""
    if p_holm < ALPHA:
        return "better than token TIS" if difference > 0 else "worse than token TIS"
    return "not separated from token TIS"


# ---------------------------------------------------------------- runs


def arm_overrides(arm: str, steps: int) -> list[str]:
    from rollcorr.train.config import preset_overrides

    dose, method = arm.split("/")
    learner, correction = METHODS[method]
    sampler = SAMPLERS[dose]
    return [*preset_overrides(PRESET), f"trainer.steps={steps}", f"optim.lr={LR}", f"model.sampler={sampler}",
            f"model.learner={sampler if learner == 'sampler' else 'hf:fp32'}",
            f"algorithm.correction={correction}"]


def schedule(primary: Sequence[int] = PRIMARY_SEEDS, secondary: Sequence[int] = SECONDARY_SEEDS) -> list[tuple[str, int]]:
    """The primary block first (fp32 and the rtn2 arms), then the rtn3 block; seed-major within each block, so a
    study stopped part-way is balanced and its primary comparisons complete first."""
    first = [(arm, seed) for seed in primary for arm in PRIMARY_ARMS]
    return first + [(arm, seed) for seed in secondary for arm in SECONDARY_ARMS]


def run_file(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm.replace('/', '-')}_s{seed}.json"


def protocol_commit() -> str | None:
    return first_commit(PROTOCOL)


def served_score(overrides: Sequence[str], run_dir: str, sampler: str, steps: int, prompts: int) -> float:
    """The final weights' greedy score through ``sampler`` (the dose's rounded sampler: the policy as a quantised
    engine would serve it), on the run's own held-out prompts and settings (``overrides``)."""
    from experiments.common import train_config
    from rollcorr.checkpoint import checkpoint_dir
    from rollcorr.engines import make_sampler
    from rollcorr.tasks.chat import uses_chat
    from rollcorr.train.eval import GreedyEvaluator

    config = train_config(overrides)
    model = checkpoint_dir(Path(run_dir), steps) / "model"
    engine = make_sampler(sampler, model)
    evaluator = GreedyEvaluator(engine, config.task.build(), engine.tokenizer, prompts, config.rollout.max_new_tokens,
                                config.task.eval_seed, chat=uses_chat(engine.tokenizer, config.task.chat))
    weights = make_sampler("hf:fp32", model).model.state_dict()  # the float32 weights; the engine rounds them
    return evaluator(weights, steps)["eval/reward"]


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
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs_root = out / "run_dirs" if not out.is_relative_to(RESULTS) else RESULTS.parent.parent / "runs" / "experiments" / out.name
    result = train(overrides, runs_root / f"{arm.replace('/', '-')}_s{seed}")
    if result["stopped"] and "--resume" in result["stopped"]:  # a signal, not the trainer's guard: no run file
        raise SystemExit(f"{arm} seed {seed} was interrupted ({result['stopped']}); run the part again to resume it")
    records = result["records"]
    evals = [(r["step"], float(r[SCORE])) for r in records if r.get(SCORE) is not None]
    by_step = {r["step"]: r for r in records if r["step"] >= 1}
    series = {k: [_round(by_step.get(t, {}).get(k)) for t in range(1, steps + 1)] for k in SERIES}
    dose = arm.split("/")[0]
    served = None
    if dose != "fp32" and result["stopped"] is None:
        served = served_score(overrides, result["run_dir"], SAMPLERS[dose], steps, 4 if quick else SERVED_PROMPTS)
    record = {"arm": arm, "seed": seed, "steps": steps, "overrides": overrides,
              "final_score": final_score(evals, min(LAST_EVALS, len(evals))), "evals": evals, "series": series,
              "served_score": served, "stopped": result["stopped"], "started": started,
              "seconds": result["seconds"], "machine": machine(), "code_commit": code_commit()}
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


def arm_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One arm: its endpoint's mean, sd and interval, collapses, served score, training mismatch and keep share."""
    scores = [r["final_score"] for r in runs]
    served = [r["served_score"] for r in runs if r.get("served_score") is not None]
    k3 = [m for r in runs if (m := _series_mean(r, "rollout_corr/k3_kl")) is not None]
    kept = [m / v for r in runs if (m := _series_mean(r, "rollout_corr/num_kept_seqs")) is not None
            and (v := _series_mean(r, "rollout_corr/num_valid_seqs"))]
    return {"seeds": len(scores), "final_score_mean": statistics.fmean(scores),
            "final_score_std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
            "final_score_ci95": mean_ci(scores) if len(scores) > 1 else None,
            "collapses": sum(collapsed(r) for r in runs), "stopped": sum(r.get("stopped") is not None for r in runs),
            "served_score_mean": statistics.fmean(served) if served else None,
            "training_k3_median": statistics.median(k3) if k3 else None,
            "kept_sequence_share_median": statistics.median(kept) if kept else None}


def primary_tests(scores: dict[str, list[float]], complete: bool) -> dict[str, Any]:
    """Each alternative against token TIS at rtn2: exact permutation p, Holm over the four, verdict, MDE."""
    tis = scores["rtn2/tis"]
    tests = {f"rtn2/{m} vs rtn2/tis": versus(scores[f"rtn2/{m}"], tis, len(ALTERNATIVES)) for m in ALTERNATIVES
             if len(scores[f"rtn2/{m}"]) > 1 and len(tis) > 1}
    if len(tests) == len(ALTERNATIVES):
        for t, p_adj in zip(tests.values(), holm([t["p_value"] for t in tests.values()])):
            t["p_holm"] = p_adj
            t["verdict"] = primary_verdict(t["difference"], p_adj) if complete else "pending: the study is not complete"
    return tests


def secondary(scores: dict[str, list[float]], arms: dict[str, Any]) -> dict[str, Any]:
    """Reported, not decided: uncorrected vs TIS at rtn2; every rtn3 alternative vs rtn3 TIS; collapse rates
    against TIS (two-sided Fisher); the share of the fp32 − uncorrected gap each arm recovers."""
    out: dict[str, Any] = {}
    pairs = [("rtn2/ppo", "rtn2/tis"), *((f"rtn3/{m}", "rtn3/tis") for m in ("ppo", *ALTERNATIVES))]
    for a, b in pairs:
        if len(scores.get(a, [])) > 1 and len(scores.get(b, [])) > 1:
            out[f"{a} vs {b}"] = {**versus(scores[a], scores[b], 1),
                                  "collapses": [arms[a]["collapses"], arms[b]["collapses"]],
                                  "collapse_fisher_p": fisher_two_sided(arms[a]["collapses"], len(scores[a]),
                                                                        arms[b]["collapses"], len(scores[b]))}
    for dose in ("rtn2", "rtn3"):
        for a in (f"{dose}/{m}" for m in METHODS if m != "ppo"):
            if all(len(scores.get(x, [])) > 1 for x in (a, f"{dose}/ppo", "fp32/ppo")):
                out.setdefault("gap_recovered", {})[a] = gap_recovered(scores[a], scores[f"{dose}/ppo"],
                                                                      scores["fp32/ppo"])
    for m in ALTERNATIVES:
        a = f"rtn2/{m}"
        if len(scores[a]) > 1 and len(scores["rtn2/tis"]) > 1:
            out[f"{a} vs rtn2/tis: collapses"] = {
                "collapses": [arms[a]["collapses"], arms["rtn2/tis"]["collapses"]],
                "fisher_p": fisher_two_sided(arms[a]["collapses"], len(scores[a]), arms["rtn2/tis"]["collapses"],
                                             len(scores["rtn2/tis"]))}
    return out


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm summaries, the primary family with Holm's rule, the secondary comparisons, and the answer."""
    all_arms = (*PRIMARY_ARMS, *SECONDARY_ARMS)
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in all_arms}
    scores = {arm: [r["final_score"] for r in by_arm[arm]] for arm in all_arms}
    complete = all(len(scores[a]) == len(PRIMARY_SEEDS) for a in PRIMARY_ARMS)
    complete_secondary = all(len(scores[a]) == len(SECONDARY_SEEDS) for a in SECONDARY_ARMS)
    arms = {arm: arm_summary(by_arm[arm]) for arm in all_arms if by_arm[arm]}
    tests = primary_tests(scores, complete)
    return {"complete": complete, "complete_secondary": complete_secondary, "runs": len(runs), "arms": arms,
            "tests": tests, "secondary": secondary(scores, arms) if arms else {},
            "answer": answer(tests, complete)}


def answer(tests: dict[str, Any], complete: bool) -> str | None:
    """The study's answer in one sentence, as the protocol's rules give it (None until complete)."""
    if not complete or len(tests) != len(ALTERNATIVES):
        return None
    better = {k: t for k, t in tests.items() if t["verdict"] == "better than token TIS"}
    worse = [k.split(" vs ")[0] for k, t in tests.items() if t["verdict"] == "worse than token TIS"]
    mde = max(t["mde"] for t in tests.values())
    if better:
        best = max(better, key=lambda k: better[k]["difference"])
        t = better[best]
        said = (f"at rtn2, {best.split(' vs ')[0]} scores above token TIS by {t['difference']:.3f} (95 % CI "
                f"[{t['ci95'][0]:.3f}, {t['ci95'][1]:.3f}], Holm p {t['p_holm']:.3g})")
    else:
        said = (f"at rtn2, no alternative is separated from token TIS above it; a difference below {mde:.3f} "
                "could not have been seen")
    if worse:
        said += f"; {', '.join(worse)} {'scores' if len(worse) == 1 else 'score'} below token TIS"
    return said + "."


def assemble(out: Path) -> dict[str, Any]:
    runs = read_runs(out)
    summary = {"protocol": PROTOCOL, "protocol_commit": protocol_commit(), "alpha": ALPHA, **summarize(runs)}
    report = {"study": "correction_study", "summary": summary, "seeds": {"primary": list(PRIMARY_SEEDS),
              "secondary": list(SECONDARY_SEEDS)}, "arms": {"primary": list(PRIMARY_ARMS),
              "secondary": list(SECONDARY_ARMS)},
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
        plan = schedule(PRIMARY_SEEDS[:1], SECONDARY_SEEDS[:1]) if args.quick else schedule()
        for arm, seed in plan[k - 1 :: n]:
            one_run(arm, seed, out, args.quick)
    report = assemble(out)
    print(f"correction_study: {report['summary']['runs']} runs, wall time {clock.seconds:.1f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

