"""Throughput and peak memory of the full correction (weights + rejection + every metric + the one sync).

    .venv/bin/python benchmarks/bench_correction.py [--batch 256] [--length 8192] [--repeat 7]
        [--threads 1 2] [--presets NAME ...] [--dtype float32|bfloat16] [--impl MODULE] [--compile]
    .venv/bin/python benchmarks/bench_correction.py --against verl [--batch 256] [--length 8192] [--repeat 7]
    .venv/bin/python benchmarks/bench_correction.py --sweep [--repeat 5]

Per preset and thread count it prints the median over ``--repeat`` calls of: wall time and tokens/s (B·T
positions per second), CPU time of the process (all threads; user + system) and the system part of it,
minor page faults per call, and the peak resident memory of one extra, untimed call above the inputs
(Linux VmHWM after ``malloc_trim``, so memory glibc kept from earlier calls does not hide the peak).

On a shared machine wall time is noisy: compare CPU times, and report the load printed in the header.
System time is mostly first-touch page faults on fresh (B, T) buffers; how many happen depends on how much
freed memory glibc keeps between calls (``MALLOC_TRIM_THRESHOLD_`` changes it), hence the column.
``--impl`` benchmarks another module exposing ``compute_correction`` / ``metrics_to_floats`` (e.g. a copy of
an older version on PYTHONPATH).

``--against verl`` (verl installed) times ``compute_correction`` + ``metrics_to_floats``, the verl drop-in
``rollcorr.compat.verl.compute_rollout_correction_and_rejection_mask`` (verl's signature and numbers; fused
path) and verl's own ``rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` (both return Python
floats) on the same inputs, one thread, interleaved call by call, for token TIS, Seq-MIS (verl's sequence IS
+ seq_sum_k1 rejection) and token TIS + Geo-RS, and prints the median CPU time of each and the ratios
verl / rollcorr and verl / drop-in.

``--sweep`` prints how the correction's time grows with B (T fixed) and with T (B fixed), one thread.

``--floor`` compares ``compute_correction`` (+ ``metrics_to_floats``, the fused path) with its floor: a compiled
kernel that reads π_old, μ and the mask once and computes only what the weights and the rules need (ℓ_c, ρ, the
token weights for token IS, the per-row reductions the rules declare), per preset, one thread, interleaved call
by call; the ratio is rollcorr / floor CPU time. A second kernel adds the diagnostics' transcendental work (the
full floor). ``compute_correction(..., diagnostics=False)`` (the weights', the rules' and the counts' metrics
only) is timed against the rules floor too. It also prints the fixed cost of one call: the median CPU time of
``compute_correction`` (every metric) on a 2 × 8 batch (eager: under ``MIN_POSITIONS``), where the work itself
is nothing, over 100 calls back to back.

The first call of a batch of ≥ 256 K positions compiles the fused kernel (correction/fused.py): it is in the
warm-up call, never in the timed ones. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import math
import os
import resource
import statistics
import time
import warnings

import torch
from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

from rollcorr.config import preset

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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def _peak_mib(call) -> float:
    """Peak RSS growth of one call (MiB), or NaN where /proc or glibc's malloc_trim is unavailable."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return float("nan")
    base = _status_kib("VmRSS")
    call()
    return (_status_kib("VmHWM") - base) / 1024


def _inputs(b: int, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(b, t, generator=g) * 4 - 1e-3
    old = (rollout + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-4)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    return old.to(dtype), rollout.to(dtype), mask


# rollcorr preset → the same correction in verl's helper (verl 0.9.1 keyword arguments)
AGAINST_VERL = {
    "token TIS": ("decoupled_token_is", dict(rollout_is="token", rollout_is_threshold=2.0)),
    "Seq-MIS": (
        "decoupled_seq_is_rs",
        dict(
            rollout_is="sequence",
            rollout_is_threshold=2.0,
            rollout_rs="seq_sum_k1",
            rollout_rs_threshold="0.5_2.0",
        ),
    ),
    "token TIS + Geo-RS": (
        "decoupled_geo_rs_token_tis",
        dict(
            rollout_is="token",
            rollout_is_threshold=2.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="0.999_1.001",
        ),
    ),
}


def _cpu_ms(call) -> float:
    start = time.process_time()
    call()
    return (time.process_time() - start) * 1e3


def against_verl(shapes: list[tuple[int, int]], repeat: int) -> None:
    """The verl table: per shape and case, median CPU ms of rollcorr (fused from the first call), rollcorr
    eager, the drop-in and verl's helper, interleaved call by call, and verl's system CPU time (page faults of
    its fresh allocations: what ``MALLOC_MMAP_THRESHOLD_`` changes)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as helper

    from rollcorr.compat.verl import compute_rollout_correction_and_rejection_mask as drop_in
    from rollcorr.correction import compute_correction, fused, metrics_to_floats

    torch.set_num_threads(1)
    os.environ[fused.ENV] = "1"  # the fused kernel from the first call: this measures it, not the break-even rule
    allocator = ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")) or "glibc defaults"
    print(f"# bench_correction --against verl: {machine()}; load before {load()}")
    print(f"# float32, random lengths (about 5/8 of the positions valid), 1 thread, median CPU time of {repeat} "
          f"interleaved calls after a warm-up; allocator: {allocator}")  # fmt: skip
    print("shape | case | rollcorr fused ms | rollcorr eager ms | drop-in ms | verl ms | verl system ms | "
          "verl / fused | verl / eager | verl / drop-in")
    for b, t in shapes:
        inputs = _inputs(b, t, torch.float32)
        for label, (name, kwargs) in AGAINST_VERL.items():
            config = preset(name)

            def ours(config=config, inputs=inputs) -> None:
                metrics_to_floats(compute_correction(*inputs, config).metrics)

            def eager(ours=ours) -> None:  # rollcorr without the fused kernel
                os.environ[fused.ENV] = "0"
                try:
                    ours()
                finally:
                    os.environ[fused.ENV] = "1"

            def theirs(kwargs=kwargs, inputs=inputs) -> None:
                helper(*inputs, **kwargs)

            def ours_as_verl(kwargs=kwargs, inputs=inputs) -> None:  # verl's signature and numbers, rollcorr's kernels
                drop_in(*inputs, **kwargs)

            calls = (ours, eager, ours_as_verl, theirs)
            for call in calls:  # warm up (the first calls compile the fused kernel)
                call()
            times, system = [], []
            for _ in range(repeat):  # interleaved
                times.append(tuple(_cpu_ms(c) for c in calls[:3]))
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                times[-1] += (_cpu_ms(theirs),)
                system.append((resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime) * 1e3)
            a, e, d, v = (statistics.median(x) for x in zip(*times))
            print(f"{b} x {t} | {label} | {a:.1f} | {e:.1f} | {d:.1f} | {v:.1f} | {statistics.median(system):.1f} | "
                  f"{v / a:.2f} | {v / e:.2f} | {v / d:.2f}")  # fmt: skip
    print(f"# load after {load()}")


def floor_pass(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, bound: float,
    token_is: tuple[str, float | None, float | None] | None, reductions: tuple[str, ...], row_one: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """What the weights and the rules need, and nothing else: n, Σℓ_c (sequence / geometric weights), the
    rules' declared reductions, the (B, T) token weights and their row sums for token IS. One pass over the
    inputs when compiled. row_one: (rows, 1) ones. ``floor`` runs it through ``in_pieces``."""
    from rollcorr.correction.fused import _exp
    from rollcorr.correction.weights import apply_threshold

    mf = mask.to(old.dtype)
    lrs = (torch.where(mask, old, 0.0) - torch.where(mask, rollout, 0.0)).clamp(-bound, bound)
    k2 = lrs.square() * 0.5
    out = {"n": mf.sum(-1), "lr": lrs.sum(-1)}
    if "sum_k1" in reductions:
        out["sum_k1"] = -out["lr"]
    if "sum_k2" in reductions:
        out["sum_k2"] = k2.sum(-1)
    if "max_k2" in reductions:
        out["max_k2"] = torch.where(mask, k2, -math.inf).amax(-1)
    if token_is is not None or "max_k3" in reductions or "sum_k3" in reductions:
        rho = _exp(lrs)
        k3 = rho - 1.0 - lrs
        if "sum_k3" in reductions:
            out["sum_k3"] = k3.sum(-1)
        if "max_k3" in reductions:
            out["max_k3"] = torch.where(mask, k3, -math.inf).amax(-1)
        if token_is is not None:
            # the row loop writes w (one pass over the inputs, as fused.row_pass) when a reduction reads w (Σ w
            # per row: what batch normalisation and the IS mean read) and a (B, 1) operand keeps Inductor from
            # flattening w's loop (× row_one, exact); without both: 1.6× slower here
            w = apply_threshold(rho * mf, mf, *token_is) * row_one
            out["w"], out["w_sum"] = w, w.sum(-1)
    return out


def floor_pass_with_diagnostics(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, bound: float,
    token_is: tuple[str, float | None, float | None] | None, reductions: tuple[str, ...], row_one: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``floor_pass`` plus the diagnostics' transcendental work, each function once per position: the
    probabilities e^old and e^μ (probability mismatch), ρ and log1p(ρ) (k3, the JS divergence), one row sum per
    quantity — what every call of compute_correction reports, computed as cheaply as it can be."""
    from rollcorr.correction.fused import _exp

    out = floor_pass(old, rollout, mask, bound, token_is, reductions, row_one)
    mf = mask.to(old.dtype)
    lrs = (torch.where(mask, old, 0.0) - torch.where(mask, rollout, 0.0)).clamp(-bound, bound)
    rho = _exp(lrs)
    d = (_exp(torch.where(mask, old, 0.0)) - _exp(torch.where(mask, rollout, 0.0))).abs()
    out |= {"k3": (rho - 1.0 - lrs).sum(-1), "js": torch.log1p(rho).sum(-1), "d": d.sum(-1),
            "d_max": d.amax(-1), "rho2": (rho * rho * mf).sum(-1)}  # fmt: skip
    return out


def in_pieces(body):
    """``body`` (a floor kernel) on each row as ``fused.split_for(T)`` pieces, combined back to rows, as
    fused.row_pass reduces them: the floor uses every trick the correction uses."""
    from rollcorr.correction import fused

    def run(old, rollout, mask, bound, token_is, reductions, row_one):
        b, t = mask.shape
        k = fused.split_for(t)
        if k == 1:
            return body(old, rollout, mask, bound, token_is, reductions, row_one)
        pieces = (x.reshape(b * k, t // k) for x in (old, rollout, mask))
        out = body(*pieces, bound, token_is, reductions, row_one)
        return {key: fused._combine(key, v, b) for key, v in out.items()}

    return run


def floor(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, repeat: int) -> None:
    from rollcorr.correction import compute_correction, fused, metrics_to_floats
    from rollcorr.correction.rejection import rule_reductions

    torch.set_num_threads(1)
    b, t = mask.shape
    print(f"# bench_correction --floor: {machine()}; load before {load()}")
    print(f"# {b} x {t} float32 positions, 1 thread, median CPU time of {repeat} interleaved calls after a warm-up; "
          "fixed cost: 2 x 8 positions, median of 100 calls back to back")  # fmt: skip
    print("case | rollcorr ns/position | floor: rules ns/position | rollcorr / rules floor | "
          "floor: rules + diagnostics ns/position | rollcorr / full floor | "
          "rollcorr diagnostics=False ns/position | diagnostics=False / rules floor | fixed ms/call")
    tiny = _inputs(2, 8, torch.float32)
    row_one = torch.ones(b * fused.split_for(t), 1)  # (rows, 1) ones: see floor_pass
    kernel = torch.compile(in_pieces(floor_pass), dynamic=False, options=fused.COMPILE_OPTIONS)
    full_kernel = torch.compile(
        in_pieces(floor_pass_with_diagnostics), dynamic=False, options=fused.COMPILE_OPTIONS
    )
    for label, (name, _) in AGAINST_VERL.items():
        config = preset(name)
        token_is = (config.is_mode, config.is_upper, config.is_lower) if config.is_level == "token" else None
        reductions = tuple(sorted(rule_reductions(config) or ()))

        def ours(config=config) -> None:
            metrics_to_floats(compute_correction(old, rollout, mask, config).metrics)

        def rules_only(config=config) -> None:  # the option that skips the diagnostics
            metrics_to_floats(compute_correction(old, rollout, mask, config, diagnostics=False).metrics)

        def least(config=config, token_is=token_is, reductions=reductions, kernel=kernel) -> None:
            out = kernel(old, rollout, mask, float(config.safety_bound), token_is, reductions, row_one)
            # the one sync, as compute_correction's (of the (B,) reductions: the weights are not read again)
            torch.stack([v.sum() for v in out.values() if v.dim() == 1]).tolist()

        def full(config=config, token_is=token_is, reductions=reductions) -> None:
            least(config, token_is, reductions, full_kernel)

        def fixed(config=config) -> None:
            metrics_to_floats(compute_correction(*tiny, config).metrics)

        for call in (ours, least, full, rules_only, fixed):  # warm up (compiles the kernels)
            call()
        calls = (ours, least, full, rules_only)
        times = [tuple(_cpu_ms(c) for c in calls) for _ in range(repeat)]  # interleaved
        a, f, g, r = (statistics.median(x) for x in zip(*times))
        small = statistics.median(_cpu_ms(fixed) for _ in range(100))  # back to back, as a loop of small calls
        per = 1e6 / (b * t)
        print(f"{label} ({name}) | {a * per:.2f} | {f * per:.2f} | {a / f:.2f} | {g * per:.2f} | {a / g:.2f} | "
              f"{r * per:.2f} | {r / f:.2f} | {small:.2f}")  # fmt: skip
    print(f"# load after {load()}")


def sweep(presets: list[str], repeat: int) -> None:
    from rollcorr.correction import compute_correction, metrics_to_floats

    torch.set_num_threads(1)
    print(
        f"{'preset':28s} {'B':>5s} {'T':>6s} {'CPU ms':>8s} {'ns/position':>12s} {'M tok/s':>8s} {'load':>5s}"
    )
    shapes = [(b, 8192) for b in (16, 32, 64, 128, 256)] + [(256, t) for t in (512, 1024, 2048, 4096)]
    for name in presets:
        config = preset(name)
        for b, t in shapes:
            old, rollout, mask = _inputs(b, t, torch.float32)

            def call(old=old, rollout=rollout, mask=mask, config=config) -> None:
                metrics_to_floats(compute_correction(old, rollout, mask, config).metrics)

            call()
            ms = statistics.median(_cpu_ms(call) for _ in range(repeat))
            print(f"{name:28s} {b:5d} {t:6d} {ms:8.2f} {ms * 1e6 / (b * t):12.2f} {b * t / ms / 1e3:8.1f} "
                  f"{os.getloadavg()[0]:5.1f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--presets", nargs="*", default=PRESETS)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--impl", default="rollcorr.correction", help="module with compute_correction")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the correction (validate=False); compile time is reported separately",
    )
    ap.add_argument("--against", choices=["verl"], help="time against verl's helper, interleaved")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="BxT",
                    help="--against verl: the batch shapes (default: --batch x --length)")  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="time vs B and vs T (presets: --presets)")
    ap.add_argument("--floor", action="store_true", help="against a kernel computing only what the rules need")
    args = ap.parse_args()
    # the fused path from the first large call (unless the caller set ROLLCORR_FUSED, e.g. =0 for the eager path):
    # this benchmark measures the kernels, not the process-level break-even rule of correction/fused.py
    os.environ.setdefault("ROLLCORR_FUSED", "1")
    warnings.simplefilter("ignore")  # AllRejectedWarning: the Geo-RS window rejects these batches every call
    if args.against:  # its output is a results file: benchmarks/results/bench_correction_verl*.txt
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else None
        against_verl(shapes or [(args.batch, args.length)], args.repeat)
        return
    if args.floor:  # its output is a results file: benchmarks/results/bench_correction_floor.txt
        floor(*_inputs(args.batch, args.length, torch.float32), args.repeat)
        return
    if args.sweep:
        print(f"B×T = {args.batch}×{args.length}, float32, 1 thread, load avg {os.getloadavg()[0]:.1f}, "
              f"torch {torch.__version__}")  # fmt: skip
        sweep(args.presets if args.presets != PRESETS else ["disabled", "decoupled_token_is"], args.repeat)
        return
    impl = importlib.import_module(args.impl)
    b, t = args.batch, args.length
    old, rollout, mask = _inputs(b, t, getattr(torch, args.dtype))
    tokens = int(mask.sum())
    print(f"B×T = {b}×{t} ({tokens / 1e6:.2f} M valid tokens of {b * t / 1e6:.2f} M), {args.dtype}, "
          f"impl {args.impl}, load avg {os.getloadavg()[0]:.1f}, torch {torch.__version__}")  # fmt: skip
    print(f"{'preset':28s} {'thr':>3s} {'wall ms':>8s} {'M tok/s':>8s} {'CPU ms':>7s} {'sys ms':>7s} "
          f"{'faults':>7s} {'peak MiB':>9s}")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.presets:
            config = preset(name)
            run = functools.partial(impl.compute_correction, config=config)
            if args.compile:
                run = torch.compile(functools.partial(run, validate=False), dynamic=False)
            start = time.perf_counter()
            got = impl.metrics_to_floats(run(old, rollout, mask).metrics)  # warm up (and compile)
            if args.compile:
                eager = impl.metrics_to_floats(impl.compute_correction(old, rollout, mask, config).metrics)
                diff = max(abs(got[k] - v) / max(abs(v), 1e-12) for k, v in eager.items())
                print(f"{name}: compiled in {time.perf_counter() - start:.1f} s, "
                      f"max rel. metric diff vs eager {diff:.1e}")  # fmt: skip
            wall, cpu, sys_, faults = [], [], [], []
            for _ in range(args.repeat):
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                start, start_cpu = time.perf_counter(), time.process_time()
                impl.metrics_to_floats(run(old, rollout, mask).metrics)
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                sys_.append(r1.ru_stime - r0.ru_stime)
                faults.append(r1.ru_minflt - r0.ru_minflt)
            peak = _peak_mib(lambda run=run: impl.metrics_to_floats(run(old, rollout, mask).metrics))
            med = statistics.median(wall)
            print(
                f"{name:28s} {threads:3d} {med * 1e3:8.1f} {b * t / med / 1e6:8.1f} "
                f"{statistics.median(cpu) * 1e3:7.1f} {statistics.median(sys_) * 1e3:7.1f} "
                f"{statistics.median(faults):7.0f} {peak:9.0f}"
            )


if __name__ == "__main__":
    main()
