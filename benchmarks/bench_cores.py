"""How much of a second core this machine really gives: the parallel ceiling of async training.

    python benchmarks/bench_cores.py            # 3 rounds of 4 s

Runs one fixed single-thread torch workload of the learner's scale (a 0.5 M-parameter chain of matmuls, forward
and backward, on 64 × 70 rows) in one process, then in two processes at once, and prints the work per second of
two against one. On two truly independent cores the ratio is 2.0; vCPUs that share a physical core, its
caches or memory bandwidth give less. Async training overlaps the sampler (one process) with the learner
(another), so its speed-up over sync can at best approach min(this ratio, the step's overlap bound printed by
bench_train.py). Rounds alternate (one, two, one, …) so a change in the machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def work(seconds: float, queue) -> None:
    """Matmul forward + backward: 64 × 70 rows of width 128 through 8 layers (128 ↔ 512), 1 thread."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = [(128, 512), (512, 128)] * 4
    layers = [(torch.randn(*shape) * 0.05).requires_grad_() for shape in shapes]
    x = torch.randn(64 * 70, 128)
    done, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        h = x
        for w in layers:
            h = torch.tanh(h @ w)
        h.square().mean().backward()
        done += 1
    queue.put(done / seconds)


def rate(processes: int, seconds: float) -> float:
    """Total iterations per second of ``processes`` concurrent copies of ``work``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=work, args=(seconds, queue)) for _ in range(processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"bench_cores: a worker failed (exit codes {[p.exitcode for p in procs]})")
    return sum(queue.get() for _ in procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="length of each timed run")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print("# load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    one, two = [], []
    for _ in range(args.rounds):
        one.append(rate(1, args.seconds))
        two.append(rate(2, args.seconds))
    r1, r2 = statistics.median(one), statistics.median(two)
    print(f"cpus visible: {os.cpu_count()}")
    print(f"one process : {r1:8.1f} it/s   rounds {' '.join(f'{v:.1f}' for v in one)}")
    print(f"two at once : {r2:8.1f} it/s   rounds {' '.join(f'{v:.1f}' for v in two)}")
    print(f"ratio       : {r2 / r1:8.2f}x   (2.00 = two independent cores)")
    print("# load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
