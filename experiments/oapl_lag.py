"""Study 4 — OAPL under large lag: OAPL with the sampler synced every 1, 10, 50, 100 learner steps against
GRPO + token TIS (C = 2), at the same sample budget (same steps × 16 prompts × 8 responses).

    python -m experiments.oapl_lag            # full study
    python -m experiments.oapl_lag --quick    # 2 steps, 1 seed (smoke test)

OAPL arms: algorithm.name=oapl, algorithm.oapl_sync_every=N (the sampler keeps old weights for N steps).
Curves: greedy accuracy against generated samples (= step × 128), rollout reward. After each run the final
weights sample 16 responses per held-out prompt (temperature 1): unbiased pass@k for k = 1, 2, 4, 8, 16 and
the mean token entropy of those responses under the final policy.
"""

from __future__ import annotations

from math import comb
from pathlib import Path

import torch

from experiments.common import (
    RESULTS,
    Clock,
    curve_groups,
    plot_curves,
    plt,
    run_study_arms,
    save_figure,
    study_arguments,
    summarize_arms,
    summary,
    write_json,
)
from rollcorr.checkpoint import latest_checkpoint

SYNC_EVERY = (1, 10, 50, 100)
ARMS = {
    **{
        f"oapl_sync{n}": [
            "algorithm.name=oapl",
            f"algorithm.oapl_sync_every={n}",
            f"trainer.max_staleness={n}",
            "algorithm.correction={preset: disabled}",
        ]
        for n in SYNC_EVERY
    },
    "grpo_tis": ["algorithm.name=grpo", "algorithm.correction={preset: tis, is_upper: 2.0}"],
}
STEPS = 200
KS = (1, 2, 4, 8, 16)
KEYS = ("eval/accuracy", "reward/mean", "actor/entropy", "staleness/lag_mean", "response/length_mean")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 − C(n−c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


@torch.no_grad()
def held_out_eval(model_dir: Path, n_prompts: int, n_samples: int = 16, seed: int = 777) -> dict:
    """pass@k and mean token entropy of the final policy (HF directory ``model_dir``) on held-out prompts."""
    from rollcorr.engines import SamplingParams, make_learner, make_sampler
    from rollcorr.tasks import make_task

    task = make_task("addition")
    items = task.sample(n_prompts, seed=seed, split="test")
    sampler = make_sampler("hf:fp32", model_path=model_dir)
    rollout = sampler.generate([it["prompt"] for it in items],
                               SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed), n=n_samples)
    ids = [row[m].tolist() for row, m in zip(rollout.response_ids, rollout.response_mask.bool())]
    texts = sampler.tokenizer.batch_decode(ids, skip_special_tokens=True)
    correct = [0] * len(items)
    for i, text in enumerate(texts):  # n consecutive responses per prompt
        correct[i // n_samples] += task.reward(items[i // n_samples], text) >= 1.0
    _, entropy = make_learner("hf:fp32", model_path=model_dir).log_prob(rollout, with_entropy=True)
    mask = rollout.response_mask.bool()
    return {
        "pass_at_k": {
            k: sum(pass_at_k(n_samples, c, k) for c in correct) / len(items) for k in KS if k <= n_samples
        },
        "entropy": entropy[mask].mean().item(),
        "n_prompts": len(items),
    }


def plot_pass_at_k(held_out: dict, path: Path) -> Path:
    """pass@k against k (log scale) per arm, first grid point, mean ± std over seeds."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm, cells in held_out.items():
        per_k = next(iter(cells.values()))["pass_at_k"]
        ks = [int(k) for k in per_k]
        mean = [per_k[k]["mean"] for k in per_k]
        std = [per_k[k]["std"] for k in per_k]
        ax.errorbar(ks, mean, yerr=std, marker="o", capsize=3, label=arm, lw=1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per held-out prompt)")
    ax.set_ylabel("pass@k")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = study_arguments(__doc__.splitlines()[0], ARMS).parse_args(argv)
    out = args.out or RESULTS / "oapl_lag"
    clock = Clock()
    steps = args.steps or STEPS
    results = run_study_arms(args, ARMS, [f"trainer.steps={steps}", "trainer.eval_every=10"], out, keep=KEYS)
    n_prompts = 8 if args.quick else 100
    held_out = {}
    for arm, cells in results.items():
        held_out[arm] = {}
        for label, cell in cells.items():
            evals = []
            for run in cell["runs"]:
                final = latest_checkpoint(Path(run["run_dir"])) / "model"
                evals.append(held_out_eval(final, n_prompts, n_samples=4 if args.quick else 16))
            ks = evals[0]["pass_at_k"]
            held_out[arm][label] = {
                "pass_at_k": {k: summary([e["pass_at_k"][k] for e in evals]) for k in ks},
                "entropy": summary([e["entropy"] for e in evals]),
            }
    batch = 2 * 2 if args.quick else 16 * 8
    figures = {"curves": plot_curves(curve_groups(results), KEYS, out / "curves.png",
                                     title="OAPL sync interval vs GRPO + TIS at the same sample budget",
                                     x_scale=batch, x_label="generated samples").name}
    figures["pass_at_k"] = plot_pass_at_k(held_out, out / "pass_at_k.png").name
    report = {"study": "oapl_lag", "steps": steps, "quick": args.quick,
              "samples_per_step": None if args.quick else 128,
              "final": summarize_arms(results, KEYS), "held_out": held_out, "figures": figures,
              "runs": results, "wall_seconds": clock.seconds}
    write_json(report, out / "results.json")
    print(f"oapl_lag: wall time {clock.seconds:.1f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
