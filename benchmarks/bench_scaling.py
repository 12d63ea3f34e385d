"""How the trainer's step time grows with batch size, response length and group size (sync mode, 1 thread).

    python benchmarks/bench_scaling.py [--steps 6] [--warmup 2] [--sweeps batch length group] [overrides ...]
    taskset -c 1 python benchmarks/bench_scaling.py --steps 5 > benchmarks/results/bench_scaling.txt

Each row is one ``rollcorr train`` run on the built-in model and task (``trainer.mode=sync``), timed from the
trainer's own ``time/step_s`` over the steps after ``--warmup`` (median wall seconds per step), with the median
number of response tokens per step (responses may stop before ``max_new_tokens``), and the CPU seconds per
step: the process CPU time of that run minus that of a run of only the ``--warmup`` steps, over ``--steps``
(setup, model load and warm-up cancel out, after one untimed run has paid the process's one-time costs; on a
loaded machine CPU time is the steadier of the two).
The column ``growth/linear`` is the CPU time per step relative to the sweep's first row divided by the growth
of the response tokens per step: 1.0 everywhere is linear scaling, < 1 sub-linear (fixed costs dominate), > 1
super-linear.

Sweeps: ``batch`` (rollout.prompts_per_step at group size 8, the addition task), ``length``
(rollout.max_new_tokens on the long-response chain task and its built-in model, whose 71-token answers are cut
at max_new_tokens, so the response length follows it) and ``group`` (rollout.group_size at 8 prompts per step,
so the batch grows with G). The machine is shared: the load
average is printed per row. Its output (a ``#`` header naming the machine, the load and the command, then one
``a | b`` table per sweep) is what docs/performance.md quotes. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

import torch
from benchmarks.bench_train import bench
from benchmarks.machine import load, machine

SWEEPS = {
    "batch": ("rollout.prompts_per_step", [4, 8, 16, 32], ["rollout.group_size=8"]),
    "length": ("rollout.max_new_tokens", [9, 18, 36, 72], ["model.path=builtin:chain", "task.name=chain"]),
    "group": ("rollout.group_size", [2, 4, 8, 16], ["rollout.prompts_per_step=8"]),
}


def quiet_bench(overrides: list[str], steps: int, warmup: int) -> list[dict]:
    """``bench`` with the run's own lines (its checkpoint notes) kept out of this output."""
    with contextlib.redirect_stdout(io.StringIO()):
        return bench(overrides, steps, warmup)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--sweeps", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "?"
    print(f"# bench_scaling: {machine()}; load before {load()}; command: python benchmarks/bench_scaling.py "
          f"{' '.join(sys.argv[1:])} (cores {cores})")
    print(f"# rollcorr train, sync mode, 1 thread, the built-in model; {args.steps} timed steps after {args.warmup}; "
          "wall: the median time/step_s; CPU: (CPU s of the run − CPU s of a warm-up-only run) / timed steps; "
          "growth / linear: CPU s per step relative to the sweep's first row over the growth of its tokens per step")
    quiet_bench(["trainer.mode=sync"], 0, 1)  # untimed: the process's one-time costs (imports, first model load)
    for sweep in args.sweeps:
        key, values, fixed = SWEEPS[sweep]
        print(f"{key} | responses | wall s / step | CPU s / step | tokens / step | CPU ms / token | growth / linear "
              "| load")
        first = None
        for value in values:
            overrides = ["trainer.mode=sync", *fixed, f"{key}={value}", *args.overrides]
            start = time.process_time()
            quiet_bench(overrides, 0, args.warmup)
            mid = time.process_time()
            rows = quiet_bench(overrides, args.steps, args.warmup)
            cpu = (time.process_time() - mid - (mid - start)) / args.steps
            step = statistics.median(r["time/step_s"] for r in rows)
            tokens = statistics.median(r["response/tokens"] for r in rows)
            first = first or (tokens, cpu)
            rel = (cpu / first[1]) / (tokens / first[0])
            responses = rows[0]["samples"]
            print(f"{value} | {responses} | {step:.3f} | {cpu:.3f} | {tokens:.0f} | {1000 * cpu / tokens:.2f} | "
                  f"{rel:.2f} | {os.getloadavg()[0]:.1f}", flush=True)
    print(f"# load after {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
