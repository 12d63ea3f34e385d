"""The data-parallel learner on this machine: train steps/s at N = 1 and N = 2 ranks, and the bytes each rank
holds for parameters + AdamW state (FSDP2 shards: ≈ 1/N per rank).

    python benchmarks/bench_distributed.py                     # builtin model, 6 timed steps; wide model, 1 step
    python benchmarks/bench_distributed.py --steps 3 --skip-memory

Speed: the real ``train_step`` (recompute π_old, decoupled token TIS, GRPO, 2 mini-batches) on the built-in
model and the default batch (16 prompts × 8 responses), on fixed rollouts sampled once; N = 1 is today's
one-process path, N = 2 two gloo processes (torch.multiprocessing) with the model sharded by FSDP2. The first
step is a warm-up; the median of the rest is reported. Memory: a wider Qwen2 built from the built-in config
(``--hidden``, ``--layers``; random weights, the built-in tokenizer), one step, then the local shards' bytes of
parameters and optimizer state per rank, and the process's peak RSS after building the learner and after the
step. Ranks > 0 build the model on the meta
device and get their shards from rank 0, as the trainer does (``distributed.shard.load_from_rank0``). Publishing cost: the seconds to gather the
full weights on rank 0 (``ShardedLearner.state_dict``), once per publish in a run. The ``interrupt``
strategy's stall at N ≥ 2: scoring one batch (16 × 8 rows) that every rank holds, split over the ranks and
gathered (``proximal.scoring.score_split``, what the strategy does) against every rank scoring every row (what
it did before), the median of three calls each. Wall and CPU seconds are both printed: on a loaded machine the
wall time is mostly waiting for a core.
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


def measure(rollouts, steps: int, wide: dict | None, ranks=ONE_PROCESS) -> dict:
    from rollcorr.distributed.shard import peak_parameter_bytes
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.step import train_step

    config = _config()
    step_config, proximal = build_step_config(config), build_proximal(config)
    learner = ranks.shard(_learner(wide, skeleton=not ranks.is_main))  # one process: unsharded
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


def _worker(rank: int, world: int, port: int, data: str, steps: int, wide: dict | None, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    if world == 1:  # today's one-process path: no process group
        torch.save(measure(torch.load(data, weights_only=False), steps, wide), f"{out}.{rank}")
        return
    from rollcorr.distributed import close, init_from_env

    ranks = init_from_env("cpu")
    try:
        result = measure(torch.load(data, weights_only=False), steps, wide, ranks)
        torch.save(result, f"{out}.{rank}")
    finally:
        close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, rollouts, steps: int, wide: dict | None) -> list[dict]:
    """One dict per rank, each rank a fresh process (N = 1 too, without a process group: the memory figures
    are then each process's own)."""
    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "rollouts.pt"), os.path.join(tmp, "result")
        torch.save(rollouts, data)
        mp.spawn(_worker, args=(world, _free_port(), data, steps, wide, out), nprocs=world, join=True)
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="train steps per N (the first is a warm-up)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rollcorr.train.source import SourceSpec, sample_batch

    source = SourceSpec.from_config(_config()).build()
    rollouts = [sample_batch(source, i) for i in range(3)]
    results: dict = {"load_average_start": os.getloadavg()[0]}
    for world in args.ranks:
        per_rank = run(world, rollouts, args.steps, None)
        results[f"speed_N{world}"] = per_rank
        cpu = max(r["step_cpu_s"] for r in per_rank)
        print(f"builtin model, N={world}: {1 / per_rank[0]['step_s']:.3f} steps/s wall ({per_rank[0]['step_s']:.2f} s/step), "
              f"CPU s/step per rank {cpu:.2f} (max over ranks); full-weight gather "
              f"{per_rank[0]['publish_gather_s'] * 1e3:.0f} ms wall, {per_rank[0]['publish_gather_cpu_s'] * 1e3:.0f} ms CPU",
              flush=True)  # fmt: skip
        if world > 1:
            split, every = (max(r[k] for r in per_rank) for k in ("stall_split_cpu_s", "stall_every_row_cpu_s"))
            print(f"interrupt's stall, N={world}, {rollouts[0].batch_size} in-flight rows: CPU s per rank (max over ranks) "
                  f"split over the ranks {split:.3f}, every rank scoring every row {every:.3f}; ratio {split / every:.2f}",
                  flush=True)  # fmt: skip
    if not args.skip_memory:
        wide = {
            "hidden_size": args.hidden,
            "intermediate_size": 4 * args.hidden,
            "num_hidden_layers": args.layers,
        }
        for world in args.ranks:
            per_rank = run(world, rollouts, 1, wide)
            results[f"memory_N{world}"] = per_rank
            for r, m in enumerate(per_rank):
                print(f"wide model ({args.hidden}×{args.layers}), N={world} rank {r}: parameters "
                      f"{m['parameters_bytes'] / 2**20:.1f} MiB + AdamW state {m['optimizer_bytes'] / 2**20:.1f} MiB; "
                      f"peak RSS after building {m['built_peak_rss_bytes'] / 2**20:.0f} MiB, after a step "
                      f"{m['peak_rss_bytes'] / 2**20:.0f} MiB; full-weight gather {m['publish_gather_s'] * 1e3:.0f} ms",
                      flush=True)  # fmt: skip
    results["load_average_end"] = os.getloadavg()[0]
    print(
        f"load average (1 min): {results['load_average_start']:.1f} at start, {results['load_average_end']:.1f} at end"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
