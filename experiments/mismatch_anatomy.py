"""Study 1 — mismatch anatomy: how far each sampler's token probabilities are from the fp32 learner's.

    python -m experiments.mismatch_anatomy            # full study (3 seeds, all samplers)
    python -m experiments.mismatch_anatomy --quick    # 1 seed, 4 prompts, 2 samplers

For every sampler (fp32, bf16 eager / sdpa, int8, llama.cpp q8_0 / q4_0) and seed:
- task set: held-out addition prompts, 6 new tokens (the training distribution) → the ABEJA |Δp| table
  (share < 1e-3, ≥ 0.01, ≥ 0.05, ≥ 0.1, max), the audit's scatter and histogram;
- long set: multi-term sums and digit strings, up to 96 new tokens → per-response mean and max |Δp| binned
  by response length, and the prefix curve E_b[max_{t<L} |Δp|] vs E_b[mean_{t<L} |Δp|] over the first L
  tokens (the TIS paper: the max grows with length, the mean does not);
- batch composition (int8 only): the same fixed responses scored by the int8 model alone, in batches of
  8 / 64 task rows, and next to long, heavily padded rows; |Δp| to fp32 per condition, and the change
  of each token's int8 probability against scoring it alone. An fp32 model scored the same way is the control.
Writes results/mismatch_anatomy/results.json and PNGs; prints the wall time.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

from experiments.common import RESULTS, Clock, log, save_figure, separated, summary, write_json

SAMPLERS = ("hf:fp32", "hf:bf16", "hf:bf16:sdpa", "hf:int8", "llamacpp:q8_0", "llamacpp:q4_0")
TABLE_KEYS = (
    "prob_diff_frac_lt_1e-3",
    "prob_diff_frac_ge_0.01",
    "prob_diff_frac_ge_0.05",
    "prob_diff_frac_ge_0.1",
    "prob_diff_max",
    "prob_diff_mean",
)
LENGTH_BINS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 96))  # inclusive token-count bins
PREFIXES = (1, 2, 4, 8, 16, 32, 64, 96)
SHORT_TOKENS, LONG_TOKENS = 6, 96


def long_prompts(n: int, seed: int) -> list[str]:
    """Prompts that make the built-in model write long responses: half 3-6-term sums (EOS after 4 to ~96
    tokens), half digit strings of 8-24 digits (it keeps writing digits until the cap)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append("+".join(str(rng.randint(100, 999)) for _ in range(rng.randint(3, 6))) + "=")
        else:
            out.append("".join(rng.choice("0123456789") for _ in range(rng.randint(8, 24))))
    return out


def scored(sampler, learner, prompts: list[str], max_new_tokens: int, seed: int, batch_size: int):
    """Sample with ``sampler`` (temperature 1), score with the learner → TokenView (float64, validated)."""
    from rollcorr.audit.collect import collect, from_rollout
    from rollcorr.audit.stats import check_inputs
    from rollcorr.engines import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    rollout = collect(sampler, learner, prompts, params, batch_size=batch_size)
    data = from_rollout(rollout)
    return rollout, check_inputs(data.rollout_log_prob, data.old_log_prob, data.response_mask)


def length_profile(view) -> dict[str, Any]:
    """Per-response mean/max |Δp| averaged within length bins, and the prefix curve over the first L tokens."""
    from rollcorr.audit.stats import per_response

    rows = per_response(view)
    bins = []
    for lo, hi in LENGTH_BINS:
        sel = (rows["length"] >= lo) & (rows["length"] <= hi)
        n = int(sel.sum())
        bins.append(
            {
                "bin": [lo, hi],
                "n": n,
                "mean_abs_diff": rows["mean_abs_diff"][sel].mean().item() if n else None,
                "max_abs_diff": rows["max_abs_diff"][sel].mean().item() if n else None,
            }
        )
    abs_diff, length = view.abs_diff, view.mask.sum(dim=1)
    prefix = []
    for L in PREFIXES:
        sel = length >= L
        n = int(sel.sum())
        head = abs_diff[sel, :L]
        prefix.append(
            {
                "L": L,
                "n": n,
                "max_abs_diff": head.max(dim=1).values.mean().item() if n else None,
                "mean_abs_diff": head.mean(dim=1).mean().item() if n else None,
            }
        )
    return {"bins": bins, "prefix": prefix}


# ---------------------------------------------------------------- batch composition (int8)


def scorer(quant: str | None):
    """An fp32 HF learner; with quant="int8" its Linear layers are dynamically quantised (the int8
    sampler's model), so the same tokens can be scored in any batch we choose."""
    from rollcorr.engines import make_learner
    from rollcorr.engines.hf import quantize_int8

    learner = make_learner("hf:fp32")
    if quant == "int8":
        learner.model = quantize_int8(learner.model)
    return learner


@torch.no_grad()
def batch_composition(targets, fillers, reference, n_alone: int) -> dict[str, Any]:
    """Score the first ``n_alone`` rows of ``targets`` (a Rollout with old_log_prob = fp32 reference) under
    each model in ``reference`` ({name: learner}) alone, in task batches of 8 and 64, and next to the long
    rows in ``fillers``. Returns per model and condition: mean |Δp| to fp32 and the max / mean change of
    p against scoring alone, over the valid tokens of the target rows."""
    from rollcorr.rollout import Rollout

    k = min(n_alone, targets.batch_size)
    mask = targets.response_mask[:k].bool()
    p_ref = targets.old_log_prob[:k].double().exp()
    conditions: dict[str, list] = {
        "alone": [[i] for i in range(k)],
        "batch_8": [list(range(s, min(s + 8, targets.batch_size))) for s in range(0, k, 8)],
        "batch_64": [list(range(s, min(s + 64, targets.batch_size))) for s in range(0, k, 64)],
        "with_long_rows": [[i] for i in range(k)],
    }
    out: dict[str, Any] = {}
    for name, learner in reference.items():
        probs = {}
        for cond, groups in conditions.items():
            p = torch.zeros_like(p_ref)
            for rows in groups:
                part = targets.select(rows)
                if cond == "with_long_rows":
                    part = Rollout.concat([part, fillers], pad_token_id=learner.tokenizer.pad_token_id or 0)
                lp = learner.log_prob(part).double()[: len(rows), : p.shape[1]]
                keep = [r for r in rows if r < k]
                width = min(lp.shape[1], p.shape[1])
                p[keep, :width] = lp[: len(keep), :width].exp()
            probs[cond] = p
        out[name] = {
            cond: {
                "mean_abs_diff_to_fp32": (p - p_ref).abs()[mask].mean().item(),
                "max_abs_diff_to_fp32": (p - p_ref).abs()[mask].max().item(),
                "max_change_vs_alone": (p - probs["alone"]).abs()[mask].max().item(),
                "mean_change_vs_alone": (p - probs["alone"]).abs()[mask].mean().item(),
                "frac_tokens_changed": ((p - probs["alone"]).abs()[mask] > 0).double().mean().item(),
            }
            for cond, p in probs.items()
        }
    return out


# ---------------------------------------------------------------- plots


def plot_length(results: dict[str, Any], path: Path) -> Path:
    """Two panels: per-response mean and max |Δp| by length bin, and the prefix curve; mean ± std over seeds."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    for i, (spec, res) in enumerate(results.items()):
        color = f"C{i}"  # one colour per sampler
        bins = res["length"]["bins"]
        x = [b["bin"][0] for b in bins]
        for key, style in (("max_abs_diff", "-"), ("mean_abs_diff", ":")):
            m = [b[key]["mean"] for b in bins]
            xs = [xx for xx, mm in zip(x, m) if mm is not None]
            ys = [mm for mm in m if mm is not None]
            es = [b[key]["std"] for b in bins if b[key]["mean"] is not None]
            left.errorbar(xs, ys, yerr=es, ls=style, marker="o", ms=3, capsize=2, color=color)
        pre = res["length"]["prefix"]
        L = [p["L"] for p in pre if p["max_abs_diff"]["mean"] is not None]
        for key, style in (("max_abs_diff", "-"), ("mean_abs_diff", ":")):
            m = [p[key]["mean"] for p in pre if p[key]["mean"] is not None]
            e = [p[key]["std"] for p in pre if p[key]["mean"] is not None]
            right.errorbar(L, m, yerr=e, ls=style, marker="o", ms=3, capsize=2, color=color,
                           label=spec if key == "max_abs_diff" else None)
    left.set(xscale="log", yscale="log", xlabel="response length bin (first token count)",
             ylabel="per-response |Δp| (mean over responses)")
    left.set_title("Mean (dotted) and max (solid) |Δp| per response, by length")
    right.set(xscale="log", yscale="log", xlabel="prefix length L (tokens)",
              ylabel="E[max_{t<L} |Δp|]  /  E[mean_{t<L} |Δp|]")
    right.set_title("First L tokens of the long responses (mean ± std over seeds)")
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    right.legend(fontsize=7, title="solid: max, dotted: mean", title_fontsize=7)
    return save_figure(fig, path)


def plot_table(results: dict[str, Any], path: Path) -> Path:
    """Bar chart of the ABEJA shares per sampler (mean ± std over seeds)."""
    import matplotlib.pyplot as plt

    keys = TABLE_KEYS[1:4]
    specs = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        m = [results[s]["table"][key]["mean"] * 100 for s in specs]
        e = [results[s]["table"][key]["std"] * 100 for s in specs]
        ax.bar([i + j * width for i in range(len(specs))], m, width, yerr=e, capsize=2,
               label=key.replace("prob_diff_frac_", "|Δp| "))
    ax.set_xticks([i + width for i in range(len(specs))], specs, rotation=20)
    ax.set(ylabel="% of sampled tokens", title="Share of task tokens with a large |Δp| (fp32 learner)")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


# ---------------------------------------------------------------- the study


def run(
    samplers: tuple[str, ...] = SAMPLERS,
    seeds: tuple[int, ...] = (0, 1, 2),
    n_task: int = 256,
    n_long: int = 48,
    n_batch: int = 64,
    out: Path = RESULTS / "mismatch_anatomy",
) -> dict[str, Any]:
    """Run the study; returns (and writes to ``out/results.json``) every number."""
    from rollcorr.audit import plots
    from rollcorr.audit.collect import builtin_prompts
    from rollcorr.audit.stats import probability_mismatch
    from rollcorr.engines import make_learner, make_sampler

    torch.set_num_threads(1)
    clock = Clock()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    learner = make_learner("hf:fp32")
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    batch_inputs = None
    for spec in samplers:
        try:
            sampler = make_sampler(spec)
        except (ImportError, RuntimeError) as err:  # llama.cpp extra missing
            skipped[spec] = str(err)
            log(f"skip {spec}: {err}")
            continue
        per_seed: list[dict[str, Any]] = []
        for seed in seeds:
            log(f"{spec} seed {seed}  ({clock.seconds:.0f} s)")
            task_rollout, task_view = scored(sampler, learner, builtin_prompts(n_task, seed), SHORT_TOKENS,
                                             seed, batch_size=32)
            long_rollout, long_view = scored(sampler, learner, long_prompts(n_long, seed), LONG_TOKENS,
                                             seed, batch_size=16)
            table = probability_mismatch(task_view)
            per_seed.append(
                {
                    "table": {k: table[k] for k in TABLE_KEYS},
                    "task_tokens": int(task_view.mask.sum()),
                    "long_tokens": int(long_view.mask.sum()),
                    "long_mean_length": long_view.mask.sum(dim=1).double().mean().item(),
                    "length": length_profile(long_view),
                }
            )
            if seed == seeds[0]:
                name = spec.replace(":", "_")
                plots.scatter(task_view, out / f"scatter_{name}.png", title=f"{spec} sampler vs fp32 learner")
                plots.histogram(task_view, out / f"histogram_{name}.png")
                plots.per_response_plot(long_view, out / f"per_response_long_{name}.png")
                if spec == "hf:fp32" and batch_inputs is None:
                    batch_inputs = (
                        task_rollout,
                        long_rollout.select(list(range(min(4, long_rollout.batch_size)))),
                    )
        close = getattr(sampler, "close", None)
        if close:
            close()
        results[spec] = aggregate(per_seed)
        results[spec]["seeds"] = per_seed

    composition = None
    if "hf:int8" in samplers and batch_inputs is not None:
        log(f"batch composition  ({clock.seconds:.0f} s)")
        targets, fillers = batch_inputs
        composition = batch_composition(
            targets, fillers, {"int8": scorer("int8"), "fp32": scorer(None)}, n_alone=n_batch
        )

    figures = {}
    if results:
        figures["length"] = str(plot_length(results, out / "length.png").name)
        figures["table"] = str(plot_table(results, out / "table.png").name)
    claims = length_claims(results)
    report = {
        "study": "mismatch_anatomy",
        "seeds": list(seeds),
        "n_task_prompts": n_task,
        "n_long_prompts": n_long,
        "task_max_new_tokens": SHORT_TOKENS,
        "long_max_new_tokens": LONG_TOKENS,
        "learner": "hf:fp32",
        "temperature": 1.0,
        "samplers": results,
        "skipped": skipped,
        "batch_composition": composition,
        "claims": claims,
        "figures": figures,
        "wall_seconds": clock.seconds,
    }
    write_json(report, out / "results.json")
    print(f"mismatch_anatomy: wall time {clock.seconds:.1f} s → {out / 'results.json'}")
    return report


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ± std over seeds of the table, the length bins and the prefix curve."""
    table = {k: summary([s["table"][k] for s in per_seed]) for k in TABLE_KEYS}
    first = per_seed[0]["length"]
    bins = []
    for i, b in enumerate(first["bins"]):
        bins.append(
            {
                "bin": b["bin"],
                "n": [s["length"]["bins"][i]["n"] for s in per_seed],
                **{
                    key: summary(
                        [s["length"]["bins"][i][key] for s in per_seed if s["length"]["bins"][i]["n"]]
                    )
                    for key in ("mean_abs_diff", "max_abs_diff")
                },
            }
        )
    prefix = []
    for i, p in enumerate(first["prefix"]):
        prefix.append(
            {
                "L": p["L"],
                "n": [s["length"]["prefix"][i]["n"] for s in per_seed],
                **{
                    key: summary(
                        [s["length"]["prefix"][i][key] for s in per_seed if s["length"]["prefix"][i]["n"]]
                    )
                    for key in ("mean_abs_diff", "max_abs_diff")
                },
            }
        )
    return {"table": table, "length": {"bins": bins, "prefix": prefix}}


def length_claims(results: dict[str, Any]) -> dict[str, Any]:
    """Per sampler: does the max (resp. mean) |Δp| at the longest prefix exceed the one at L = 4 by more
    than the seed spread? (the TIS paper: max yes, mean no)."""
    claims = {}
    for spec, res in results.items():
        pre = {p["L"]: p for p in res["length"]["prefix"]}
        longest = max((L for L, p in pre.items() if p["max_abs_diff"]["mean"] is not None), default=None)
        if longest is None or 4 not in pre or pre[4]["max_abs_diff"]["mean"] is None:
            continue
        claims[spec] = {
            "prefix_short": 4,
            "prefix_long": longest,
            "max_grows": separated(pre[longest]["max_abs_diff"], pre[4]["max_abs_diff"])
            and pre[longest]["max_abs_diff"]["mean"] > pre[4]["max_abs_diff"]["mean"],
            "mean_changes": separated(pre[longest]["mean_abs_diff"], pre[4]["mean_abs_diff"]),
            "mean_ratio_long_over_short": _ratio(pre[longest]["mean_abs_diff"], pre[4]["mean_abs_diff"]),
            "max_ratio_long_over_short": _ratio(pre[longest]["max_abs_diff"], pre[4]["max_abs_diff"]),
        }
    return claims


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return a["mean"] / b["mean"] if a["mean"] is not None and b["mean"] else None


def _pm(s: dict[str, Any], scale: float = 1.0, fmt: str = ".3g") -> str:
    if s["mean"] is None:
        return "–"
    return f"{s['mean'] * scale:{fmt}} ± {s['std'] * scale:{fmt}}"


def markdown(report: dict[str, Any]) -> str:
    """The tables of docs/results.md, rendered from a results.json (mean ± std over seeds)."""
    lines = ["| sampler | < 1e-3 (%) | ≥ 0.01 (%) | ≥ 0.05 (%) | ≥ 0.1 (%) | max | mean |", "|---" * 7 + "|"]
    for spec, res in report["samplers"].items():
        t = res["table"]
        lines.append(
            f"| {spec} | {_pm(t['prob_diff_frac_lt_1e-3'], 100, '.2f')} | {_pm(t['prob_diff_frac_ge_0.01'], 100, '.2f')}"
            f" | {_pm(t['prob_diff_frac_ge_0.05'], 100, '.2f')} | {_pm(t['prob_diff_frac_ge_0.1'], 100, '.2f')}"
            f" | {_pm(t['prob_diff_max'])} | {_pm(t['prob_diff_mean'])} |"
        )
    lines += [
        "",
        "| sampler | L | max_{t<L} \\|Δp\\| | mean_{t<L} \\|Δp\\| | responses ≥ L |",
        "|---" * 5 + "|",
    ]
    for spec, res in report["samplers"].items():
        for p in res["length"]["prefix"]:
            if p["L"] in (4, 16, 96):
                lines.append(
                    f"| {spec} | {p['L']} | {_pm(p['max_abs_diff'])} | {_pm(p['mean_abs_diff'])} | {p['n']} |"
                )
    lines += [
        "",
        "| sampler | max grows (4 → longest) | mean changes | max ratio | mean ratio |",
        "|---" * 5 + "|",
    ]
    for spec, c in report["claims"].items():
        lines.append(
            f"| {spec} | {c['max_grows']} | {c['mean_changes']} | {c['max_ratio_long_over_short']:.3g}"
            f" | {c['mean_ratio_long_over_short']:.3g} |"
        )
    comp = report.get("batch_composition")
    if comp:
        lines += ["", "| scorer | condition | mean \\|Δp\\| to fp32 | mean \\|p − p_alone\\| | max \\|p − p_alone\\| "
                  "| tokens changed (%) |", "|---" * 6 + "|"]
        for name, conds in comp.items():
            for cond, v in conds.items():
                lines.append(
                    f"| {name} | {cond} | {v['mean_abs_diff_to_fp32']:.3g} | {v['mean_change_vs_alone']:.3g}"
                    f" | {v['max_change_vs_alone']:.3g} | {100 * v['frac_tokens_changed']:.1f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 prompts, 2 samplers (smoke test)")
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--task-prompts", type=int, default=256)
    parser.add_argument("--long-prompts", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS / "mismatch_anatomy")
    parser.add_argument("--markdown", type=Path, default=None, metavar="RESULTS_JSON",
                        help="print the tables of an existing results.json as markdown and exit")
    args = parser.parse_args(argv)
    if args.markdown is not None:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.quick:
        run(("hf:fp32", "hf:int8"), (0,), n_task=4, n_long=4, n_batch=4, out=args.out)
    else:
        run(tuple(args.samplers), tuple(range(args.seeds)), args.task_prompts, args.long_prompts,
            out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
