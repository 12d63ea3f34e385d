"""Step after step of a training run at verl-sized correction shapes: does any step stall?

    taskset -c 1 .venv/bin/python benchmarks/bench_correction_steps.py > benchmarks/results/bench_correction_steps.txt
    .venv/bin/python benchmarks/bench_correction_steps.py --steps 50 --batch 64 --length 2048

A whole ``rollcorr train`` at B × T = 256 × 8192 is far beyond a CPU's model, so this runs the part of each step
that the correction's shapes set, with the trainer's own functions and its default configuration
(``load_config(None)``: the correction preset, the loss, GRPO advantages): ``step.attach_correction`` (the
correction with every metric, and its floats), ``step.attach_advantages``, then the policy loss on the kept tokens
(``policy_loss`` with the correction's weights) and its backward pass into a (B, T) log-prob leaf, for
``--steps`` steps on fresh inputs (a few pre-drawn batches in turn; π_θ drifts a little from step to step), one
thread. Before #51 this loop's 95th step compiled the fused kernel (a 55 s stall at this shape); a step over
3× the median is the failure it looks for. The process's first step (imports, first allocations) runs before the
timed ones and is reported on its own. It prints the header (machine, load, command), the quantiles of the
per-step wall and CPU seconds, the steps over 3× the median, and the slowest steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)


def batches(b: int, t: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` synthetic rollouts' tensors: μ, π_old near it, π_θ near π_old, right-padded lengths, rewards."""
    out = []
    for seed in range(count):
        g = torch.Generator().manual_seed(seed)
        rollout = -torch.rand(b, t, generator=g) * 4 - 1e-3
        old = (rollout + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-4)
        theta = (old + 0.01 * torch.randn(b, t, generator=g)).clamp(max=-1e-5)
        mask = torch.arange(t)[None] < torch.randint(t // 4, t + 1, (b, 1), generator=g)
        rewards = (torch.rand(b, generator=g) < 0.5).float()
        out.append({"rollout": rollout, "old": old, "theta": theta, "mask": mask, "rewards": rewards})
    return out


def one_step(data: dict[str, torch.Tensor], algo, group_size: int) -> None:
    """The correction-and-loss part of a training step on one batch (module docstring)."""
    from rollcorr.losses import policy_loss
    from rollcorr.rollout import Rollout
    from rollcorr.train import step

    b, t = data["mask"].shape
    rollout = Rollout(
        prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.bool),
        response_ids=torch.zeros(b, t, dtype=torch.long), response_mask=data["mask"],
        rollout_log_prob=data["rollout"], version=torch.zeros(b, t, dtype=torch.long),
        group_ids=torch.arange(b) // group_size, old_log_prob=data["old"], rewards=data["rewards"],
    )
    rollout, _ = step.attach_correction(rollout, algo, data["theta"])
    rollout, _, _ = step.attach_advantages(rollout, algo)
    log_prob = data["theta"].clone().requires_grad_(True)
    loss, _ = policy_loss(algo.loss, log_prob, rollout.old_log_prob, rollout.advantages, rollout.kept_mask,
                          weights=rollout.is_weights, denominator_mask=rollout.response_mask)
    loss.backward()


def main(argv: list[str] | None = None) -> None:
    from rollcorr.train.build import build_step_config
    from rollcorr.train.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--distinct", type=int, default=4, help="pre-drawn batches, used in turn")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    config = load_config(None, [])
    algo = build_step_config(config)
    data = batches(args.batch, args.length, args.distinct)
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "?"
    command = " ".join(["python", "benchmarks/bench_correction_steps.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"# bench_correction_steps: {machine()}; load before {load()}; command: {command} (cores {cores})")
    from rollcorr.analyze.render import describe
    from rollcorr.correction import native

    capability = torch.backends.cpu.get_cpu_capability()
    kernel = f"the built {capability} kernel" if native.loaded() else f"no built kernel for {capability}: plain torch"
    print(f"# {args.steps} steps at B x T = {args.batch} x {args.length} (float32, about 5/8 valid), 1 thread; each: "
          f"attach_correction (the default config's correction: {describe(algo.correction)}; every metric), "
          f"attach_advantages ({algo.advantage}), the {algo.loss.name} loss and its backward; default environment "
          f"(ROLLCORR_FUSED unset; statistics: {kernel})")
    start, start_cpu = time.perf_counter(), time.process_time()
    one_step(data[-1], algo, config.rollout.group_size)  # a process's first step: imports, first allocations
    first = (time.perf_counter() - start, time.process_time() - start_cpu)
    wall, cpu = [], []
    for i in range(args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        one_step(data[i % len(data)], algo, config.rollout.group_size)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    print("seconds per step | median | p90 | p99 | max | max / median | steps over 3x median")
    for name, values in (("wall", wall), ("CPU", cpu)):
        median = statistics.median(values)
        q = statistics.quantiles(values, n=100, method="inclusive")
        over = sum(v > 3 * median for v in values)
        print(f"{name} | {median:.4f} | {q[89]:.4f} | {q[98]:.4f} | {max(values):.4f} | {max(values) / median:.2f} "
              f"| {over}")
    print(f"# the process's first step, before these (imports, first allocations): {first[0]:.3f} s wall, "
          f"{first[1]:.3f} s CPU")
    slowest = sorted(range(args.steps), key=lambda i: -cpu[i])[:5]
    print("# slowest steps by CPU time (step: wall s / CPU s): "
          + ", ".join(f"{i}: {wall[i]:.3f} / {cpu[i]:.3f}" for i in sorted(slowest)))
    print(f"# load after {load()}")


if __name__ == "__main__":
    main()
