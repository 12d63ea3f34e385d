"""The audit report on synthetic data: PNGs, self-contained HTML, summary.json, token context."""

import html
import json
import re

import matplotlib.image
import pytest
import torch

from rollcorr.audit import AuditData, audit_stats, write_report
from rollcorr.audit.report import token_context

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _data(b=6, t=10, seed=0) -> AuditData:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    log_mu = -torch.rand(b, t, generator=g) * 2
    log_old = (log_mu + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0)
    tokens = [[f"<{i}.{j}>" for j in range(int(n))] for i, n in enumerate(lengths)]
    return AuditData(
        log_mu, log_old, mask, tokens=tokens, prompts=[f"Q{i}:" for i in range(b)], source={"k": "v"}
    )


def _no_nan(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))


def test_write_report_files(tmp_path):
    data = _data()
    summary = write_report(data, tmp_path / "out", worst_k=4)
    out = tmp_path / "out"
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["histogram.png", "per_response.png", "position.png", "scatter.png"]
    for png in pngs:
        raw = png.read_bytes()
        assert raw.startswith(PNG_MAGIC) and len(raw) > 5000
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    assert not list(out.glob(".*")), "temporary files left behind"

    on_disk = _no_nan((out / "summary.json").read_text())
    expected = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask, worst_k=4)
    assert on_disk["probability"] == pytest.approx(expected["probability"])
    assert on_disk["divergence"] == pytest.approx(expected["divergence"])
    assert on_disk["source"] == {"k": "v"}
    assert len(on_disk["worst_tokens"]) == 4
    assert on_disk == json.loads(json.dumps(summary))


def test_html_is_self_contained(tmp_path):
    write_report(_data(), tmp_path)
    page = (tmp_path / "report.html").read_text()
    sources = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]*)""", page)
    assert len(sources) == 4 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert "<style>" in page and "share ≥ 0.01" in page
    summary = json.loads((tmp_path / "summary.json").read_text())
    worst = summary["worst_tokens"][0]
    assert f"<span class='tok'>{html.escape(worst['token'])}</span>" in page  # token text is escaped


def test_token_context_shows_prompt_tail_and_neighbours():
    data = _data()
    row = 0
    n = len(data.tokens[row])
    ctx = token_context(data, row, 1, window=3)
    assert ctx["token"] == "<0.1>"
    assert ctx["before"].endswith("│<0.0>") and "Q0:" in ctx["before"]
    assert ctx["after"] == "".join(data.tokens[row][2:5])
    last = token_context(data, row, n - 1, window=3)
    assert last["after"] == "" and last["token"] == f"<0.{n - 1}>"
    blind = AuditData(data.rollout_log_prob, data.old_log_prob, data.response_mask)
    assert token_context(blind, 0, 0) == {"before": "", "token": "", "after": ""}


def test_whitespace_tokens_are_visible():
    data = _data()
    data.tokens[0][0] = "\n"
    assert token_context(data, 0, 0)["token"] == "⏎"


def test_report_refuses_bad_data_without_writing(tmp_path):
    data = _data()
    data.old_log_prob[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        write_report(data, tmp_path / "bad")
    assert not (tmp_path / "bad" / "summary.json").exists()
