"""Multi-turn training with a slow environment: steps/s of sync against async when every environment call
waits 50 ms (a tool, a service), in one run.

    python benchmarks/bench_multi_turn.py > benchmarks/results/bench_multi_turn.txt
    python benchmarks/bench_multi_turn.py --runs 1 --steps 6        # quicker

Each case is a fresh ``rollcorr train --config chain_turns`` (the chain task in two model turns on its built-in
model, 8 prompts × 8 responses) with the ``slow_checkpoints`` environment of benchmarks/slow_env.py — the
built-in ``checkpoints`` environment whose every reset and step first sleeps ``--wait`` seconds —, no
evaluation, for ``--steps`` steps; ``--runs`` of each case interleaved; per run the median of ``time/step_s`` over
the steps after the first two. Cases: ``trainer.mode=sync`` and ``trainer.mode=async`` (the sampler and the
environment in their own process, the learner training meanwhile; ``max_staleness`` 1), each with the episodes
stepped one at a time (``task.env.workers=1``: 64 episodes × 2 steps + 64 resets wait 9.6 s a batch) and eight
side by side (``workers=8``). The ratio is async's steps/s over sync's at the same workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

HERE = Path(__file__).resolve().parent
MODES = {"sync": ["trainer.mode=sync"], "async": ["trainer.mode=async", "trainer.max_staleness=1"]}


def one_run(mode: str, workers: int, steps: int, wait: float, out: Path) -> float:
    """Median seconds per step of one fresh run (steps after the first two)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "rollcorr", "train", "--config", "chain_turns", "plugins=[slow_env]",
            f"task.env={{name: slow_checkpoints, every: 7, wait: {wait}, workers: {workers}}}",
            f"trainer.steps={steps}", "trainer.eval_every=0", "task.eval_prompts=0", "trainer.progress=false",
            "trainer.tensorboard=false", "trainer.plot=false", "trainer.checkpoint_every=0",
            f"trainer.out={out}", *MODES[mode]]
    subprocess.run(args, check=True, capture_output=True, text=True, env=env, cwd=HERE)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["time/step_s"] for r in records if r.get("step", 0) > 2 and "time/step_s" in r]
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--wait", type=float, default=0.05, help="seconds each environment call waits")
    args = parser.parse_args()
    print(f"# {machine()}; load {load()} at start")
    print(f"# command: python benchmarks/bench_multi_turn.py --runs {args.runs} --steps {args.steps} --wait {args.wait}")
    cases = [(mode, workers) for workers in (1, 8) for mode in MODES]
    seconds: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for mode, workers in cases:
                seconds[mode, workers].append(one_run(mode, workers, args.steps, args.wait,
                                                      Path(tmp) / f"{mode}-{workers}-{run}"))
    print(f"# load {load()} at end")
    print("| episodes stepped | sync s/step | async s/step | async / sync steps/s |")
    print("|---|---|---|---|")
    for workers in (1, 8):
        sync, async_ = (statistics.median(seconds[mode, workers]) for mode in MODES)
        print(f"| {'one at a time' if workers == 1 else f'{workers} side by side'} | {sync:.2f} | {async_:.2f} | "
              f"{sync / async_:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
