"""Start-up of the ``rollcorr`` command: wall time of each ``--help`` against ``import torch`` alone.

Each command runs REPEATS times in a fresh interpreter (subprocess, the installed entry point's module), the
median kept; the ratio to ``python -c "import torch"`` measured in the same run says whether a command pays for
torch before it has anything to do. Help texts import nothing heavy: the apps' packages load their modules on
first use.

    .venv/bin/python benchmarks/bench_startup.py > benchmarks/results/bench_startup.txt
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

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


def wall(args: list[str]) -> float:
    """The median wall time of ``python <args>`` over REPEATS fresh interpreters, in seconds."""
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    print(f"# bench_startup: {machine()}; load before {load()}; median wall time of {REPEATS} fresh interpreters")
    reference = wall(REFERENCE[1])
    print("command | seconds | / import torch")
    print(f"{REFERENCE[0]} | {reference:.2f} | 1.00")
    for name, args in COMMANDS.items():
        seconds = wall(args)
        print(f"{name} | {seconds:.2f} | {seconds / reference:.2f}")
    print(f"# load after {load()}")


if __name__ == "__main__":
    main()
