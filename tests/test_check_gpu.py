"""scripts/check_gpu.py — the one GPU check — runs its checks on the CPU (`--device cpu`), as CI runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_check_gpu_passes_on_the_cpu(tmp_path):
    out = tmp_path / "check.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/check_gpu.py"), "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["check"] for line in lines] == ["machine", "audit", "amp-bf16", "amp-fp16", "exact", "distributed"]
    assert all(line["ok"] for line in lines)
    assert next(line for line in lines if line["check"] == "exact")["tokens_differing"] == 0
