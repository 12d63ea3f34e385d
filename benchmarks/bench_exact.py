"""The cost of the bitwise-exact pair: hf:exact against hf:fp32 on the built-in model, one run.

    python benchmarks/bench_exact.py            # → benchmarks/results/bench_exact.txt
    python benchmarks/bench_exact.py --out -    # printed only

Sampling (tokens/s of the decode), scoring (tokens/s of the learner's forward over prompt + response, no
gradient) and training (s/step of `rollcorr train` with the pair as sampler and learner, against the same
command with hf:fp32 for both), one torch thread, in this process; the ratios are exact / fp32 of the same
run. The machine (CPU, load before and after) heads the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

ROOT = Path(__file__).resolve().parents[1]






def rates(spec: str, prompts, params, repeats: int) -> tuple[float, float]:
    from rollcorr.engines import make_learner, make_sampler

    sampler, learner = make_sampler(spec), make_learner(spec)
    sample, score = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout = sampler.generate(prompts, params, n=4)
        sample.append(int(rollout.response_mask.sum()) / (time.perf_counter() - start))
        start = time.perf_counter()
        learner.log_prob(rollout)
        positions = int(rollout.prompt_mask.sum() + rollout.response_mask.sum())
        score.append(positions / (time.perf_counter() - start))
    return statistics.median(sample), statistics.median(score)


def step_seconds(spec: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "rollcorr", "train", f"model.sampler={spec}", f"model.learner={spec}",
                        f"trainer.steps={steps + 1}", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                        "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
                        f"trainer.out={tmp}/run"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        return statistics.median([r["time/step_s"] for r in records if "time/step_s" in r][1:])


def main(argv: list[str] | None = None) -> int:
    from rollcorr.audit.collect import builtin_prompts
    from rollcorr.engines import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after one warm-up step)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_exact.txt"), help="- for stdout only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompts, params = builtin_prompts(16), SamplingParams(max_new_tokens=8, seed=0)
    lines = [f"# bench_exact: {machine()}; load before {load()}",
             "# built-in model; sampling and scoring: 16 prompts x 4 responses of <= 8 tokens, median of "
             f"{args.repeats}; training: the default config, median of {args.steps} steps after 1 warm-up"]
    measured = {spec: (*rates(spec, prompts, params, args.repeats), step_seconds(spec, args.steps))
                for spec in ("hf:fp32", "hf:exact")}
    lines.append("measure | hf:fp32 | hf:exact | exact / fp32")
    for i, name in enumerate(("sampling, response tokens/s", "scoring, positions/s", "training, s/step")):
        fp32, ex = measured["hf:fp32"][i], measured["hf:exact"][i]
        lines.append(f"{name} | {fp32:.4g} | {ex:.4g} | {ex / fp32:.3g}")
    lines.append(f"# load after {load()}")
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
