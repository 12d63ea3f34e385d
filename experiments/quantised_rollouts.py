"""Study 2 — quantised rollouts (the TIS paper): does an int8 sampler hurt learning, and which correction
recovers it?

    python -m experiments.quantised_rollouts            # full study: 16 arms × grid × 3 seeds
    python -m experiments.quantised_rollouts --quick    # 2 steps, 1 seed (smoke test)

fp32 learner; samplers fp32 and int8 (``model.sampler``). Methods (``algorithm.correction``):
  ppo          PPO, π_old recomputed by the learner, no IS correction         (preset disabled)
  tis          token TIS, w_t = min(ρ_t, 2)                                     (preset tis)
  ppo_is       PPO-IS: π_old := μ, the PPO ratio is π_θ/μ                        (preset bypass_ppo_clip)
  vanilla_is   untruncated token IS, w_t = ρ_t                                   (tis, is_upper=null)
  icepop       w_t = ρ_t·1[0.5 ≤ ρ_t ≤ 5]                                        (preset icepop)
  seq_mis      w = ρ(y)·1[ρ(y) ≤ 2]                                             (preset seq_mis)
  geo_rs       reject sequences whose geometric-mean ratio leaves its band      (preset decoupled_geo_rs)
  geo_rs_skipzero  the same with optim.skip_zero_grad=true (no Adam step on a zero gradient)
Two optimizer steps per rollout batch (trainer.mini_batches=2), so the second one is off-policy and the
PPO ratio / KL estimate are not trivially 1 / 0. Curves: rollout reward, greedy accuracy, actor/ppo_kl (the k1 estimate of KL(π_old‖π_θ)), response length.
"""

from __future__ import annotations

from experiments.common import (
    RESULTS,
    Clock,
    curve_groups,
    plot_curves,
    run_study_arms,
    separated,
    study_arguments,
    summarize_arms,
    write_json,
)

METHODS = {
    "ppo": ["algorithm.correction={preset: disabled}"],
    "tis": ["algorithm.correction={preset: tis, is_upper: 2.0}"],
    "ppo_is": ["algorithm.correction={preset: bypass_ppo_clip}", "algorithm.proximal={name: bypass}"],
    "vanilla_is": ["algorithm.correction={preset: tis, is_upper: null}"],
    "icepop": ["algorithm.correction={preset: icepop}"],
    "seq_mis": ["algorithm.correction={preset: seq_mis}"],
    "geo_rs": ["algorithm.correction={preset: decoupled_geo_rs}"],
    # Not a method of the paper: Geo-RS with optim.skip_zero_grad, to test why Geo-RS collapses (results.md).
    "geo_rs_skipzero": ["algorithm.correction={preset: decoupled_geo_rs}", "optim.skip_zero_grad=true"],
}
SAMPLERS = {"fp32": "hf:fp32", "int8": "hf:int8"}
ARMS = {
    f"{s}/{m}": [f"model.sampler={spec}", *overrides]
    for s, spec in SAMPLERS.items()
    for m, overrides in METHODS.items()
}
# Diagnostic arms (not the paper's methods) run at the first learning rate only.
ONLY = {f"{s}/geo_rs_skipzero": ["optim.lr=0.0002"] for s in SAMPLERS}
STEPS = 150
KEYS = ("reward/mean", "eval/accuracy", "actor/ppo_kl", "response/length_mean", "actor/pg_clipfrac",
        "rollout_corr/prob_diff_max", "loss/grad_norm", "actor/entropy", "rollout_corr/kl")


PANELS = ("reward/mean", "eval/accuracy", "actor/entropy", "actor/ppo_kl", "rollout_corr/kl",
          "response/length_mean")


def above(acc: dict, high: str, low: str) -> bool | None:
    """Final greedy accuracy of arm ``high`` exceeds arm ``low`` by more than the seed spread (None when
    either arm was not run)."""
    if high not in acc or low not in acc:
        return None
    return separated(acc[high], acc[low]) and acc[high]["mean"] > acc[low]["mean"]


def main(argv: list[str] | None = None) -> int:
    args = study_arguments(__doc__.splitlines()[0], ARMS).parse_args(argv)
    out = args.out or RESULTS / "quantised_rollouts"
    clock = Clock()
    steps = args.steps or STEPS
    results = run_study_arms(
        args,
        ARMS,
        [f"trainer.steps={steps}", "trainer.eval_every=10", "trainer.mini_batches=2"],
        out,
        keep=KEYS,
        only=ONLY,
    )
    final = summarize_arms(results, KEYS)
    claims = {}
    for label in next(iter(final.values())):
        acc = {arm: final[arm][label]["eval/accuracy"] for arm in final if label in final[arm]}
        claims[label] = {
            "int8_ppo_worse_than_fp32_ppo": above(acc, "fp32/ppo", "int8/ppo"),
            "int8_tis_better_than_int8_ppo": above(acc, "int8/tis", "int8/ppo"),
            "int8_tis_vs_fp32_ppo_gap_beyond_spread": above(acc, "fp32/ppo", "int8/tis"),
        }
    figures = {}
    labels = sorted({label for cells in results.values() for label in cells})
    for label in labels:
        lr = label.split("optim.lr=")[-1].split()[0] if "optim.lr=" in label else ""
        for sampler in SAMPLERS:
            groups = {a: r for a, r in curve_groups(results, label).items()
                      if a.startswith(sampler + "/") and label in results[a]}
            if groups:
                name = f"curves_{sampler}" + (f"_lr{lr}" if lr else "") + ".png"
                plot_curves(groups, PANELS, out / name, title=f"{sampler} sampler, fp32 learner, {label}")
                figures[f"{sampler} {label}"] = name
    report = {"study": "quantised_rollouts", "steps": steps, "quick": args.quick, "final": final,
              "claims": claims, "figures": figures, "runs": results, "wall_seconds": clock.seconds}
    write_json(report, out / "results.json")
    print(f"quantised_rollouts: wall time {clock.seconds:.1f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
