"""The multi-turn recipe of docs/multi-turn.md, run in full: `rollcorr train --config chain_turns` (the chain task
in two model turns, the environment writing the right number back between them) for three seeds, its
baseline and trained greedy scores written to experiments/results/multi_turn/results.json.

    python -m experiments.multi_turn                      # seeds 0, 1, 2 at the config's 150 steps
    python -m experiments.multi_turn --steps 2 --out DIR  # a smoke run

Each seed's run is the docs' command with ``trainer.seed`` set; its curve (greedy score and accuracy at every
evaluation), the mean number of model turns per trajectory and the wall time go to the results file with the
machine, the load and the code commit. Not a pre-registered study: a measured recipe, said as such.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, RUNS, code_commit, machine, train, write_json

COMMAND = "rollcorr train --config chain_turns"  # the docs' first command
SEEDS = (0, 1, 2)
OUT = RESULTS / "multi_turn"


def one_seed(seed: int, steps: int | None, run_root: Path) -> dict[str, Any]:
    from rollcorr.train.config import preset_overrides

    overrides = [*preset_overrides("chain_turns"), f"trainer.seed={seed}"]
    if steps is not None:
        overrides += [f"trainer.steps={steps}", "trainer.eval_every=1", "task.eval_prompts=8"]
    start, load = time.perf_counter(), os.getloadavg()[0]
    result = train(overrides, run_root / f"seed{seed}")
    records = result["records"]
    evals = [[r["step"], r["eval/reward"], r["eval/accuracy"]] for r in records if r.get("eval/reward") is not None]
    turns = [r["env/turns_mean"] for r in records if r.get("env/turns_mean") is not None]
    return {"seed": seed, "overrides": overrides, "evals": evals, "initial_score": evals[0][1],
            "final_score": evals[-1][1], "initial_accuracy": evals[0][2], "final_accuracy": evals[-1][2],
            "turns_per_trajectory": statistics.fmean(turns) if turns else None, "stopped": result["stopped"],
            "seconds": time.perf_counter() - start, "load_before": load, "load_after": os.getloadavg()[0]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="a shorter run (smoke test); needs --out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps is not None and args.out is None:
        parser.error("--steps writes a smoke run elsewhere than the recipe's results: give --out")
    out = (args.out or OUT).resolve()
    run_root = out / "run_dirs" if args.out is not None else RUNS / "multi_turn"
    runs = [one_seed(seed, args.steps, run_root) for seed in SEEDS]
    summary = {"command": COMMAND, "seeds": list(SEEDS),
               "initial_score_mean": statistics.fmean(r["initial_score"] for r in runs),
               "final_score_mean": statistics.fmean(r["final_score"] for r in runs),
               "turns_per_trajectory_mean": statistics.fmean(r["turns_per_trajectory"] for r in runs)}  # fmt: skip
    write_json({"recipe": "multi_turn", "summary": summary, "runs": runs, "machine": machine(),
                "code_commit": code_commit()}, out / "results.json")  # fmt: skip
    print(f"multi_turn: greedy score {summary['initial_score_mean']:.3f} → {summary['final_score_mean']:.3f} over "
          f"{len(runs)} seeds → {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
