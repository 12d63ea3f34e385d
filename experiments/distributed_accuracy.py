"""Does the data-parallel learner end in the same accuracy band as one process? The default config
(`rollcorr train`, 600 steps) at trainer.ranks=1 and trainer.ranks=2, seeds 0-2, through the public command
(N=2 starts two learner processes with torch.distributed.run, gloo on CPU).

    PYTHONPATH=. .venv/bin/python -m experiments.distributed_accuracy            # 6 runs (N=2 uses both cores)
    PYTHONPATH=. .venv/bin/python -m experiments.distributed_accuracy --assemble # results.json from the runs

The rule, fixed before the runs (docs/distributed.md): N=2 is "in the same band" as N=1 when their mean final
greedy accuracies over the three seeds are not separated by the rule of studies 1-6 (|difference| ≤ the sum of
the sample standard deviations, ``experiments.common.separated``). A check of the learner, not a study of a
claim: three seeds cannot show that two arms are equal, only that N=2 does not fall outside N=1's spread.
Each finished run is one file in ``experiments/results/distributed_accuracy/runs/`` and is never rerun.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, Clock, code_commit, log, separated, summary, write_json

SEEDS = (0, 1, 2)
RANKS = (1, 2)
OUT = RESULTS / "distributed_accuracy"
SCORE = "eval/accuracy"


def run_file(out: Path, ranks: int, seed: int) -> Path:
    return out / "runs" / f"ranks{ranks}_s{seed}.json"


def one_run(ranks: int, seed: int, out: Path, steps: int) -> dict[str, Any]:
    """One `rollcorr train` run of the default config (or its file read back)."""
    path = run_file(out, ranks, seed)
    if path.is_file():
        return json.loads(path.read_text())
    log(f"  ranks={ranks} seed {seed}")
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rollcorr", "train", f"trainer.ranks={ranks}", f"trainer.seed={seed}",
               f"trainer.steps={steps}", f"trainer.out={tmp}/run", "trainer.progress=false", "trainer.plot=false",
               "trainer.tensorboard=false", "trainer.checkpoint_every=0"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        records = [
            json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        ]
    evals = [(r["step"], r[SCORE]) for r in records if r.get(SCORE) is not None]
    record = {"ranks": ranks, "seed": seed, "steps": steps, "evals": evals, "final_accuracy": evals[-1][1],
              "learner_ranks": next(r["learner/ranks"] for r in records if "learner/ranks" in r),
              "seconds": clock.seconds, "code_commit": code_commit()}
    write_json(record, path)
    return record


def assemble(out: Path) -> dict[str, Any]:
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    arms = {f"ranks={n}": summary([r["final_accuracy"] for r in runs if r["ranks"] == n]) for n in RANKS}
    complete = all(len(arms[f"ranks={n}"]["values"]) == len(SEEDS) for n in RANKS)
    a, b = arms["ranks=2"], arms["ranks=1"]
    band = (not separated(a, b)) if complete else None
    report = {"study": "distributed_accuracy", "seeds": list(SEEDS), "arms": arms, "same_band": band,
              "runs": runs, "code_commits": sorted({r["code_commit"] or "" for r in runs})}
    write_json(report, out / "results.json")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--assemble", action="store_true", help="only assemble results.json from the run files"
    )
    parser.add_argument("--steps", type=int, default=600, help="steps per run (600 = the default config)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if not args.assemble:
        for seed in args.seeds:
            for ranks in RANKS:
                one_run(ranks, seed, args.out, args.steps)
    report = assemble(args.out)
    print(json.dumps({"arms": {k: {x: v[x] for x in ("mean", "std", "values")} for k, v in report["arms"].items()},
                      "same_band": report["same_band"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
