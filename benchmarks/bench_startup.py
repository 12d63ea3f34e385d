"""Start-up of the ``rollcorr`` command: wall time of each ``--help`` against ``import torch`` alone.

Each command runs REPEATS times in a fresh interpreter (subprocess, the installed entry point's module), the
median kept; the ratio to ``python -c "import torch"`` measured in the same run says whether a command pays for
torch before it has anything to do. Help texts import nothing heavy: the apps' packages load their modules on
first use.

Then the end of a run (issue #38): the wall time of a short ``rollcorr train`` (``TRAIN``) in a fresh process with
``curves.png`` drawn in a background process (now), drawn in the run's own process before it exits (as before:
``start_plot`` patched to draw inline), and not drawn (``trainer.plot=false``), TRAIN_REPEATS of each interleaved,
medians and their ratio to the inline run. Before the next run starts, the background plotter of the last one is
waited for (untimed), so it takes no core from the next measurement.

    .venv/bin/python benchmarks/bench_startup.py > benchmarks/results/bench_startup.txt
    .venv/bin/python benchmarks/bench_startup.py --skip-train     # the --help table only
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

REPEATS = 5
COMMANDS = {
    "rollcorr --help": ["-m", "rollcorr", "--help"],
    "rollcorr train --help": ["-m", "rollcorr", "train", "--help"],
    "rollcorr audit --help": ["-m", "rollcorr", "audit", "--help"],
    "rollcorr analyze --help": ["-m", "rollcorr", "analyze", "--help"],
    "rollcorr gguf-to-hf --help": ["-m", "rollcorr", "gguf-to-hf", "--help"],
}
REFERENCE = ("python -c 'import torch'", ["-c", "import torch"])
TRAIN = ["train", "trainer.steps=2", "trainer.eval_every=0", "trainer.progress=false"]
TRAIN_REPEATS = 3
INLINE = ("import sys, rollcorr.train.plots as p; p.start_plot = p.write_curves; from rollcorr.cli import main; "
          "sys.exit(main(sys.argv[1:]))")  # the run's end as before #38: curves.png drawn before the process exits
RUN_END = {
    "curves.png drawn in the run's process (before)": (["-c", INLINE], []),
    "curves.png drawn by a background process (now)": (["-m", "rollcorr"], []),
    "no curves.png (trainer.plot=false)": (["-m", "rollcorr"], ["trainer.plot=false"]),
}


def wall(args: list[str]) -> float:
    """The median wall time of ``python <args>`` over REPEATS fresh interpreters, in seconds."""
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_end(folder: Path) -> dict[str, float]:
    """{variant: median wall seconds} of the RUN_END variants of TRAIN, interleaved, each in a fresh process."""
    from rollcorr.train.plots import wait_for_plot

    times: dict[str, list[float]] = {name: [] for name in RUN_END}
    for r in range(TRAIN_REPEATS):
        for name, (head, extra) in RUN_END.items():
            out = folder / f"run-{r}-{len(times[name])}-{list(RUN_END).index(name)}"
            start = time.perf_counter()
            subprocess.run([sys.executable, *head, TRAIN[0], "--out", str(out), *TRAIN[1:], *extra], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
            if "background" in name:  # let it finish before the next measurement (untimed)
                wait_for_plot(out, timeout_s=600)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-train", action="store_true", help="only the --help table")
    opts = parser.parse_args(argv)
    print(f"# bench_startup: {machine()}; load before {load()}; median wall time of {REPEATS} fresh interpreters")
    reference = wall(REFERENCE[1])
    print("command | seconds | / import torch")
    print(f"{REFERENCE[0]} | {reference:.2f} | 1.00")
    for name, args in COMMANDS.items():
        seconds = wall(args)
        print(f"{name} | {seconds:.2f} | {seconds / reference:.2f}")
    if not opts.skip_train:
        with tempfile.TemporaryDirectory(prefix="bench-startup-") as folder:
            ends = run_end(Path(folder))
        before = ends[next(iter(RUN_END))]
        print(f"# run end: median wall time of {TRAIN_REPEATS} fresh `rollcorr {' '.join(TRAIN)}` processes per "
              f"variant (built-in model), interleaved")
        print("run end | seconds | / drawn in the run's process")
        for name, seconds in ends.items():
            print(f"{name} | {seconds:.2f} | {seconds / before:.2f}")
    print(f"# load after {load()}")


if __name__ == "__main__":
    main()
