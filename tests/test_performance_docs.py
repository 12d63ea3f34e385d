"""docs/performance.md's prose quotes its own tables."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_per_token_range_is_the_scaling_tables():
    text = (ROOT / "docs/performance.md").read_text()
    rows = []  # (responses, CPU ms / token) of the batch-size and group-size tables
    for header in ("| prompts per step | responses |", "| group size | responses |"):
        table = text[text.index(header) :].split("\n\n")[0].splitlines()[2:]
        rows += [(int(cells[2]), float(cells[6])) for cells in (re.split(r"\s*\|\s*", line) for line in table)]
    small = [ms for n, ms in rows if n <= 32]
    large = [ms for n, ms in rows if n >= 128]
    prose = " ".join(text.split())
    assert f"falls from {min(small):.2f}–{max(small):.2f} ms at 32 responses or fewer" in prose
    assert f"to {min(large):.2f}–{max(large):.2f} ms at 128–256" in prose
