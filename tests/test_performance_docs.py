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


def test_the_floor_paragraph_follows_from_the_committed_output():
    """docs/performance.md's reading of benchmarks/results/bench_correction_floor.txt (the table itself is a
    generated block, checked by tests/test_results_docs.py)."""
    lines = (ROOT / "benchmarks/results/bench_correction_floor.txt").read_text().splitlines()
    rows = [[c.strip() for c in line.split("|")] for line in lines if not line.startswith("#")][1:]
    by_case = {cells[0]: [float(c) for c in cells[1:]] for cells in rows}
    assert len(by_case) == 3
    for case, (_, _, to_rules, _, to_full, fixed) in by_case.items():
        assert to_full <= 2.0, case  # "within 2× for every preset" of the full floor
        assert (to_rules <= 2.0) == ("token TIS" in case), case  # "only the token-IS presets are"
        assert 0.5 <= fixed <= 1.5, case  # "about 1 ms"
    prose = " ".join((ROOT / "docs/performance.md").read_text().split())
    assert "Against the full floor the correction is within 2× for every preset" in prose
    assert "The fixed cost of a call — the metrics' many small tensor operations — is about 1 ms." in prose
