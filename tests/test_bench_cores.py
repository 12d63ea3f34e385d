"""benchmarks/bench_cores.py runs and prints the two-against-one ratio (a smoke test: the figure itself is a
benchmark's, never asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_cores_prints_the_ratio():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cores.py"), "--seconds", "0.3", "--rounds", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    one = float(re.search(r"one process :\s+([\d.]+) it/s", out).group(1))
    two = float(re.search(r"two at once :\s+([\d.]+) it/s", out).group(1))
    ratio = float(re.search(r"ratio\s+:\s+([\d.]+)x", out).group(1))
    assert one > 0 and two > 0 and ratio == pytest.approx(two / one, rel=0.05)  # printed rates are rounded
