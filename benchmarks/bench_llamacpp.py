"""How far is a sampler's μ from the HF fp32 learner? llama.cpp at each quant type, measured with the audit.

    .venv/bin/python benchmarks/bench_llamacpp.py --model builtin --threads 1 [--specs llamacpp:f32 llamacpp:q4_0]
        [--prompts 64] [--n 4] [--max-new-tokens 8] [--seed 0]

Per engine spec: sample 3-digit addition rollouts (temperature 1, no truncation, so μ and π are directly
comparable) and score the sampled tokens with the hf fp32 learner — ``rollcorr.audit.collect`` — then read the
audit's own statistics (``rollcorr.audit.stats.audit_stats``), with ℓ = log π − log μ per token:

    mean_abs_log_ratio   mean |ℓ|                                 (divergence.log_ratio_abs_mean)
    k3_kl                mean exp(ℓ) − ℓ − 1, KL(μ‖π) estimate     (divergence.k3_kl)
    max_abs_dp           max |π(y_t) − μ(y_t)|                     (probability.prob_diff_max)
    frac_dp_gt_1e-3      share of tokens with |π − μ| ≥ 1e-3       (1 − probability.prob_diff_frac_lt_1e-3)

and, for llamacpp specs, the GGUF file's size. Any sampler spec works (e.g. hf:bf16). Prints a table; asserts
nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

QUANTS = ("f32", "f16", "q8_0", "q4_0")


def mismatch_report(model_path: str = "builtin", specs: Sequence[str] = tuple(f"llamacpp:{q}" for q in QUANTS), *,
                    prompts: int = 64, n: int = 4, max_new_tokens: int = 8, seed: int = 0,
                    threads: int = 1) -> list[dict[str, Any]]:
    """One row per spec (see the module docstring)."""
    from rollcorr.audit.collect import collect, from_rollout
    from rollcorr.audit.stats import audit_stats
    from rollcorr.engines import SamplingParams, make_learner, make_sampler
    from rollcorr.tasks.addition import AdditionTask

    path = None if model_path == "builtin" else model_path
    texts = [item["prompt"] for item in AdditionTask(digits=3).sample(prompts, seed=seed)]
    learner = make_learner("hf:fp32", path)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    report = []
    for spec in specs:
        sampler = make_sampler(spec, path, threads=threads)
        try:
            rollout = collect(sampler, learner, texts, params, n=n, batch_size=prompts)
            gguf = getattr(sampler, "gguf_path", None)
            size = gguf.stat().st_size / 2**20 if gguf is not None else float("nan")
        finally:
            sampler.close()
        data = from_rollout(rollout)
        stats = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask)
        p, d = stats["probability"], stats["divergence"]
        report.append({
            "spec": spec, "gguf_mb": size, "tokens": stats["n_tokens"],
            "mean_abs_log_ratio": d["log_ratio_abs_mean"], "k3_kl": d["k3_kl"],
            "max_abs_dp": p["prob_diff_max"], "frac_dp_gt_1e-3": 1.0 - p["prob_diff_frac_lt_1e-3"],
        })
    return report


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--specs", nargs="+", default=[f"llamacpp:{q}" for q in QUANTS])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = mismatch_report(args.model, args.specs, prompts=args.prompts, n=args.n,
                           max_new_tokens=args.max_new_tokens, seed=args.seed, threads=args.threads)
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
