"""The correction a user gets by default, against verl's helper and against reading the inputs once.

    taskset -c 1 .venv/bin/python benchmarks/bench_correction.py > benchmarks/results/bench_correction_verl.txt
    .venv/bin/python benchmarks/bench_correction.py --shapes 8x512 64x2048 --cases "token TIS" --rounds 20
    .venv/bin/python benchmarks/bench_correction.py --with-fused   # also the compiled kernel, warmed before

Per shape (float32 (B, T), random lengths: about 5/8 of the positions valid) and case (token TIS, Seq-MIS: verl's
sequence IS + seq_sum_k1 rejection, token TIS + Geo-RS), one thread, the default environment (no
``ROLLCORR_FUSED``, glibc's allocator as it comes), it times, interleaved round by round in a rotating order:

- rollcorr: ``compute_correction`` with every metric + ``metrics_to_floats`` (what a user gets by default: the
  statistics from the kernel scripts/setup.sh built, correction/native.py, where it serves);
- plain: the same call with the plain-torch statistics pass (what a machine without the built kernel gets);
- the verl drop-in: ``rollcorr.compat.verl.compute_rollout_correction_and_rejection_mask`` (verl's signature
  and numbers, floats out);
- verl: verl's own ``rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` (floats out);
- the read floor: one pass that reads every input byte once and computes nothing (a sum over each input's
  memory, the mask's bytes as int32 words): the least any implementation must spend;
- one exponential: ``torch.exp`` of the (B, T) log-probs into a buffer made before the timing (SLEEF's 1-ulp
  ``exp``, the function the kernel calls for ρ): what one exponential a position costs, reading and writing 8 bytes
  a position, fewer than the floor's 9;
- with ``--with-fused``: rollcorr with the fused kernel, compiled by ``fused.warm`` before the timing starts.

It prints the median CPU time (user + system, so page faults of fresh allocations count) of each, the ratios
verl / rollcorr, verl / drop-in, rollcorr / floor and exp / floor, the peak resident memory one extra call of rollcorr and
of verl adds above the inputs (Linux VmHWM after ``malloc_trim``; NaN elsewhere) and the tensor operations one call
of each dispatches (a dispatch hook's count, after the timing: what a small batch's fixed cost is made of). The header names the machine,
the load, the cores the process may run on and the command. Asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
import warnings

import torch
from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

from rollcorr.config import preset

SHAPES = ["8x512", "64x2048", "256x8192", "1024x16384"]
# rollcorr preset → the same correction in verl's helper (verl 0.9.1 keyword arguments)
AGAINST_VERL = {
    "token TIS": ("decoupled_token_is", dict(rollout_is="token", rollout_is_threshold=2.0)),
    "Seq-MIS": ("decoupled_seq_is_rs", dict(rollout_is="sequence", rollout_is_threshold=2.0,
                                            rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")),
    "token TIS + Geo-RS": ("decoupled_geo_rs_token_tis", dict(rollout_is="token", rollout_is_threshold=2.0,
                                                              rollout_rs="seq_mean_k1",
                                                              rollout_rs_threshold="0.999_1.001")),
}


def rounds_for(positions: int) -> int:
    """Interleaved rounds per shape: more where a call is short (a 2-core shared machine is noisy)."""
    return max(5, min(300, int(3e7 // positions)))


def inputs(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(b, t, generator=g) * 4 - 1e-3
    old = (rollout + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-4)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    return old, rollout, mask


def read_once(*tensors: torch.Tensor) -> None:
    """Read every byte of ``tensors`` once: a sum over each one's memory (float32 as floats; other dtypes as int32
    words where the size allows, else bytes)."""
    for x in tensors:
        if x.dtype == torch.float32:
            x.sum()
        elif x.numel() * x.element_size() % 4 == 0:
            x.view(torch.uint8).view(torch.int32).sum()
        else:
            x.view(torch.uint8).sum()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def peak_mib(call) -> float:
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


def operations(call) -> int:
    """The tensor operations one call dispatches (ATen calls, views included), counted with a dispatch hook."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        call()
    return count.n


def cpu_ms(call) -> float:
    start = time.process_time()
    call()
    return (time.process_time() - start) * 1e3


def calls_for(case: str, data: tuple, with_fused: bool) -> dict[str, object]:
    """The timed calls of one case on one batch, by column name."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as helper

    from rollcorr.compat.verl import compute_rollout_correction_and_rejection_mask as drop_in
    from rollcorr.correction import compute_correction, fused, metrics_to_floats

    name, kwargs = AGAINST_VERL[case]
    config = preset(name)
    exp_buffer = torch.empty_like(data[0])
    calls = {
        "rollcorr": lambda: metrics_to_floats(compute_correction(*data, config).metrics),
        "plain": lambda: metrics_to_floats(compute_correction(*data, config).metrics),
        "drop-in": lambda: drop_in(*data, **kwargs),
        "verl": lambda: helper(*data, **kwargs),
        "floor": lambda: read_once(*data),
        "exp": lambda: torch.exp(data[0], out=exp_buffer),
    }
    if with_fused:  # the same call once the kernel is warm (it serves batches of ≥ fused.MIN_POSITIONS)
        calls["fused"] = calls["rollcorr"] if data[2].numel() >= fused.MIN_POSITIONS else None
    return {k: v for k, v in calls.items() if v is not None}


def measure(case: str, data: tuple, rounds: int, with_fused: bool) -> dict[str, float]:
    """Median CPU ms per column, interleaved round by round in a rotating order, after one warm-up call each."""
    from rollcorr.correction import fused, native

    calls = calls_for(case, data, with_fused)
    warm, built = set(fused._state["warm"]), native.loaded()
    fused._state["warm"] = set()  # rollcorr's default: no compiled kernel (the fused column turns it back on)

    def timed(column: str) -> float:
        fused._state["warm"] = warm if column == "fused" else set()
        native._state["loaded"] = built and column != "plain"
        return cpu_ms(calls[column])

    columns = list(calls)
    for column in columns:
        timed(column)
    times: dict[str, list[float]] = {c: [] for c in columns}
    for i in range(rounds):
        for column in columns[i % len(columns):] + columns[: i % len(columns)]:
            times[column].append(timed(column))
    fused._state["warm"], native._state["loaded"] = set(), built
    out = {c: statistics.median(v) for c, v in times.items()}
    out["rollcorr peak MiB"] = peak_mib(calls["rollcorr"])
    out["verl peak MiB"] = peak_mib(calls["verl"])
    out["rollcorr ops"], out["verl ops"] = operations(calls["rollcorr"]), operations(calls["verl"])
    fused._state["warm"] = warm
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, metavar="BxT")
    ap.add_argument("--cases", nargs="+", default=list(AGAINST_VERL), choices=list(AGAINST_VERL))
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per shape (default: by size)")
    ap.add_argument("--with-fused", action="store_true", help="also the fused kernel, compiled before the timing")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # AllRejectedWarning: the Geo-RS window rejects these batches every call
    torch.set_num_threads(1)
    if args.with_fused:
        from rollcorr.correction import fused

        for case in args.cases:
            fused.warm(preset(AGAINST_VERL[case][0]))
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "?"
    command = " ".join(["python", "benchmarks/bench_correction.py", *(argv if argv is not None else sys.argv[1:])])
    from rollcorr.correction import native

    capability = torch.backends.cpu.get_cpu_capability()
    kernel = f"the built {capability} kernel" if native.loaded() else f"no built kernel for {capability}: plain torch"
    print(f"# bench_correction: {machine()}; load before {load()}; command: {command} (cores {cores})")
    print("# float32, random lengths (about 5/8 of the positions valid), 1 thread, median CPU time of interleaved "
          "rounds after a warm-up; default environment: ROLLCORR_FUSED unset, glibc's allocator defaults; "
          f"rollcorr = compute_correction with every metric + metrics_to_floats ({kernel}); plain = the same with "
          "the plain-torch statistics pass; floor = one read of the inputs (9 bytes a position); exp = torch.exp of "
          "the (B, T) log-probs into a buffer (one exponential a position, SLEEF's)")
    columns = ["rollcorr", "plain", "drop-in", "verl"] + (["fused"] if args.with_fused else [])
    print(" | ".join(["shape", "case", *(f"{c} ms" for c in columns), "floor ms", "exp ms", "verl / rollcorr",
                      "verl / plain", "verl / drop-in", *(["verl / fused"] if args.with_fused else []),
                      "rollcorr / floor", "exp / floor",
                      "rollcorr peak MiB", "verl peak MiB", "rollcorr ops", "verl ops", "rounds"]))
    for shape in args.shapes:
        b, t = (int(x) for x in shape.split("x"))
        data = inputs(b, t)
        rounds = args.rounds or rounds_for(b * t)
        for case in args.cases:
            m = measure(case, data, rounds, args.with_fused)
            fused_cells = []
            if args.with_fused:
                fused_ms = m.get("fused", float("nan"))
                fused_cells = [f"{fused_ms:.2f}"]
            ratios = [m["verl"] / m["rollcorr"], m["verl"] / m["plain"], m["verl"] / m["drop-in"]]
            if args.with_fused:
                ratios.append(m["verl"] / m["fused"] if "fused" in m else float("nan"))
            cells = [f"{b} x {t}", case, *(f"{m[c]:.2f}" for c in ("rollcorr", "plain", "drop-in", "verl")),
                     *fused_cells,
                     f"{m['floor']:.3f}", f"{m['exp']:.3f}", *(f"{r:.2f}" for r in ratios),
                     f"{m['rollcorr'] / m['floor']:.1f}", f"{m['exp'] / m['floor']:.1f}",
                     f"{m['rollcorr peak MiB']:.0f}", f"{m['verl peak MiB']:.0f}", str(m["rollcorr ops"]),
                     str(m["verl ops"]), str(rounds)]
            print(" | ".join(cells), flush=True)
    print(f"# load after {load()}")


if __name__ == "__main__":
    main()
