"""``rollcorr audit --from-log`` chunk by chunk: a dump too large to hold padded gets the same summary as the
whole-dump audit (to float rounding), its figures from a part of it, and a one-long-row dump no longer asks for
rows × longest-row memory."""

from __future__ import annotations

import json
import math

import pytest

from rollcorr.audit import dump_audit as fl
from rollcorr.audit.collect import from_log
from rollcorr.audit.report import build_summary
from rollcorr.cli import main
from test_analyze_chunked import _ragged  # tests/ is on sys.path (pytest rootdir)


def _close(a, b, path=""):
    """Nested summaries equal: numbers to 1e-9 relative, everything else exactly."""
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-15), path
    else:
        assert a == b, path


@pytest.mark.parametrize("positions", [64, 5000])
def test_chunk_summed_summary_equals_the_whole_audit(tmp_path, positions, monkeypatch):
    path = _ragged(tmp_path / "ragged.jsonl", rows=60)
    want = build_summary(from_log(path), worst_k=10)
    monkeypatch.setattr(fl, "FIGURE_ROWS", 7)
    log = fl.audit_log(path, positions=positions, whole_positions=0)  # force the chunk-summed audit
    assert log.data is None
    got = log.write(tmp_path / "r")
    source = got["source"]
    assert " of 60 responses" in source.pop("figures")
    got = {k: v for k, v in got.items() if k != "files"}
    _close(want, got)
    assert (tmp_path / "r" / "report.html").stat().st_size > 10_000
    assert " of 60 responses (the response with the largest" in (tmp_path / "r" / "report.html").read_text()


def test_a_small_dump_is_audited_whole(tmp_path):
    path = _ragged(tmp_path / "ragged.jsonl", rows=20)
    log = fl.audit_log(path)
    assert log.data is not None and log.summary is None
    _close(build_summary(from_log(path)), build_summary(log.data))


def test_many_short_rows_are_audited_in_chunks(tmp_path):
    """Rows count, not only padded positions: 10⁵ one-token rows fit the whole path's positions but cost ~17 KB
    a response there (1.9 GB); past ``WHOLE_ROWS`` responses the dump is read in chunks."""
    rows = fl.WHOLE_ROWS + 1
    path = tmp_path / "short.jsonl"
    line = json.dumps({"rollout_log_probs": [math.log(0.5)], "old_log_probs": [math.log(0.52)]}) + "\n"
    path.write_text(line * rows)
    assert rows * 1 <= fl.WHOLE_POSITIONS
    log = fl.audit_log(path)
    assert log.data is None and log.summary is not None
    assert log.summary["n_responses"] == rows and log.summary["probability"]["prob_diff_max"] == pytest.approx(0.02)


def test_one_long_row_among_short_ones(tmp_path, monkeypatch, capsys):
    """5000 one-token rows and one 20000-token row: padded whole that is 10^8 positions; read in chunks it is
    the rows' own size, through the command line."""
    monkeypatch.setattr(fl, "WHOLE_POSITIONS", 1 << 16)
    rows = [{"rollout_log_probs": [math.log(0.5)], "old_log_probs": [math.log(0.52)]} for _ in range(5000)]
    rows.insert(99, {"rollout_log_probs": [math.log(0.3)] * 20000, "old_log_probs": [math.log(0.33)] * 20000})
    path = tmp_path / "path.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["audit", "--from-log", str(path), "--out", str(tmp_path / "r")]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["n_responses"] == 5001 and summary["n_tokens"] == 25000
    assert summary["per_response"]["length"]["max"] == 20000.0
    assert summary["probability"]["prob_diff_max"] == pytest.approx(0.03)
    assert summary["worst_tokens"][0]["row"] == 99 and summary["worst_tokens"][0]["position"] == 0
    assert summary["position"]["end"][-1] == 20000
    assert "report:" in capsys.readouterr().out
