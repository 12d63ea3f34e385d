"""Training throughput per execution mode, where a step's time goes, and the cost of each π_old strategy.

    python benchmarks/bench_train.py                       # 12 steps per run, default batch (16 × 8)
    python benchmarks/bench_train.py --steps 20 --repeats 3 --skip-strategies
    python benchmarks/bench_train.py --skip-strategies rollout.prompts_per_step=8   # overrides for every run
    python benchmarks/bench_train.py --skip-strategies --config chain               # the long-response preset
    python benchmarks/bench_train.py --memory --config instruct model.path=... task.name=...   # memory only

Part 1 — modes: ``sync``, ``simulated_async`` (lag 2) and ``async`` (max_staleness 2, queue 2; and with partial
rollouts; the sampler in its own process) on the built-in model and task with the default config
(``--config chain``: the long-response preset, 70-token answers, where generation is a larger share of a
step). The modes run in turn (``--repeats`` rounds, so a change in the machine's load hits every mode alike);
per mode the median over rounds of samples/s (responses trained / Σ ``time/step_s`` of the timed steps) and
its ratio to ``sync`` in the same run, then where a step's time goes: the means of ``time/wait_s`` (the learner waits for
its batch), ``time/old_log_prob_s`` (π_old), ``time/correction_s`` (IS weights, rejection, advantages),
``time/optimize_s``, ``time/publish_s`` (weights to the sampler and the π_old strategy), the rest of
``time/step_s`` (logging, metrics), and ``time/generate_s`` (the sampler's time on the batch; in ``async`` it
overlaps the learner's steps, so it is not part of the step). The first ``--warmup`` steps are excluded (the
initial evaluation, the sampler process start-up).

Part 2 — π_old strategies in ``simulated_async`` (lag 2, so π_old ≠ π_train(v_gen) for most tokens): the
strategy's own time per step (``proximal/seconds``, mean), the extra memory it holds (``proximal/extra_bytes``,
last step) and, with ``measure_error=true``, the mean |log π_old − log π_train(v_gen)| against the exact old
logits (``proximal/error/logp_abs_err_mean``; 0 for exact strategies).

Part 3 — memory (``--memory``, alone): one whole run per variant (the learner as configured, the same without
gradient checkpointing, and with LoRA r = 8 on the attention projections), each in a fresh process
(``benchmarks/memory_probe.py``): its peak resident set (``ru_maxrss``: exact for its run, yet not the same from
one run to the next) and where it sat, what each part of the trainer holds at the end (each
tensor storage counted once), and the final checkpoint's files against the weights plus AdamW's two moments of
the trainable ones. The probe turns checkpoints off until the end, so the run writes exactly one.

Every run uses ``trainer.threads`` (default 1) torch threads in each process; no evaluation, checkpoint or plot
during the timed steps. The machine is shared: numbers vary with its load; the command line and the load
average (before, after) are printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

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


def bench(overrides: list[str], steps: int, warmup: int, preset: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            preset,
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
    samples = config.rollout.prompts_per_step * config.rollout.group_size  # responses trained per step
    return [{**r, "samples": samples} for r in rows if "time/step_s" in r][warmup:]


PARTS = ("time/wait_s", "time/old_log_prob_s", "time/correction_s", "time/optimize_s", "time/publish_s")


def summarize(rows: list[dict]) -> dict[str, float]:
    """samples/s, s/step, lag and the mean of each part of a step over the timed steps of one run."""
    seconds = sum(r["time/step_s"] for r in rows)
    out = {
        "samples/s": sum(r["samples"] for r in rows) / seconds,
        "tokens/s": sum(r["response/tokens"] for r in rows) / seconds,
        "s/step": seconds / len(rows),
        "lag mean": statistics.mean(r["staleness/lag_mean"] for r in rows),
        "lag max": max(r["staleness/lag_max"] for r in rows),
        "generate": statistics.mean(r["time/generate_s"] for r in rows),
    }
    for key in PARTS:
        out[key] = statistics.mean(r[key] for r in rows)
    out["other"] = out["s/step"] - sum(out[key] for key in PARTS)
    return out


def modes_table(overrides: list[str], steps: int, warmup: int, repeats: int, preset: str | None) -> None:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in MODES}
    for _ in range(repeats):
        for name, mode in MODES.items():
            runs[name].append(summarize(bench([*mode, *overrides], steps, warmup, preset)))
    median = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    base = median["sync"]["samples/s"]
    print(f"\n{'mode':<24}{'samples/s':>10}{'vs sync':>9}{'tokens/s':>10}{'s/step':>8}{'lag mean':>10}{'lag max':>9}"
          f"   (median of {repeats} round{'s' * (repeats > 1)}; [samples/s in each round])")
    for name, m in median.items():
        rounds = " ".join(f"{r['samples/s']:.0f}" for r in runs[name])
        print(f"{name:<24}{m['samples/s']:>10.0f}{m['samples/s'] / base:>8.2f}x{m['tokens/s']:>10.0f}"
              f"{m['s/step']:>8.3f}{m['lag mean']:>10.2f}{m['lag max']:>9.0f}   [{rounds}]")
    print(f"\n{'seconds per step (mean)':<24}{'wait':>7}{'π_old':>7}{'correct':>8}{'optimize':>9}{'publish':>8}"
          f"{'other':>7}{'= step':>8}{'generate':>10}")
    for name, m in median.items():
        print(f"{name:<24}{m['time/wait_s']:>7.3f}{m['time/old_log_prob_s']:>7.3f}{m['time/correction_s']:>8.3f}"
              f"{m['time/optimize_s']:>9.3f}{m['time/publish_s']:>8.3f}{m['other']:>7.3f}{m['s/step']:>8.3f}"
              f"{m['generate']:>10.3f}")
    sync = median["sync"]
    print(f"overlap bound: sync s/step ÷ its learner time (s/step − wait) = {sync['s/step']:.3f} / "
          f"{sync['s/step'] - sync['time/wait_s']:.3f} = {sync['s/step'] / (sync['s/step'] - sync['time/wait_s']):.2f}x "
          "(async cannot beat it: the learner's own work is not overlapped)")


MEMORY_VARIANTS = {
    "learner as configured": [],
    "without gradient checkpointing": ["model.gradient_checkpointing=false"],
    "LoRA r=8 (q, k, v, o)": ["model.lora.r=8", "model.lora.alpha=16"],
}
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_probe.py")
GB = 1e9


def probe(preset: str | None, overrides: list[str]) -> dict:
    """One run in a fresh process (its peak resident set is its own): memory_probe.py's JSON line."""
    import subprocess

    argv = [sys.executable, PROBE, *(["--config", preset] if preset else []), *overrides]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"memory_probe.py failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_table(overrides: list[str], preset: str | None) -> None:
    """Per variant: peak RSS and where, the parts held at the end, the checkpoint against weights + AdamW."""
    for name, variant in MEMORY_VARIANTS.items():
        m = probe(preset, [*overrides, *variant])
        adamw = 2 * m["trainable"]  # exp_avg and exp_avg_sq, float32 like the trainable weights
        ckpt = sum(m["checkpoint"].values())
        print(f"\n## {name}: {m['steps']} steps, accuracy {m['accuracy']}")
        print(f"peak RSS {m['peak_rss'] / GB:.2f} GB (libraries imported: {m['libraries'] / GB:.2f} GB); "
              f"sampled peak {m['sampled_peak'] / GB:.2f} GB at: {m['where'] or '?'}")
        print("held at the end: " + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in m["held"].items()))
        print(f"weights {m['weights'] / GB:.3f} GB, trainable {m['trainable'] / GB:.4f} GB, AdamW moments "
              f"{adamw / GB:.4f} GB")
        files = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in m["checkpoint"].items())
        base = m["weights"] + adamw if m["trainable"] == m["weights"] else m["trainable"] + adamw
        print(f"checkpoint {ckpt / 1e6:.1f} MB ({files}) = {ckpt / base:.2f}x "
              f"({'weights + AdamW' if m['trainable'] == m['weights'] else 'adapters + their AdamW'})")
        cpu = m["learner_cpu_s"]
        print(f"learner CPU s/step (median) {statistics.median(cpu):.2f}; run CPU {m['run_cpu_s']:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the modes (medians are reported)")
    p.add_argument(
        "--config", default=None, help="a preset of src/rollcorr/train/configs (default: default.yaml)"
    )
    p.add_argument("--skip-modes", action="store_true")
    p.add_argument("--skip-strategies", action="store_true")
    p.add_argument("--memory", action="store_true", help="part 3 only: memory per variant (one whole run each)")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # model loads and checkpoint writes would flood the table
    print(f"# {' '.join(sys.argv)}")
    print(f"# machine: {machine()}")
    print("# load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.memory:
        memory_table(args.overrides, args.config)
        print(f"# load average after: {load()}")
        return 0

    if not args.skip_modes:
        modes_table(args.overrides, args.steps, args.warmup, args.repeats, args.config)

    if not args.skip_strategies:
        print(
            f"\n{'π_old strategy (sim-async lag 2)':<34}{'ms/step':>9}{'extra MiB':>10}{'|Δlog π_old| vs exact':>24}"
        )
        for name in STRATEGIES:
            overrides = ["trainer.mode=simulated_async", "trainer.lag=2", f"algorithm.proximal.name={name}",
                         "algorithm.proximal.measure_error=true", *args.overrides]
            try:
                rows = bench(overrides, args.steps, args.warmup, args.config)
            except Exception as err:  # report and go on with the other strategies
                print(f"{name:<34}failed: {type(err).__name__}: {err}")
                continue
            ms = 1000 * statistics.mean(r["proximal/seconds"] for r in rows)
            mib = rows[-1]["proximal/extra_bytes"] / 2**20
            errs = [r.get("proximal/error/logp_abs_err_mean") for r in rows]
            err = (
                statistics.mean(e for e in errs if e is not None)
                if any(e is not None for e in errs)
                else None
            )
            err_s = "n/a" if err is None else f"{err:.2e}"
            print(f"{name:<34}{ms:>9.1f}{mib:>10.2f}{err_s:>24}")
    print("# load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
