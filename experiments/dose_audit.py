"""Study 9's doses, fixed from audits alone (no training run): how far each candidate sampler is from the fp32
learner on the training task, before any training.

    python -m experiments.dose_audit            # writes experiments/results/dose_response/doses.json
    python -m experiments.dose_audit --quick --out DIR   # a smoke run (2 samplers, 16 responses)

Every candidate (``llamacpp:q4_0`` — study 7's 4-bit sampler —, ``hf:rtn2`` … ``hf:rtn8`` and ``hf:fp32`` as
the floor) samples the same responses' worth of the chain task's training prompts on ``builtin:chain`` with the
study's rollout settings (temperature 0.7, 70 new tokens, 8 responses per prompt), and the fp32 learner scores
the same tokens. The dose of a sampler is its token-mean k3 of KL(μ‖π_old) (the trainer's
``rollout_corr/k3_kl``); its interval is a percentile bootstrap over prompts (each prompt's responses kept
together).

The rule that turns the audits into the study's three doses is written here, before the audits were run:
with K the k3 of ``llamacpp:q4_0``, dose Dj (j = 1, 2, 3) is the ``hf:rtn<k>`` whose k3 is nearest to
K · 4^(j−1) on a log scale (targets K, 4K, 16K); the three must be different samplers, else the study cannot run
as planned and this script says so.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, Clock, code_commit, log, machine, write_json

MODEL = "builtin:chain"
TASK = "chain"
LEARNER = "hf:fp32"
Q4_0 = "llamacpp:q4_0"
CANDIDATES = (Q4_0, *(f"hf:rtn{k}" for k in range(8, 1, -1)), "hf:fp32")
PROMPTS, GROUP = 64, 8  # 64 training prompts × 8 responses = 512 responses per sampler
TEMPERATURE, MAX_NEW_TOKENS = 0.7, 70  # the chain preset's rollout settings
SEED = 0
TARGET_FACTORS = (1.0, 4.0, 16.0)  # D1, D2, D3 = K, 4K, 16K with K the k3 of llamacpp:q4_0
BOOTSTRAP = 2_000
OUT = RESULTS / "dose_response"


def prompt_bootstrap_ci(per_prompt_sum: list[float], per_prompt_count: list[int], n: int = BOOTSTRAP,
                        seed: int = 0) -> list[float]:
    """95 % percentile interval of a token mean, resampling prompts (a prompt's tokens stay together)."""
    import numpy as np

    s, c = np.asarray(per_prompt_sum, dtype=float), np.asarray(per_prompt_count, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(s), size=(n, len(s)))
    means = s[idx].sum(axis=1) / c[idx].sum(axis=1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def audit_one(spec: str, learner, prompts: list[str], quick: bool) -> dict[str, Any]:
    """Sample with ``spec``, score with the learner, return the dose and the audit's probability table."""
    import torch

    from rollcorr.audit.collect import collect
    from rollcorr.audit.stats import audit_stats
    from rollcorr.engines import SamplingParams, make_sampler

    sampler = make_sampler(spec, MODEL, threads=1)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=SEED)
    clock = Clock()
    rollout = collect(sampler, learner, prompts, params, n=2 if quick else GROUP, batch_size=8)
    sampler.close()
    log_mu, log_old = rollout.rollout_log_prob.double(), rollout.old_log_prob.double()
    mask = rollout.response_mask.bool()
    log_ratio = torch.where(mask, log_old - log_mu, torch.zeros_like(log_mu))
    k3 = torch.where(mask, log_ratio.exp() - 1 - log_ratio, torch.zeros_like(log_mu))  # k3 of KL(μ‖π_old)
    group = 2 if quick else GROUP
    per_prompt = k3.sum(1).view(-1, group).sum(1).tolist(), mask.sum(1).view(-1, group).sum(1).tolist()
    stats = audit_stats(rollout.rollout_log_prob, rollout.old_log_prob, rollout.response_mask)
    return {
        "sampler": spec,
        "k3": float(k3.sum() / mask.sum()),
        "k3_ci95": prompt_bootstrap_ci(*per_prompt),
        "k3_kl_audit": stats["divergence"]["k3_kl"],
        "prob_diff_frac_ge_0.01": stats["probability"]["prob_diff_frac_ge_0.01"],
        "prob_diff_mean": stats["probability"]["prob_diff_mean"],
        "prob_diff_seq_max_mean": stats["probability"]["prob_diff_seq_max_mean"],
        "n_responses": stats["n_responses"],
        "n_tokens": stats["n_tokens"],
        "seconds": round(clock.seconds, 1),
    }


def choose_doses(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The module docstring's rule: D1..D3 = the rtn sampler nearest (log k3) to K, 4K, 16K."""
    reference = next(r["k3"] for r in rows if r["sampler"] == Q4_0)
    rtn = [r for r in rows if r["sampler"].startswith("hf:rtn")]
    doses, used = {}, set()
    for j, factor in enumerate(TARGET_FACTORS, 1):
        target = reference * factor
        best = min(rtn, key=lambda r: abs(math.log(r["k3"]) - math.log(target)))
        doses[f"D{j}"] = {"target_k3": target, "sampler": best["sampler"], "k3": best["k3"],
                          "k3_ci95": best["k3_ci95"], "ratio_to_q4_0": best["k3"] / reference}
        used.add(best["sampler"])
    distinct = len(used) == len(TARGET_FACTORS)
    return {"reference": {"sampler": Q4_0, "k3": reference}, "doses": doses, "distinct": distinct}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two samplers, 8 prompts × 2 responses; needs --out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick writes elsewhere than the study's results: give --out")
    import torch

    from rollcorr.engines import make_learner
    from rollcorr.tasks import make_task

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    clock = Clock()
    items = make_task(TASK).sample(8 if args.quick else PROMPTS, SEED, split="train")
    prompts = [item["prompt"] for item in items]
    learner = make_learner(LEARNER, MODEL)
    candidates = ("hf:rtn4", "hf:rtn3") if args.quick else CANDIDATES
    rows = []
    for spec in candidates:
        log(f"  dose audit {spec}")
        rows.append(audit_one(spec, learner, prompts, args.quick))
    report: dict[str, Any] = {"study": "dose_response", "what": "doses fixed from audits (experiments/dose_audit.py)",
                              "model": MODEL, "task": TASK, "learner": LEARNER, "prompts": len(prompts),
                              "responses_per_prompt": 2 if args.quick else GROUP, "temperature": TEMPERATURE,
                              "max_new_tokens": MAX_NEW_TOKENS, "seed": SEED, "audits": rows,
                              "machine": machine(), "code_commit": code_commit()}
    if any(r["sampler"] == Q4_0 for r in rows):
        report["choice"] = choose_doses(rows)
    out = (args.out or OUT).resolve()
    write_json(report, out / "doses.json")
    for r in rows:
        print(f"{r['sampler']:>14}  k3 {r['k3']:.3g} [{r['k3_ci95'][0]:.3g}, {r['k3_ci95'][1]:.3g}]  "
              f"|Δp|≥0.01 {r['prob_diff_frac_ge_0.01']:.3f}  ({r['seconds']} s)")
    if "choice" in report:
        for name, d in report["choice"]["doses"].items():
            print(f"{name}: {d['sampler']} (k3 {d['k3']:.3g}, {d['ratio_to_q4_0']:.2f}× q4_0's)")
        if not report["choice"]["distinct"]:
            print("the rule picked the same sampler for two doses: the study cannot run as planned")
    print(f"dose_audit: wall time {clock.seconds:.1f} s → {out / 'doses.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
