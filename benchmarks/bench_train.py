"""Training throughput per execution mode, and the cost of each π_old strategy, on this machine.

    python benchmarks/bench_train.py                       # 12 steps per run, default batch (16 × 8)
    python benchmarks/bench_train.py --steps 20 --skip-strategies

Part 1 — modes: ``sync``, ``simulated_async`` (lag 2) and ``async`` (max_staleness 2, queue 2; and with partial
rollouts) on the built-in model and task with the default config. Reported: steps/s and response tokens/s
over the timed steps (the first ``--warmup`` steps are excluded: they include the initial evaluation),
measured from ``time/step_s`` in metrics.jsonl.

Part 2 — π_old strategies in ``simulated_async`` (lag 2, so π_old ≠ π_train(v_gen) for most tokens): the
strategy's own time per step (``proximal/seconds``, mean), the extra memory it holds (``proximal/extra_bytes``,
last step) and, with ``measure_error=true``, the mean |log π_old − log π_train(v_gen)| against the exact old
logits (``proximal/error/logp_abs_err_mean``; 0 for exact strategies).

Every run uses ``trainer.threads`` (default 1) torch threads; no evaluation, checkpoint or plot during the
timed steps. The machine is shared: numbers vary with its load; the command line is printed with them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

import torch

from rollcorr.train.config import load_config
from rollcorr.train.loop import run

MODES = {
    "sync": ["trainer.mode=sync"],
    "simulated_async(lag=2)": ["trainer.mode=simulated_async", "trainer.lag=2"],
    "async(S=2)": ["trainer.mode=async", "trainer.max_staleness=2"],
    "async(S=2,partial)": ["trainer.mode=async", "trainer.max_staleness=2", "trainer.partial_rollouts=true"],
}
STRATEGIES = (
    "recompute",
    "bypass",
    "snapshot",
    "old_logit_model",
    "interrupt",
    "loglinear",
    "linear",
    "ewma",
)


def bench(overrides: list[str], steps: int, warmup: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            None,
            [
                f"trainer.steps={steps + warmup}",
                "trainer.eval_every=0",
                "trainer.checkpoint_every=0",
                "task.eval_prompts=0",
                "trainer.progress=false",
                "trainer.plot=false",
                "trainer.tensorboard=false",
                f"trainer.out={tmp}/run",
                *overrides,
            ],
        )
        result = run(config)
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r][warmup:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--skip-modes", action="store_true")
    p.add_argument("--skip-strategies", action="store_true")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # model loads and checkpoint writes would flood the table
    print(f"# {' '.join(sys.argv)}")

    if not args.skip_modes:
        print(f"\n{'mode':<24}{'steps/s':>10}{'tokens/s':>12}{'s/step':>10}{'lag mean':>10}{'lag max':>9}")
        for name, overrides in MODES.items():
            rows = bench([*overrides, *args.overrides], args.steps, args.warmup)
            seconds = sum(r["time/step_s"] for r in rows)
            tokens = sum(r["response/tokens"] for r in rows)
            lag = statistics.mean(r["staleness/lag_mean"] for r in rows)
            lag_max = max(r["staleness/lag_max"] for r in rows)
            print(f"{name:<24}{len(rows) / seconds:>10.2f}{tokens / seconds:>12.0f}{seconds / len(rows):>10.3f}"
                  f"{lag:>10.2f}{lag_max:>9.0f}")  # fmt: skip

    if not args.skip_strategies:
        print(
            f"\n{'π_old strategy (sim-async lag 2)':<34}{'ms/step':>9}{'extra MB':>10}{'|Δlog π_old| vs exact':>24}"
        )
        for name in STRATEGIES:
            overrides = ["trainer.mode=simulated_async", "trainer.lag=2", f"algorithm.proximal.name={name}",
                         "algorithm.proximal.measure_error=true", *args.overrides]  # fmt: skip
            try:
                rows = bench(overrides, args.steps, args.warmup)
            except Exception as err:  # report and go on with the other strategies
                print(f"{name:<34}failed: {type(err).__name__}: {err}")
                continue
            ms = 1000 * statistics.mean(r["proximal/seconds"] for r in rows)
            mb = rows[-1]["proximal/extra_bytes"] / 2**20
            errs = [r.get("proximal/error/logp_abs_err_mean") for r in rows]
            err = (
                statistics.mean(e for e in errs if e is not None)
                if any(e is not None for e in errs)
                else None
            )
            err_s = "n/a" if err is None else f"{err:.2e}"
            print(f"{name:<34}{ms:>9.1f}{mb:>10.2f}{err_s:>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
