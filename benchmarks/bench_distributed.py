"""The data-parallel learner on this machine: steps/s of the default run at N = 1 and N = 2 ranks (replicated
and sharded), of ``train_step`` alone, and the memory each rank holds.

    python benchmarks/bench_distributed.py > benchmarks/results/bench_distributed.txt
    python benchmarks/bench_distributed.py --runs 1 --run-steps 20 --skip-memory       # quicker

The default run: ``rollcorr train`` with the default config (no plot, no progress bar) for ``--run-steps``
steps at N = 1, N = 1 on half the batch (one rank's share, no communication: the most N = 2 could reach), N = 2
replicated (``trainer.data_parallel=replicate``: whole model per rank, one gradient all-reduce per optimizer
step, every rank sampling its share of each batch), the same with its collectives over gloo's sockets instead of
shared memory (``ROLLCORR_HOST_MEMORY=0``) and N = 2 sharded (FSDP2, rank 0 sampling), ``--runs`` of each
interleaved, each a fresh command; per run the median of ``time/step_s`` (the
step from asking for the batch to publishing the new weights; evaluations are outside it) over the steps after
the first three; the steps/s ratio to N = 1 (asked: ≥ 1.3 at N = 2).

``train_step`` alone: the real ``train_step`` (recompute π_old, decoupled token TIS, GRPO, 2 mini-batches) on
the built-in model and the default batch (16 prompts × 8 responses), on fixed rollouts sampled once, one thread
per rank; the first step is a warm-up, the median of the rest is reported, wall and CPU seconds (on a loaded
machine the wall time is mostly waiting for a core). Publishing cost: the seconds to gather the full weights on
rank 0 (``ShardedLearner.state_dict``; a replicated learner holds them). The ``interrupt`` strategy's stall at
N = 2 sharded: scoring one batch that every rank holds, split over the ranks and gathered
(``proximal.scoring.score_split``) against every rank scoring every row, the median of three calls each.

Memory: a wider Qwen2 built from the built-in config (``--hidden``, ``--layers``; random weights, the built-in
tokenizer), built as the trainer builds it (ranks > 0 as skeletons that receive rank 0's weights), one step,
then the bytes of parameters and optimizer state this rank holds and the process's peak RSS (``VmHWM``) after
building and after the step, and the ratio of the peak per rank at N = 2 to N = 1 for each layout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

from rollcorr.distributed.ranks import ONE_PROCESS

OVERRIDES = ["task.eval_prompts=0", "algorithm.correction.preset=decoupled_token_is"]


def _config():
    from rollcorr.train.config import load_config

    return load_config(None, OVERRIDES)


def _learner(wide: dict | None, skeleton: bool = False):
    """The built-in fp32 learner, or the wide model; ``skeleton``: built on the meta device, as the trainer
    builds it on ranks > 0 (their shards come from rank 0)."""
    from rollcorr.engines import make_learner

    learner = make_learner("hf:fp32", skeleton=skeleton)
    if wide:
        from transformers import AutoModelForCausalLM

        from rollcorr.models.builtin import builtin_config

        torch.manual_seed(0)
        with torch.device("meta" if skeleton else "cpu"):
            learner.model = AutoModelForCausalLM.from_config(builtin_config(len(learner.tokenizer), **wide))
    learner.model.train(False)
    learner.share_prompts = False  # the path the sharded learner scores through (distributed/shard.py)
    return learner


def measure(rollouts, steps: int, wide: dict | None, ranks=ONE_PROCESS, layout: str = "shard") -> dict:
    from rollcorr.distributed.shard import peak_parameter_bytes
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.step import train_step

    config = _config()
    step_config, proximal = build_step_config(config), build_proximal(config)
    learner = ranks.shard(_learner(wide, skeleton=not ranks.is_main), layout)  # one process: whole
    built_rss = _peak_rss_bytes()  # the peak of building (and sharding) the learner, before any step
    optimizer = torch.optim.AdamW([p for p in learner.model.parameters() if p.requires_grad], lr=1e-4)
    seconds, cpu = [], []
    for i in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        train_step(rollouts[i % len(rollouts)], learner, optimizer, proximal, step_config, i, ranks=ranks)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    stall = _stall(learner, rollouts[0]) if ranks.world > 1 and wide is None else {}
    start, start_cpu = time.perf_counter(), time.process_time()
    learner.state_dict()  # the weights a publish sends (sharded: gathered on rank 0)
    gather, gather_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    held = peak_parameter_bytes(learner.model, optimizer)
    return {
        "step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
        "step_cpu_s": statistics.median(cpu[1:]) if len(cpu) > 1 else cpu[0],
        "publish_gather_s": gather,
        "publish_gather_cpu_s": gather_cpu,
        "parameters_bytes": held["parameters"],
        "optimizer_bytes": held["optimizer_state"],
        "peak_rss_bytes": _peak_rss_bytes(),
        "built_peak_rss_bytes": built_rss,
        "parameters": sum(p.numel() for p in _learner(wide).model.parameters()) if ranks.world == 1 else None,
        **stall,
    }


def _peak_rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` of /proc/self/status (Linux; its own address space's high
    water mark). ``getrusage``'s ``ru_maxrss`` is not used where that exists: Linux carries it over fork and
    exec, so a spawned rank would report its parent's peak whenever that is higher."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _stall(learner, rollout) -> dict[str, float]:
    """CPU seconds of this rank for scoring ``rollout`` (held alike by every rank) split over the ranks and
    gathered, and for scoring every row on every rank; the median of three calls each (all ranks call both)."""
    from rollcorr.proximal.scoring import score, score_split

    out = {}
    for name, scorer in (("stall_split_cpu_s", score_split), ("stall_every_row_cpu_s", score)):
        cpu = []
        for _ in range(3):
            start_cpu = time.process_time()
            scorer(learner, rollout)
            cpu.append(time.process_time() - start_cpu)
        out[name] = statistics.median(cpu)
    return out


def _worker(rank: int, world: int, port: int, data: str, steps: int, wide: dict | None, out: str,
            layout: str = "shard") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world == 1:  # today's one-process path: no process group
        torch.save(measure(torch.load(data, weights_only=False), steps, wide), f"{out}.{rank}")
        return
    from rollcorr.distributed import close, init_from_env

    ranks = init_from_env("cpu")
    try:
        result = measure(torch.load(data, weights_only=False), steps, wide, ranks, layout)
        torch.save(result, f"{out}.{rank}")
    finally:
        close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, rollouts, steps: int, wide: dict | None, layout: str = "shard") -> list[dict]:
    """One dict per rank, each rank a fresh process (N = 1 too, without a process group: the memory figures
    are then each process's own)."""
    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "rollouts.pt"), os.path.join(tmp, "result")
        torch.save(rollouts, data)
        mp.spawn(_worker, args=(world, _free_port(), data, steps, wide, out, layout), nprocs=world, join=True)
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def default_run(world: int, layout: str, steps: int, out: str, overrides=(), env=None) -> dict:
    """``rollcorr train`` with the default config (the built-in model and task; no plot, no progress bar) at
    ``world`` ranks, in fresh processes (``overrides`` and ``env`` added): the median of ``time/step_s`` (next
    batch, π_old, correction, optimizer steps, publish; the evaluations are outside it) over the steps after the
    first three, and the wall time of the whole command."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "rollcorr", "train", f"trainer.steps={steps}", "trainer.plot=false",
            "trainer.progress=false", *overrides]
    if world > 1:
        args += [f"trainer.ranks={world}", f"trainer.data_parallel={layout}"]
    args += ["--out", out]
    start = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "time/step_s" in r][3:]
    return {"wall_s": wall, **{f"{part}_s": statistics.median(r[f"time/{part}_s"] for r in steps) for part in PARTS}}


PARTS = ("step", "generate", "old_log_prob", "correction", "optimize", "loss_forward", "backward", "optimizer")


# name: (ranks, layout, overrides, environment). "N=1, half the batch" is one rank's work at N = 2 with no
# communication (8 of the 16 prompts): the most N = 2 could reach. "over gloo" keeps the trainer's collectives
# on gloo's sockets instead of the shared memory of ranks on one host (distributed/host_memory.py).
DEFAULT_RUN_CASES = {
    "N=1": (1, "replicate", (), {}),
    "N=1, half the batch": (1, "replicate", ("rollout.prompts_per_step=8",), {}),
    "N=2 replicate": (2, "replicate", (), {}),
    "N=2 replicate over gloo": (2, "replicate", (), {"ROLLCORR_HOST_MEMORY": "0"}),
    "N=2 shard": (2, "shard", (), {}),
}


def default_runs(steps: int, repeats: int) -> dict[str, list[dict]]:
    """``default_run`` for each of ``DEFAULT_RUN_CASES``, ``repeats`` times, interleaved."""
    found: dict[str, list[dict]] = {name: [] for name in DEFAULT_RUN_CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for index, (name, (world, layout, overrides, env)) in enumerate(DEFAULT_RUN_CASES.items()):
                out = os.path.join(tmp, f"{repeat}-{index}")
                found[name].append(default_run(world, layout, steps, out, overrides, env))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="train_step calls per case (the first is a warm-up)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--run-steps", type=int, default=40, help="steps of each default run")
    parser.add_argument("--runs", type=int, default=5, help="default runs per case, interleaved")
    parser.add_argument("--wide-steps", type=int, default=3, help="train_step calls on the wide model per case")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-runs", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rollcorr.train.source import SourceSpec, sample_batch

    print(f"# bench_distributed: {machine()}; load before {load()}", flush=True)
    results: dict = {"load_average_start": os.getloadavg()[0]}
    if not args.skip_runs:
        runs = default_runs(args.run_steps, args.runs)
        results["default_runs"] = runs
        print(f"## the default run (rollcorr train, {args.run_steps} steps; median time/step_s over steps 4+ of each "
              f"run, median of {args.runs} interleaved runs per case)")
        base = statistics.median(r["step_s"] for r in runs["N=1"])
        for name, found in runs.items():
            step = statistics.median(r["step_s"] for r in found)
            wall = statistics.median(r["wall_s"] for r in found)
            print(f"default run, {name}: {1 / step:.2f} steps/s ({step * 1e3:.0f} ms/step), command wall {wall:.1f} s; "
                  f"steps/s ratio to N=1 {base / step:.2f} (asked at N=2: >= 1.3)", flush=True)
        print("where a step's time goes, rank 0, ms (median over steps and runs): case | "
              + " | ".join(PARTS[1:]) + " | optimize's rest (collectives, waits, metrics)")
        for name, found in runs.items():
            ms = {part: 1e3 * statistics.median(r[f"{part}_s"] for r in found) for part in PARTS}
            rest = ms["optimize"] - ms["loss_forward"] - ms["backward"] - ms["optimizer"]
            print(f"parts, {name} | " + " | ".join(f"{ms[part]:.0f}" for part in PARTS[1:]) + f" | {rest:.0f}")
    source = SourceSpec.from_config(_config()).build()
    rollouts = [sample_batch(source, i) for i in range(3)]
    print(f"## train_step alone ({args.steps - 1} timed calls after a warm-up, fixed rollouts, 1 thread per rank)")
    cases = [(1, "replicate"), (2, "replicate"), (2, "shard")]
    for world, layout in cases:
        per_rank = run(world, rollouts, args.steps, None, layout)
        results[f"speed_N{world}_{layout}"] = per_rank
        cpu = max(r["step_cpu_s"] for r in per_rank)
        name = "N=1" if world == 1 else f"N={world} {layout}"
        print(f"builtin model, {name}: {1 / per_rank[0]['step_s']:.3f} steps/s wall ({per_rank[0]['step_s']:.2f} s/step), "
              f"CPU s/step per rank {cpu:.2f} (max over ranks); full-weight gather "
              f"{per_rank[0]['publish_gather_s'] * 1e3:.0f} ms wall, {per_rank[0]['publish_gather_cpu_s'] * 1e3:.0f} ms CPU",
              flush=True)
        if world > 1 and layout == "shard":
            split, every = (max(r[k] for r in per_rank) for k in ("stall_split_cpu_s", "stall_every_row_cpu_s"))
            print(f"interrupt's stall, N={world}, {rollouts[0].batch_size} in-flight rows: CPU s per rank (max over ranks) "
                  f"split over the ranks {split:.3f}, every rank scoring every row {every:.3f}; ratio {split / every:.2f}",
                  flush=True)
    if not args.skip_memory:
        wide = {
            "hidden_size": args.hidden,
            "intermediate_size": 4 * args.hidden,
            "num_hidden_layers": args.layers,
        }
        print(f"## a wide model ({args.hidden}x{args.layers}): memory per rank, and {args.wide_steps} train_step "
              "calls (the median after the first)")
        peaks, seconds = {}, {}
        for world, layout in cases:
            per_rank = run(world, rollouts, args.wide_steps, wide, layout)
            results[f"memory_N{world}_{layout}"] = per_rank
            name = "N=1" if world == 1 else f"N={world} {layout}"
            peaks[name] = max(m["peak_rss_bytes"] for m in per_rank)
            seconds[name] = per_rank[0]["step_s"]
            for r, m in enumerate(per_rank):
                print(f"wide model, {name} rank {r}: parameters {m['parameters_bytes'] / 2**20:.1f} MiB + AdamW state "
                      f"{m['optimizer_bytes'] / 2**20:.1f} MiB; peak RSS after building "
                      f"{m['built_peak_rss_bytes'] / 2**20:.0f} MiB, after a step {m['peak_rss_bytes'] / 2**20:.0f} MiB; "
                      f"full-weight gather {m['publish_gather_s'] * 1e3:.0f} ms", flush=True)
        for name in ("N=2 replicate", "N=2 shard"):
            print(f"wide model, {name}: peak RSS per rank (max over ranks) / N=1's {peaks[name] / peaks['N=1']:.2f}; "
                  f"train_step {seconds[name]:.2f} s against N=1's {seconds['N=1']:.2f} s, steps/s ratio "
                  f"{seconds['N=1'] / seconds[name]:.2f}")
    results["load_average_end"] = os.getloadavg()[0]
    print(f"# load after {load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
