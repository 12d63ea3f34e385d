"""Study 6 — long responses: does sampler/learner mismatch break RL once responses are 70 tokens long, and
which correction repairs it?

    python -m experiments.long_mismatch                              # full study: 13 arms × 3 seeds + follow-up
    python -m experiments.long_mismatch --arms fp32/ppo --seeds 1    # one part (finished runs are read back)
    python -m experiments.long_mismatch --quick                      # 2 steps, 1 seed (smoke test)

The long-response task and model (``rollcorr train --config chain``: a chain of 14 numbers, 70-token
answers, per-number partial credit, ``builtin:chain``) with its shipped settings; fp32
learner, one learning rate (``LR``, chosen on the fp32 arm only) for every arm. Samplers (``model.sampler``):
fp32, bf16, int8, and the follow-up llama.cpp q4_0 (every method at each). Methods
(``algorithm.correction``):
  ppo          PPO, π_old recomputed by the learner, no correction                 (preset disabled)
  tis          token TIS, w_t = min(ρ_t, 2)                                          (preset tis)
  seq_mis      sequence MIS as TRL's default: w = ∏ρ_t · 1[∏ρ_t ≤ 3]                  (preset trl_sequence_mask)
  icepop       w_t = ρ_t · 1[0.5 ≤ ρ_t ≤ 5]                                          (preset icepop)
  geo_rs       reject sequences whose geometric-mean ratio leaves a band measured     (preset decoupled_geo_rs)
               on this sampler (``geo_rs_band``), not verl's [0.999, 1.001]
  seq_mis_mean diagnostic: TRL's sequence mask on the geometric mean (Σ → mean of log ρ_t, TRL PR #5815),
               w = ρ̄ · 1[ρ̄ ≤ 3] with ρ̄ = exp(mean_t log ρ_t)                       (trl_sequence_mask, geometric)
Per step (``KEYS``): reward, greedy score, entropy, grad norm, k3 KL, χ², ESS, max |Δp| per sequence,
rejected shares, response length. ``results.json`` holds the per-seed records, the claims, and a ``summary``
(mean response length, seeds, final greedy score mean ± std per arm).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from experiments.common import (
    RESULTS,
    Clock,
    curve,
    curve_groups,
    log,
    plot_curves,
    run_arms,
    run_mean,
    separated,
    study_arguments,
    summarize_arms,
    write_json,
)

PRESET = "chain"  # the task, model and rollout settings: src/rollcorr/train/configs/chain.yaml
LR = 1e-4  # from the fp32 arm only (docs/results.md, study 6 protocol), as configs/chain.yaml
STEPS = 150
SAMPLERS = {"fp32": "hf:fp32", "bf16": "hf:bf16", "int8": "hf:int8", "q4_0": "llamacpp:q4_0"}
METHODS = {
    "ppo": ["algorithm.correction={preset: disabled}"],
    "tis": ["algorithm.correction={preset: tis, is_upper: 2.0}"],
    "seq_mis": ["algorithm.correction={preset: trl_sequence_mask}"],
    "icepop": ["algorithm.correction={preset: icepop}"],
    "geo_rs": [],  # the band is measured per sampler: see geo_rs_overrides
    "seq_mis_mean": ["algorithm.correction={preset: trl_sequence_mask, is_level: geometric}"],
}
ARM_NAMES = ["fp32/ppo", *(f"{s}/{m}" for s in ("bf16", "int8") for m in METHODS)]
# The protocol's follow-up when the effect does not appear at int8: a stronger sampler (llama.cpp q4_0, ~10-50×
# int8's k3 KL on this model), with every method (the stronger mismatch level keeps every arm).
FOLLOW_UP = [f"q4_0/{m}" for m in METHODS]
MISMATCHED = ("bf16", "int8", "q4_0")  # samplers compared with fp32/ppo
# Band rule for Geo-RS: the central BAND_QUANTILES of the per-sequence geometric-mean ratio π_old/μ measured on
# the shipped checkpoint, BAND_PROMPTS held-out prompts × BAND_N responses at the study's temperature.
BAND_QUANTILES = (0.025, 0.975)
BAND_PROMPTS, BAND_N = 32, 4
SCORE = "eval/reward"  # the greedy score: mean reward (share of numbers right) of greedy responses, held-out prompts
KEYS = ("reward/mean", SCORE, "eval/accuracy", "actor/entropy", "loss/grad_norm", "response/length_mean",
        "rollout_corr/k3_kl", "rollout_corr/chi2_seq", "rollout_corr/chi2_token",
        "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/prob_diff_seq_max_mean",
        "rollout_corr/prob_diff_max", "rollout_corr/rollout_rs_seq_masked_fraction",
        "rollout_corr/rollout_is_seq_fraction_high", "rollout_corr/rollout_is_oob_ratio",
        "actor/ppo_kl")
PANELS = ("reward/mean", SCORE, "actor/entropy", "rollout_corr/k3_kl",
          "rollout_corr/prob_diff_seq_max_mean", "response/length_mean")
WARNING_KEYS = ("rollout_corr/k3_kl", "rollout_corr/prob_diff_seq_max_mean")
COLLAPSE_DROP = 0.10  # a run collapses at the first evaluation ≥ 10 points below its best so far


def base_overrides(steps: int) -> list[str]:
    from rollcorr.train.config import preset_overrides

    return [*preset_overrides(PRESET), f"trainer.steps={steps}"]


def measure_geo_band(sampler: str, quick: bool = False) -> dict[str, Any]:
    """Per-sequence geometric-mean ratio exp(mean_t (log π_old − log μ)) of ``sampler`` against the fp32
    learner on the shipped checkpoint; the band is its central ``BAND_QUANTILES``."""
    import torch

    from rollcorr.engines import SamplingParams, make_learner, make_sampler
    from rollcorr.tasks import make_task
    from rollcorr.train.config import load_config

    config = load_config(PRESET)
    prompts_n, n = (4, 2) if quick else (BAND_PROMPTS, BAND_N)
    prompts = [i["prompt"] for i in make_task(config.task.name).sample(prompts_n, seed=0, split="test")]
    rollout = make_sampler(sampler, config.model.path).generate(
        prompts, SamplingParams(config.rollout.max_new_tokens, config.rollout.temperature, seed=0), n=n
    )
    with torch.no_grad():
        old = make_learner(config.model.learner, config.model.path).log_prob(
            rollout, temperature=config.rollout.temperature
        )
    mask = rollout.response_mask
    mean_log = ((old - rollout.rollout_log_prob) * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    q = torch.quantile(mean_log.double(), torch.tensor(BAND_QUANTILES, dtype=torch.double))
    lo, hi = math.exp(q[0].item()), math.exp(q[1].item())
    return {"sampler": sampler, "band": [lo, hi], "sequences": int(mask.shape[0]),
            "geo_ratio_log_std": float(mean_log.std().item())}


def geo_rs_overrides(sampler: str, out: Path, quick: bool) -> tuple[list[str], dict[str, Any]]:
    """The Geo-RS arm's correction with the band of ``sampler``; measured once, kept in
    ``out/geo_rs_band_<sampler>.json`` so every part of the study uses the same band."""
    import json

    name = sampler.split(":")[-1]
    path = out / f"geo_rs_band_{name}{'_quick' if quick else ''}.json"
    if path.is_file():
        band = json.loads(path.read_text())
    else:
        log(f"  measuring the Geo-RS band of {sampler}")
        band = measure_geo_band(sampler, quick)
        write_json(band, path)
    lo, hi = band["band"]
    return [f"algorithm.correction={{preset: decoupled_geo_rs, rs_thresholds: [[{lo:.6g}, {hi:.6g}]]}}"], band


def collapse_step(records: list[dict[str, Any]], drop: float = COLLAPSE_DROP) -> int | None:
    """The first evaluation step whose greedy score is ≥ ``drop`` below the best score before it."""
    best = -math.inf
    for step, score in zip(*curve(records, SCORE)):
        if score <= best - drop:
            return step
        best = max(best, score)
    return None


def warning_step(records: list[dict[str, Any]], key: str, baseline_steps: int = 10, factor: float = 3.0):
    """The first step after the first ``baseline_steps`` where ``key`` exceeds ``factor`` × its median over
    them (None when it never does or the run is too short)."""
    steps, values = curve(records, key)
    if len(values) <= baseline_steps:
        return None
    threshold = factor * statistics.median(values[:baseline_steps])
    return next((s for s, v in zip(steps[baseline_steps:], values[baseline_steps:]) if v > threshold), None)


def early_warning(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run: collapse step and each warning metric's step; ``warned_first`` is True when some run collapsed
    and every collapsed run was warned (by the metric) strictly before it; ``false_alarms`` counts the runs
    that did not collapse but whose metric fired anyway (a warning that fires everywhere warns of nothing)."""
    per_run = [{"seed": r["seed"], "collapse_step": collapse_step(r["records"]),
                **{k: warning_step(r["records"], k) for k in WARNING_KEYS}} for r in runs]
    collapsed = [p for p in per_run if p["collapse_step"] is not None]
    steady = [p for p in per_run if p["collapse_step"] is None]
    verdict, false_alarms = {}, {}
    for k in WARNING_KEYS:
        verdict[k] = bool(collapsed) and all(
            p[k] is not None and p[k] < p["collapse_step"] for p in collapsed
        )
        false_alarms[k] = sum(p[k] is not None for p in steady)
    return {"runs": per_run, "collapsed": len(collapsed), "steady": len(steady), "warned_first": verdict,
            "false_alarms": false_alarms}


def above(acc: dict[str, Any], high: str, low: str) -> bool | None:
    """Final greedy score of ``high`` exceeds ``low`` by more than the seed spread (None if either is missing)."""
    if high not in acc or low not in acc:
        return None
    return separated(acc[high], acc[low]) and acc[high]["mean"] > acc[low]["mean"]


def claims(acc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in MISMATCHED:
        out[f"{s}_ppo_worse_than_fp32_ppo"] = above(acc, "fp32/ppo", f"{s}/ppo")
        for m in ("tis", "seq_mis", "icepop", "geo_rs", "seq_mis_mean"):
            out[f"{s}_{m}_better_than_{s}_ppo"] = above(acc, f"{s}/{m}", f"{s}/ppo")
        out[f"{s}_seq_mis_better_than_{s}_tis"] = above(acc, f"{s}/seq_mis", f"{s}/tis")
    return out


def summary_block(results: dict[str, Any], final: dict[str, Any], seeds: int) -> dict[str, Any]:
    """The top-level ``summary``: mean response length over every run, seeds, final greedy score per arm."""
    lengths = [run_mean(cell["runs"], "response/length_mean")["mean"]
               for cells in results.values() for cell in cells.values()]
    lengths = [x for x in lengths if x is not None]
    arms = {}
    for arm, cells in final.items():
        score = next(iter(cells.values()))[SCORE]
        arms[arm] = {"final_score_mean": score["mean"], "final_score_std": score["std"]}
    return {"mean_response_length": sum(lengths) / len(lengths) if lengths else None, "seeds": seeds,
            "arms": arms}


def main(argv: list[str] | None = None) -> int:
    parser = study_arguments(__doc__.splitlines()[0], [*ARM_NAMES, *FOLLOW_UP])
    args = parser.parse_args(argv)
    if args.lr is not None:
        parser.error(f"--lr: this study uses one learning rate for every arm (LR = {LR})")
    out = (args.out or RESULTS / "long_mismatch").resolve()
    clock = Clock()
    steps = args.steps or STEPS
    arms, bands = {}, {}
    for arm in args.arms:
        sampler, method = arm.split("/")
        overrides = METHODS[method]
        if method == "geo_rs":
            overrides, bands[sampler] = geo_rs_overrides(SAMPLERS[sampler], out, args.quick)
        arms[arm] = [f"model.sampler={SAMPLERS[sampler]}", *overrides]
    results = run_arms(arms, base_overrides(steps), out, seeds=range(args.seeds), quick=args.quick,
                       grid={"optim.lr": [LR]}, keep=KEYS)
    final = summarize_arms(results, KEYS)
    acc = {arm: next(iter(cells.values()))[SCORE] for arm, cells in final.items()}
    warnings = {arm: early_warning(next(iter(cells.values()))["runs"]) for arm, cells in results.items()}
    figures = {}
    for sampler in MISMATCHED:
        groups = {
            a: r for a, r in curve_groups(results).items() if a.startswith(sampler + "/") or a == "fp32/ppo"
        }
        if groups:
            name = f"curves_{sampler}.png"
            plot_curves(groups, PANELS, out / name, title=f"{sampler} sampler vs fp32, fp32 learner, lr {LR}")
            figures[sampler] = name
    seeds = 1 if args.quick else args.seeds
    report = {"study": "long_mismatch", "summary": summary_block(results, final, seeds), "steps": steps,
              "lr": LR, "quick": args.quick, "geo_rs_bands": bands, "final": final, "claims": claims(acc),
              "early_warning": warnings, "figures": figures, "runs": results,
              "wall_seconds": clock.seconds}
    write_json(report, out / "results.json")
    print(f"long_mismatch: wall time {clock.seconds:.1f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
