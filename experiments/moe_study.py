"""Study 8 — mixture of experts: does a lower-precision sampler's routing mismatch hurt RL on an MoE model, and
does routing replay (R3) repair it — alone, with token IS, and joined with the EWMA old-logit strategy under
staleness? The protocol (audits, arms, seeds, endpoint, statistics, decision rules) is docs/moe-study.md,
committed before any run and never edited; this script carries it out.

    python -m experiments.moe_study --part 1/2        # part A (the audits), then half of part B's runs
    python -m experiments.moe_study --part 2/2        # the other half (one process per core)
    python -m experiments.moe_study --assemble        # results.json from the finished run files
    python -m experiments.moe_study --quick --out DIR # tiny audits, 2 steps per arm (smoke test)

Every finished audit and run is one small JSON file under ``experiments/results/moe/`` (``audits/``,
``runs/``), with the machine and the code commit, so the study resumes across processes, sessions and
machines: a file that exists is never redone. The statistics (bootstrap intervals, exact permutation p,
Holm, the verdict and collapse rules) are study 7's, imported from ``experiments.confirm_collapse``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments import confirm_collapse as rules
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

PROTOCOL = "docs/moe-study.md"
PRESET = "moe"  # src/rollcorr/train/configs/moe.yaml: builtin:moe on 3-digit addition
STEPS = 600
SEEDS = tuple(range(20, 30))  # fresh: the built-in model's studies use 0-2, study 7 uses 10-19
SCORE = "eval/accuracy"  # greedy accuracy on the trainer's 200 held-out prompts
DISABLED, TIS = "{preset: disabled}", "{preset: tis, is_upper: 2.0}"
INT8, R3 = "model.sampler=hf:int8", "model.routing_replay=r3"
LAG2_EWMA = ["trainer.mode=simulated_async", "trainer.lag=2", "algorithm.proximal.name=ewma"]
ARMS: dict[str, list[str]] = {
    "moe-fp32/ppo": ["model.sampler=hf:fp32", f"algorithm.correction={DISABLED}"],
    "moe-int8/ppo": [INT8, f"algorithm.correction={DISABLED}"],
    "moe-int8/tis": [INT8, f"algorithm.correction={TIS}"],
    "moe-int8/r3": [INT8, f"algorithm.correction={DISABLED}", R3],
    "moe-int8/r3+tis": [INT8, f"algorithm.correction={TIS}", R3],
    "moe-int8/lag2-ewma": [INT8, f"algorithm.correction={TIS}", *LAG2_EWMA],
    "moe-int8/lag2-ewma+r3": [INT8, f"algorithm.correction={TIS}", *LAG2_EWMA, R3],
}
# (claimed higher, claimed lower): P1-P4, one Holm family
COMPARISONS = (
    ("moe-fp32/ppo", "moe-int8/ppo"),
    ("moe-int8/r3", "moe-int8/ppo"),
    ("moe-int8/r3+tis", "moe-int8/tis"),
    ("moe-int8/lag2-ewma+r3", "moe-int8/lag2-ewma"),
)
SECONDARY = (("moe-int8/tis", "moe-int8/ppo"), ("moe-fp32/ppo", "moe-int8/r3+tis"))
SERIES = ("reward/mean", "rollout_corr/k3_kl")
# part A: name -> (model, sampler, routing replay)
AUDITS: dict[str, tuple[str, str, str | None]] = {
    "moe/fp32": ("builtin:moe", "hf:fp32", None),
    "moe/bf16": ("builtin:moe", "hf:bf16", None),
    "moe/fp16": ("builtin:moe", "hf:fp16", None),
    "moe/int8": ("builtin:moe", "hf:int8", None),
    "moe/bf16+r3": ("builtin:moe", "hf:bf16", "r3"),
    "moe/int8+r3": ("builtin:moe", "hf:int8", "r3"),
    "dense/bf16": ("builtin", "hf:bf16", None),
    "dense/fp16": ("builtin", "hf:fp16", None),
    "dense/int8": ("builtin", "hf:int8", None),
}
AUDIT_RESPONSES, AUDIT_BATCH = 2048, 64
ROUTING_KEYS = ("routing_flip_share", "routing_flip_token_share", "routing_layer_flip_rate", "tokens_flipped",
                "abs_dp_mean_flipped", "abs_dp_mean_unflipped", "abs_dp_share_flipped")
PROBABILITY_KEYS = ("prob_diff_mean", "prob_diff_max", "prob_diff_frac_lt_1e-3", "prob_diff_frac_ge_0.01",
                    "prob_diff_frac_ge_0.05", "prob_diff_frac_ge_0.1")
OUT = RESULTS / "moe"


# ---------------------------------------------------------------- part A: the audits


def audit_file(out: Path, name: str) -> Path:
    return out / "audits" / f"{name.replace('/', '_')}.json"


def one_audit(name: str, out: Path, quick: bool) -> dict[str, Any]:
    """Run one audit of part A through ``rollcorr audit`` (or read its file back); keep the protocol's numbers."""
    path = audit_file(out, name)
    if path.is_file():
        return json.loads(path.read_text())
    model, sampler, replay = AUDITS[name]
    n, batch = (8, 8) if quick else (AUDIT_RESPONSES, AUDIT_BATCH)
    log(f"  audit {name}")
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rollcorr", "audit", "--sampler", sampler, "--learner", "hf:fp32",
               "--model", model, "-n", str(n), "--batch-size", str(batch), "--seed", "0", "--out", tmp]
        cmd += ["--routing-replay", replay] if replay else []
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    record = {"audit": name, "model": model, "sampler": sampler, "routing_replay": replay, "responses": n,
              "tokens": summary["n_tokens"], "k3_kl": summary["divergence"]["k3_kl"],
              **{k: summary["probability"][k] for k in PROBABILITY_KEYS},
              "routing": {k: summary["routing"][k] for k in ROUTING_KEYS} if "routing" in summary else None,
              "seconds": clock.seconds, "machine": machine(), "code_commit": code_commit()}
    write_json(record, path)
    return record


def mismatch_rules(audits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Part A's rules A1-A3 (yes/no) and the descriptive A4 ratios, from the audits that exist."""

    def flips(name: str) -> float | None:
        a = audits.get(name)
        return None if a is None or a["routing"] is None else a["routing"]["routing_flip_share"]

    out: dict[str, Any] = {}
    if flips("moe/fp32") is not None:
        out["A1_fp32_flips_nothing"] = flips("moe/fp32") == 0
    lower = [p for p in ("bf16", "fp16", "int8") if flips(f"moe/{p}") is not None]
    if lower:
        out["A2_lower_precisions_flip"] = {p: flips(f"moe/{p}") > 0 for p in lower}
    replayed = [p for p in ("bf16", "int8") if f"moe/{p}" in audits and f"moe/{p}+r3" in audits]
    if replayed:
        out["A3_replay_shrinks_the_gap"] = {
            p: audits[f"moe/{p}+r3"]["prob_diff_mean"] < audits[f"moe/{p}"]["prob_diff_mean"]
            and audits[f"moe/{p}+r3"]["k3_kl"] < audits[f"moe/{p}"]["k3_kl"]
            for p in replayed
        }
    both = [p for p in ("bf16", "fp16", "int8") if f"moe/{p}" in audits and f"dense/{p}" in audits]
    out["A4_moe_over_dense"] = {
        p: {
            key: audits[f"moe/{p}"][key] / audits[f"dense/{p}"][key] if audits[f"dense/{p}"][key] else None
            for key in ("k3_kl", "prob_diff_mean")
        }
        for p in both
    }
    return out


# ---------------------------------------------------------------- part B: the training runs


def arm_overrides(arm: str, steps: int) -> list[str]:
    from rollcorr.train.config import preset_overrides

    return [*preset_overrides(PRESET), f"trainer.steps={steps}", "optim.skip_zero_grad=true", *ARMS[arm]]


def schedule(seeds: Sequence[int] = SEEDS) -> list[tuple[str, int]]:
    """Seed-major order: every arm of seed 20, then of seed 21, …, so a partly finished study stays balanced."""
    return [(arm, seed) for seed in seeds for arm in ARMS]


def run_file(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm.replace('/', '_')}_s{seed}.json"


def one_run(arm: str, seed: int, out: Path, quick: bool) -> dict[str, Any] | None:
    """Train one run (or read its file back) and return its record; None when the run was stopped (no file is
    written for an unfinished run: the next call resumes it from its checkpoint folder)."""
    path = run_file(out, arm, seed)
    steps = 2 if quick else STEPS
    overrides = arm_overrides(arm, steps)
    if quick:
        overrides += ["trainer.eval_every=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                      "task.eval_prompts=4"]
    overrides.append(f"trainer.seed={seed}")
    if path.is_file():
        record = json.loads(path.read_text())
        if record["overrides"] != overrides:
            raise SystemExit(f"{path} holds a run of other settings; move it away to rerun")
        return record
    log(f"  {arm} seed {seed}")
    runs_root = (
        RESULTS.parent.parent / "runs" / "experiments" / out.name
        if out.is_relative_to(RESULTS)
        else out / "run_dirs"
    )
    result = train(overrides, runs_root / f"{arm.replace('/', '_')}_s{seed}")
    if result["stopped"]:
        log(f"  {arm} seed {seed} stopped ({result['stopped']}); no run file written")
        return None
    records = result["records"]
    evals = [(r["step"], float(r[SCORE])) for r in records if r.get(SCORE) is not None]
    by_step = {r["step"]: r for r in records if r["step"] >= 1}
    series = {k: [rules._round(by_step.get(t, {}).get(k)) for t in range(1, steps + 1)] for k in SERIES}
    record = {"arm": arm, "seed": seed, "steps": steps, "overrides": overrides,
              "final_score": rules.final_score(evals), "evals": evals, "series": series,
              "seconds": result["seconds"], "machine": machine(), "code_commit": code_commit()}
    write_json(record, path)
    return record


# ---------------------------------------------------------------- assembly


def read_files(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def training_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm endpoint and collapses, P1-P4 with Holm's rule, the secondary comparisons. Complete (verdicts
    given) only when every compared arm has the protocol's seeds (``SEEDS``), whatever ran (``--quick``: one)."""
    scores = {arm: [r["final_score"] for r in runs if r["arm"] == arm] for arm in ARMS}
    collapses = {arm: sum(rules.sustained_collapse(r["evals"]) is not None for r in runs if r["arm"] == arm)
                 for arm in ARMS}
    arms = {arm: {"seeds": len(v), "final_score_mean": statistics.fmean(v),
                  "final_score_std": statistics.stdev(v) if len(v) > 1 else 0.0,
                  "final_score_ci95": rules.mean_ci(v) if len(v) > 1 else None, "collapses": collapses[arm]}
            for arm, v in scores.items() if v}
    complete = all(len(scores[a]) >= len(SEEDS) for pair in COMPARISONS for a in pair)
    pairs = [(hi, lo) for hi, lo in COMPARISONS if len(scores[hi]) > 1 and len(scores[lo]) > 1]
    raw = [rules.permutation_p(scores[hi], scores[lo]) for hi, lo in pairs]
    tests = {}
    for (hi, lo), p, p_adj in zip(pairs, raw, rules.holm(raw)):
        d = statistics.fmean(scores[hi]) - statistics.fmean(scores[lo])
        tests[f"{hi} vs {lo}"] = {
            "difference": d, "ci95": rules.difference_ci(scores[hi], scores[lo]), "p_value": p, "p_holm": p_adj,
            "verdict": rules.verdict(d, p_adj) if complete else "pending: the study is not complete",
            "collapses": [collapses[hi], collapses[lo]],
            "collapse_fisher_p": rules.fisher_one_sided(collapses[lo], len(scores[lo]), collapses[hi],
                                                        len(scores[hi])),
        }
    secondary = {
        f"{hi} vs {lo}": {"difference": statistics.fmean(scores[hi]) - statistics.fmean(scores[lo]),
                          "ci95": rules.difference_ci(scores[hi], scores[lo])}
        for hi, lo in SECONDARY if len(scores[hi]) > 1 and len(scores[lo]) > 1
    }
    return {"complete": complete, "runs": len(runs), "arms": arms, "tests": tests, "secondary": secondary}


def protocol_commit() -> str | None:
    """The commit that added the protocol file (its first commit)."""
    return first_commit(PROTOCOL)


def assemble(out: Path) -> dict[str, Any]:
    audits = {a["audit"]: a for a in read_files(out / "audits")}
    runs = read_files(out / "runs")
    training = training_summary(runs)
    summary = {"protocol": PROTOCOL, "protocol_commit": protocol_commit(), "alpha": rules.ALPHA,
               "complete": training["complete"], "arms": training["arms"], "tests": training["tests"],
               "secondary": training["secondary"], "mismatch": mismatch_rules(audits)}
    everything = [*audits.values(), *runs]
    report = {"study": "moe", "summary": summary, "audits": audits, "seeds": list(SEEDS), "steps": STEPS,
              "machines": [json.loads(m) for m in sorted({json.dumps(r["machine"], sort_keys=True) for r in everything})],
              "code_commits": sorted({r["code_commit"] or "" for r in everything})}
    write_json(report, out / "results.json")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="1/1", help="K/N: run every N-th run of the schedule from the K-th "
                                                      "(part A runs with K = 1)")
    parser.add_argument(
        "--assemble", action="store_true", help="only assemble results.json from the run files"
    )
    parser.add_argument("--quick", action="store_true", help="tiny audits, 2 steps, first seed; needs --out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick writes its tiny runs elsewhere than the study's results: give --out")
    k, n = parse_part(parser, args.part)
    out = (args.out or OUT).resolve()
    seeds = SEEDS[:1] if args.quick else SEEDS
    clock = Clock()
    if not args.assemble:
        if k == 1:
            for name in AUDITS:
                one_audit(name, out, args.quick)
        for arm, seed in schedule(seeds)[k - 1 :: n]:
            if one_run(arm, seed, out, args.quick) is None:
                break
    report = assemble(out)
    runs = sum(a["seeds"] for a in report["summary"]["arms"].values())
    print(
        f"moe_study: {len(report['audits'])} audits, {runs} runs, wall time {clock.seconds:.1f} s → {out / 'results.json'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
