"""Study 10 — fp16 on both sides (docs/fp16-study.md, the protocol, committed before any run): part A audits the
fp16 pair (hf:fp16 sampler, hf:amp-fp16 learner) against the bf16 pair on three models; part B trains the two
pairs on the long-response task.

    python -m experiments.fp16_study --audits --model models/smollm2-135m   # part A (SmolLM2 skipped without --model)
    python -m experiments.fp16_study --part 1/2                             # part B, one half of the 20 runs
    python -m experiments.fp16_study --assemble                             # results.json from the files
    python -m experiments.fp16_study --quick --out DIR                      # a smoke run of both parts

Every audit and every run is one file under ``experiments/results/fp16_study/`` (``audits/``, ``runs/``), read back,
never redone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
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
from experiments.confirm_collapse import difference_ci, final_score, permutation_p, sustained_collapse
from experiments.power import mde_two_sample

PROTOCOL = "docs/fp16-study.md"
OUT = RESULTS / "fp16_study"
ROOT = Path(__file__).resolve().parents[1]
PAIRS = {"fp16": ("hf:fp16", "hf:amp-fp16"), "bf16": ("hf:bf16", "hf:amp-bf16")}
MODELS = {  # name → (model path or None for the user's SmolLM2 folder, prompts, responses per prompt, new tokens)
    "builtin": ("builtin", 64, 8, 64),
    "builtin:moe": ("builtin:moe", 64, 8, 64),
    "smollm2": (None, 32, 4, 48),
}
TEMPERATURE, AUDIT_SEED = 1.0, 0
CLAIM_RATIO = 10.0
BOOTSTRAP, STAT_SEED = 10_000, 0
ARMS = ("fp16/ppo", "bf16/ppo")
SEEDS = tuple(range(30, 40))
STEPS, LR = 150, 1e-4
SCORE = "eval/reward"
ALPHA = 0.05


# ---------------------------------------------------------------- part A: audits


def audit_prompts(model: str, n: int) -> tuple[list, bool]:
    """The prompts of a model's audit and whether they go through the chat template."""
    if model == "smollm2":
        rows = [json.loads(line) for line in (ROOT / "examples/arithmetic/train.jsonl").read_text().splitlines()]
        return [row["prompt"] for row in rows[:n]], True
    from rollcorr.audit.collect import builtin_prompts

    return builtin_prompts(n, seed=0), False


def audit_one(model: str, pair: str, path: str, quick: bool) -> dict[str, Any]:
    """One pair's audit on one model: per-prompt k3 sums and token counts (for the bootstrap), the k3 and the
    share of tokens at |Δp| ≥ 0.01."""
    import torch

    from rollcorr.audit.collect import collect, from_rollout
    from rollcorr.engines import SamplingParams, make_learner, make_sampler
    from rollcorr.tasks.chat import model_input

    _, n_prompts, group, tokens = MODELS[model]
    n_prompts, group, tokens = (4, 2, 8) if quick else (n_prompts, group, tokens)
    sampler_spec, learner_spec = PAIRS[pair]
    learner = make_learner(learner_spec, path)
    prompts, chat = audit_prompts(model, n_prompts)
    if chat:
        prompts = [model_input(learner.tokenizer, p, chat=True) for p in prompts]
    sampler = make_sampler(sampler_spec, path)
    clock = Clock()
    rollout = collect(sampler, learner, prompts, SamplingParams(max_new_tokens=tokens, temperature=TEMPERATURE,
                                                                 seed=AUDIT_SEED), n=group, batch_size=8)
    sampler.close()
    data = from_rollout(rollout)
    mu, old, mask = data.rollout_log_prob.double(), data.old_log_prob.double(), data.response_mask.bool()
    lr = torch.where(mask, old - mu, torch.zeros_like(mu))
    k3 = torch.where(mask, lr.exp() - 1 - lr, torch.zeros_like(mu))
    dp = torch.where(mask, (mu.exp() - old.exp()).abs(), torch.zeros_like(mu))
    by_prompt = lambda x: x.sum(1).view(-1, group).sum(1).tolist()  # noqa: E731  (a prompt's responses are adjacent)
    return {"model": model, "pair": pair, "sampler": sampler_spec, "learner": learner_spec,
            "k3_sum": by_prompt(k3), "ge_001": by_prompt((dp >= 0.01).double()), "tokens": by_prompt(mask.double()),
            "k3": float(k3.sum() / mask.sum()), "share_ge_0.01": float(((dp >= 0.01) & mask).sum() / mask.sum()),
            "responses": int(mask.shape[0]), "n_tokens": int(mask.sum()), "seconds": round(clock.seconds, 1),
            "machine": machine(), "code_commit": code_commit()}


def audit_file(out: Path, model: str, pair: str) -> Path:
    return out / "audits" / f"{model.replace(':', '-')}_{pair}.json"


def run_audits(out: Path, smollm2: Path | None, quick: bool) -> None:
    for model, (path, *_) in MODELS.items():
        if model == "smollm2":
            if smollm2 is None:
                log("  smollm2: no --model folder given, its audits are left for later")
                continue
            path = str(smollm2)
        for pair in PAIRS:
            target = audit_file(out, model, pair)
            if target.is_file():
                continue
            log(f"  audit {model} {pair}")
            write_json(audit_one(model, pair, path, quick), target)


def ratio_ci(fp16: dict, bf16: dict, n: int = BOOTSTRAP, seed: int = STAT_SEED) -> tuple[float, list[float]]:
    """R = k3(bf16) / k3(fp16) and its percentile interval, each pair's prompts resampled on its own."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def means(a: dict) -> np.ndarray:
        s, c = np.asarray(a["k3_sum"]), np.asarray(a["tokens"])
        idx = rng.integers(0, len(s), size=(n, len(s)))
        return s[idx].sum(1) / c[idx].sum(1)

    top, bottom = means(bf16), means(fp16)
    ratio = bf16["k3"] / fp16["k3"] if fp16["k3"] > 0 else math.inf
    boot = np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1), np.inf)
    return ratio, [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]


def share_ci(a: dict, n: int = BOOTSTRAP, seed: int = STAT_SEED) -> list[float]:
    import numpy as np

    rng = np.random.default_rng(seed)
    s, c = np.asarray(a["ge_001"]), np.asarray(a["tokens"])
    idx = rng.integers(0, len(s), size=(n, len(s)))
    shares = s[idx].sum(1) / c[idx].sum(1)
    return [float(np.quantile(shares, 0.025)), float(np.quantile(shares, 0.975))]


def ratio_verdict(ci: list[float]) -> str:
    if ci[0] >= CLAIM_RATIO:
        return "reproduced"
    if ci[1] < 1.0:
        return "opposite"
    return "not reproduced"


# ---------------------------------------------------------------- part B: training


def arm_overrides(arm: str, steps: int) -> list[str]:
    from rollcorr.train.config import preset_overrides

    sampler, learner = PAIRS[arm.split("/")[0]]
    return [*preset_overrides("chain"), f"trainer.steps={steps}", f"optim.lr={LR}", f"model.sampler={sampler}",
            f"model.learner={learner}", "algorithm.correction={preset: disabled}"]


def schedule(seeds=SEEDS) -> list[tuple[str, int]]:
    return [(arm, seed) for seed in seeds for arm in ARMS]


def run_file(out: Path, arm: str, seed: int) -> Path:
    return out / "runs" / f"{arm.replace('/', '-')}_s{seed}.json"


def one_run(arm: str, seed: int, out: Path, quick: bool) -> dict[str, Any]:
    path = run_file(out, arm, seed)
    steps = 2 if quick else STEPS
    overrides = arm_overrides(arm, steps) + [f"trainer.seed={seed}"]
    if quick:
        overrides += ["trainer.eval_every=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                      "task.eval_prompts=4", "rollout.max_new_tokens=10"]
    if path.is_file():
        return json.loads(path.read_text())
    log(f"  {arm} seed {seed}")
    runs_root = RESULTS.parent.parent / "runs" / "experiments" / out.name
    result = train(overrides, runs_root / f"{arm.replace('/', '-')}_s{seed}")
    if result["stopped"] and "--resume" in result["stopped"]:
        raise SystemExit(f"{arm} seed {seed} was interrupted ({result['stopped']}); run the part again to resume it")
    records = result["records"]
    evals = [(r["step"], float(r[SCORE])) for r in records if r.get(SCORE) is not None]
    steps_done = [r for r in records if "train/applied_updates" in r]
    record = {"arm": arm, "seed": seed, "steps": steps, "overrides": overrides,
              "final_score": final_score(evals, min(3, len(evals))), "evals": evals, "stopped": result["stopped"],
              "overflow_skips": sum(r.get("train/amp_overflow_skips", 0.0) for r in steps_done),
              "k3_mean": statistics.fmean(r["rollout_corr/k3_kl"] for r in steps_done if r.get("rollout_corr/k3_kl") is not None) if steps_done else None,
              "seconds": result["seconds"], "machine": machine(), "code_commit": code_commit()}
    write_json(record, path)
    return record


# ---------------------------------------------------------------- assembly


def summarize(out: Path) -> dict[str, Any]:
    audits = {}
    for model in MODELS:
        found = {pair: json.loads(audit_file(out, model, pair).read_text()) for pair in PAIRS
                 if audit_file(out, model, pair).is_file()}
        if found:
            audits[model] = found
    tests: dict[str, Any] = {}
    for model, pairs in audits.items():
        if len(pairs) == len(PAIRS):
            ratio, ci = ratio_ci(pairs["fp16"], pairs["bf16"])
            tests[f"A:{model}"] = {"ratio": ratio, "ci95": ci, "verdict": ratio_verdict(ci),
                                   "k3": {p: pairs[p]["k3"] for p in PAIRS},
                                   "share_ge_0.01": {p: pairs[p]["share_ge_0.01"] for p in PAIRS},
                                   "share_ci95": {p: share_ci(pairs[p]) for p in PAIRS}}
    complete_a = all(f"A:{m}" in tests for m in MODELS)
    runs = [json.loads(p.read_text()) for arm, seed in schedule() if (p := run_file(out, arm, seed)).is_file()]
    scores = {arm: [r["final_score"] for r in runs if r["arm"] == arm] for arm in ARMS}
    complete_b = all(len(scores[a]) == len(SEEDS) for a in ARMS)
    arms = {arm: {"seeds": len(v), "final_score_mean": statistics.fmean(v) if v else None,
                  "final_score_std": statistics.stdev(v) if len(v) > 1 else None,
                  "collapses": sum(sustained_collapse(r["evals"]) is not None for r in runs if r["arm"] == arm),
                  "overflow_skips": sum(r["overflow_skips"] for r in runs if r["arm"] == arm),
                  "k3_median": statistics.median([r["k3_mean"] for r in runs if r["arm"] == arm and r["k3_mean"] is not None] or [math.nan])}
            for arm, v in scores.items()}
    if all(len(v) > 1 for v in scores.values()):
        a, b = scores["fp16/ppo"], scores["bf16/ppo"]
        diff = statistics.fmean(a) - statistics.fmean(b)
        p = permutation_p(a, b)
        verdict = ("pending: part B is not complete" if not complete_b else
                   "reproduced" if p < ALPHA and diff > 0 else "opposite" if p < ALPHA else "not reproduced")
        tests["B"] = {"difference": diff, "ci95": difference_ci(a, b), "p_value": p, "verdict": verdict,
                      "mde": mde_two_sample(a, b, ALPHA, 1)}
    answer = None
    if complete_a:
        hits = [m for m in MODELS if tests[f"A:{m}"]["verdict"] == "reproduced"]
        answer = (f"fp16 on both sides lowers k3 by ≥ {CLAIM_RATIO:.0f}× (its interval's lower end) on {len(hits)} of "
                  f"{len(MODELS)} models" + (f" ({', '.join(hits)})" if hits else "; not reproduced"))
    return {"protocol": PROTOCOL, "protocol_commit": first_commit(PROTOCOL), "complete_a": complete_a,
            "complete_b": complete_b, "tests": tests, "arms": arms, "answer": answer}


def assemble(out: Path) -> dict[str, Any]:
    report = {"study": "fp16_study", "summary": summarize(out), "seeds": list(SEEDS)}
    write_json(report, out / "results.json")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--audits", action="store_true", help="part A: the audits")
    parser.add_argument("--model", type=Path, default=None, help="SmolLM2-135M-Instruct as a Hugging Face folder")
    parser.add_argument("--part", default=None, help="part B: K/N of the training runs")
    parser.add_argument("--assemble", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny audits and 2-step runs of the first seed; needs --out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick writes elsewhere than the study's results: give --out")
    out = (args.out or OUT).resolve()
    if args.audits or args.quick:
        run_audits(out, args.model, args.quick)
    if args.part or args.quick:
        k, n = parse_part(parser, args.part or "1/1")
        for arm, seed in schedule(SEEDS[:1] if args.quick else SEEDS)[k - 1 :: n]:
            one_run(arm, seed, out, args.quick)
    report = assemble(out)
    print(json.dumps({k: v.get("verdict") for k, v in report["summary"]["tests"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
