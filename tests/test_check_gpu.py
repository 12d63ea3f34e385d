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
    header, *rest = out.read_text().splitlines()
    assert header.startswith("# check_gpu: ") and "device cpu" in header and "load before" in header
    assert "command: python scripts/check_gpu.py --device cpu" in header
    lines = [json.loads(line) for line in rest]
    assert [line["check"] for line in lines] == ["machine", "correction", "audit", "amp-bf16", "amp-fp16", "exact",
                                                 "distributed"]
    assert all(line["ok"] for line in lines)
    by_check = {line["check"]: line for line in lines}
    assert by_check["exact"]["tokens_differing"] == 0
    # the timings a GPU run leaves: the correction per shape and preset, a train step, the audit
    ms = by_check["correction"]["ms_per_call"]
    assert len(ms) == 6 and all(v > 0 for v in ms.values()) and "64x2048 decoupled_token_is" in ms
    assert by_check["correction"]["max_relative_difference_vs_float64_cpu"] < 1e-3
    for amp in ("amp-bf16", "amp-fp16"):
        assert len(by_check[amp]["step_seconds"]) == 3 and by_check[amp]["step_seconds_median"] > 0
    assert by_check["audit"]["audit_seconds"] > 0 and by_check["audit"]["tokens"] > 0
