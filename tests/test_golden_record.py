"""Behaviour unchanged: the default training run (60 steps, seed 0) logs the metrics recorded in
tests/data/golden_default_60.json, to float tolerance (rel 1e-4; timings excluded).

Sampled tokens depend on the CPU kernels torch picks, so the comparison runs only on the capability the record
was written under (``torch.backends.cpu.get_cpu_capability()``, stored in the record) and is skipped elsewhere.
Regenerate the record with ``python scripts/golden_record.py`` only for an intended change of behaviour.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("golden_record", ROOT / "scripts" / "golden_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_finds_a_changed_metric_and_accepts_a_renamed_one():
    golden = _script()
    record = {"steps": [{"step": 1, "reward/mean": 0.5, "a/old": 2.0, "a/twin": 2.0, "time/step_s": 1.0}]}
    same = {"steps": [{"step": 1, "reward/mean": 0.5 * (1 + 1e-6), "a/new": 2.0, "time/step_s": 9.0}]}
    renamed = {"a/old": "a/new", "a/twin": "a/new"}
    assert golden.compare(record, same, renamed) == []
    changed = {"steps": [{"step": 1, "reward/mean": 0.51, "a/new": 2.0}]}
    assert any("reward/mean" in line for line in golden.compare(record, changed, renamed))
    assert any("a/old missing" in line for line in golden.compare(record, same))
    extra = {"steps": [{**same["steps"][0], "b/added": 1.0}]}
    assert any("b/added new" in line for line in golden.compare(record, extra, renamed))
    assert golden.compare(record, extra, renamed, added=frozenset({"b/added"})) == []


@pytest.mark.slow
def test_default_run_matches_the_golden_record():
    golden = _script()
    record = json.loads(golden.RECORD.read_text())
    capability = torch.backends.cpu.get_cpu_capability()
    if record["cpu_capability"] != capability:
        pytest.skip(
            f"the record was written with {record['cpu_capability']} kernels, this run uses {capability}"
        )
    problems = golden.compare(record, golden.record_run(), golden.RENAMED, added=golden.ADDED)
    assert not problems, "\n".join(problems[:30])
