"""The machine line every benchmark's output starts with: figures differ up to 2× between AVX2 and AVX512
machines of the same core count, so no figure travels without it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """'<CPU model> (<torch's CPU capability>), <n> cores'."""
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
               platform.processor())
    return f"{cpu} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores"


def load() -> str:
    """The 1-, 5- and 15-minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
