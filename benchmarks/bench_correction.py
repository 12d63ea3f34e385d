"""Throughput and peak memory of the full correction (weights + rejection + every metric + the one sync).

    .venv/bin/python benchmarks/bench_correction.py [--batch 256] [--length 8192] [--repeat 5] [--threads 2]
                                                    [--presets NAME ...] [--compile]

Prints, per preset, the median wall time, tokens/s (B·T positions per second), the median CPU time of the
process (all threads) and the peak resident memory above the inputs (Linux VmHWM, reset through
/proc/self/clear_refs). Prints numbers; asserts nothing. The machine may be shared:
report the load next to the numbers.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch

from rollcorr.config import preset
from rollcorr.correction import compute_correction, metrics_to_floats

PRESETS = [
    "disabled",  # metrics only
    "decoupled_token_is",
    "decoupled_token_icepop",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs_token_tis",
    "decoupled_k3_rs_seq_tis",
    "trm_max_k2_mean_k3",
    "slime_veto",
]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--presets", nargs="*", default=PRESETS)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the correction (validate=False); compile time is reported separately",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, t = args.batch, args.length
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(b, t, generator=g) * 4 - 1e-3
    old = (rollout + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-4)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    tokens = int(mask.sum())
    print(f"B×T = {b}×{t} ({tokens / 1e6:.2f} M valid tokens of {b * t / 1e6:.2f} M), float32, "
          f"{torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.1f}, torch {torch.__version__}")  # fmt: skip
    print(f"{'preset':28s} {'median ms':>10s} {'M tok/s (B*T)':>14s} {'CPU ms':>8s} {'peak MiB':>9s}")
    for name in args.presets:
        config = preset(name)
        run = functools.partial(compute_correction, config=config)
        if args.compile:
            run = torch.compile(functools.partial(run, validate=False), dynamic=False)
        start = time.perf_counter()
        got = metrics_to_floats(run(old, rollout, mask).metrics)  # warm up (and compile)
        if args.compile:
            eager = metrics_to_floats(compute_correction(old, rollout, mask, config).metrics)
            diff = max(abs(got[k] - v) / max(abs(v), 1e-12) for k, v in eager.items())
            print(
                f"{name}: compiled in {time.perf_counter() - start:.1f} s, max rel. metric diff vs eager {diff:.1e}"
            )
        times, cpu = [], []
        peak = -1.0
        for _ in range(args.repeat):
            base = _rss_kib("VmRSS")
            has_peak = _reset_peak()
            start, start_cpu = time.perf_counter(), time.process_time()
            res = run(old, rollout, mask)
            metrics_to_floats(res.metrics)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            if has_peak:
                peak = max(peak, (_rss_kib("VmHWM") - base) / 1024)
            del res
        med = statistics.median(times)
        cpu_ms = statistics.median(cpu) * 1e3
        print(f"{name:28s} {med * 1e3:10.1f} {b * t / med / 1e6:14.1f} {cpu_ms:8.0f} {peak:9.0f}")


if __name__ == "__main__":
    main()
