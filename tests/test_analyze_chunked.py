"""``rollcorr analyze`` chunk by chunk: the same analysis as the whole dump at once (and as ``compute_correction``
on the whole batch), the reader's column-wise checks, streams, and the small report fixes."""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import random
import threading

import numpy as np
import pytest
import torch

from rollcorr import dumps
from rollcorr.analyze.analysis import analyze, analyze_chunks, analyze_reader, iter_chunks
from rollcorr.analyze.cli import sample_dump_path
from rollcorr.chunked import quantiles
from rollcorr.cli import main
from rollcorr.config import CorrectionConfig
from rollcorr.config.presets import PRESETS, preset
from rollcorr.correction import compute_correction, metrics_to_floats
from rollcorr.dumps import open_dump, read_dump

EXTRA = {
    "token_k1": CorrectionConfig(rs=("token_k1",), rs_thresholds=("0.97_1.03",), is_level="token", is_upper=2.0),
    "seq_sum_k1": CorrectionConfig(rs=("seq_sum_k1",), rs_thresholds=("0.5_2.0",)),
    "seq_max_k2+token_k3": CorrectionConfig(rs=("seq_max_k2", "token_k3"), rs_thresholds=(0.002, 0.001)),
    "binary_kl": CorrectionConfig(rs=("token_binary_kl", "seq_mean_binary_kl"), rs_thresholds=(0.01, 0.002)),
    "veto_both": CorrectionConfig(veto_threshold=0.9, veto_upper=1.1, is_level="sequence", is_upper=2.0),
    "trm": CorrectionConfig(trm_max_k2=0.001, trm_mean_k3=0.0002),
    "token_bn": CorrectionConfig(is_level="token", is_upper=1.05, batch_normalize=True),
    "seq_bn": CorrectionConfig(is_level="sequence", is_upper=1.2, batch_normalize=True),
    "geo_mask": CorrectionConfig(is_level="geometric", is_mode="mask", is_upper=1.002, is_lower=0.998),
    "verl_geo": preset("decoupled_geo_rs").replace(verl_compat=True, rs_thresholds=("0.995_1.005",)),
    "verl_token": CorrectionConfig(rs=("token_k1",), rs_thresholds=("0.9_1.2",), is_level="token", is_upper=2.0,
                                   verl_compat=True),
}
CONFIGS = {**{name: preset(name) for name in sorted(PRESETS)}, **EXTRA}


def _ragged(path, rows: int = 90, seed: int = 0, long_row: int = 700):
    """A dump of rows of 1 … 180 tokens (one of ``long_row``), right-padded lists with mask 0 on some, token texts,
    ids, advantages, weight versions and a few planted outliers; two malformed lines."""
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        n = long_row if i == 17 else rng.randint(1, 180)
        pad = rng.choice([0, 0, 3])
        old = [math.log(rng.uniform(0.02, 0.999)) for _ in range(n)]
        roll = [min(0.0, x + rng.gauss(0, 0.01)) for x in old]
        if i % 11 == 3:
            roll[rng.randrange(n)] -= 1.5  # a token ρ ≈ e^1.5: token rules, IcePop, the veto ceiling catch it
        if i % 13 == 5:
            old[0] = roll[0] - 3.0  # ρ ≈ 0.05 on the first token: the veto floor catches it
        if i % 7 == 0:
            old[-1] = roll[-1]  # exact agreement: ties at |ℓ| = 0
        row = {
            "rollout_log_probs": roll + [0.0] * pad,
            "old_log_probs": old + [float("nan")] * pad,
            "response_mask": [1] * n + [0] * pad,
            "advantages": (-1.0) ** i,
            "responses": [rng.randrange(500) for _ in range(n + pad)],
            "token_text": [f"t{j % 10}" for j in range(n + pad)],
            "response_text": f"row {i} " + "x" * (i % 40),
            "version": [i % 4] * (n + pad),
            "prompt": f"{i}+1=",
        }
        lines.append(json.dumps(row))
    lines.insert(5, '{"rollout_log_probs": [-0.1], "old_log_probs": [')
    lines.insert(40, json.dumps({"rollout_log_probs": [-0.1, 0.5], "old_log_probs": [-0.1, -0.2]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def ragged_path(tmp_path_factory):
    return _ragged(tmp_path_factory.mktemp("ragged") / "ragged.jsonl")


def _same(a, b, *, rtol: float = 1e-12) -> None:
    """Two analyses of the same rows agree: per-token values, counts, maxima, positions and texts exactly; sums
    and per-row sums to ``rtol`` (their summation order follows the chunk's padded width)."""
    assert list(a.metrics) == list(b.metrics)
    for key, value in a.metrics.items():
        assert b.metrics[key] == pytest.approx(value, rel=rtol, abs=1e-13), key
    assert (a.responses, a.tokens, a.rejected_tokens, a.rejected_sequences) == (
        b.responses, b.tokens, b.rejected_tokens, b.rejected_sequences)
    assert a.notes == b.notes
    assert len(a.findings) == len(b.findings)
    for fa, fb in zip(a.findings, b.findings):
        assert (fa.row, fa.line, fa.rule, fa.level, fa.position, fa.token, fa.tokens, fa.effect, fa.threshold) == (
            fb.row, fb.line, fb.rule, fb.level, fb.position, fb.token, fb.tokens, fb.effect, fb.threshold)
        if fa.level == "token":
            assert fa.value == fb.value and fa.excess == fb.excess
        else:
            assert fb.value == pytest.approx(fa.value, rel=rtol) and fb.excess == pytest.approx(fa.excess, rel=rtol)
    assert [(r.rule, r.level, r.sequences, r.tokens, r.threshold) for r in a.rules] == [
        (r.rule, r.level, r.sequences, r.tokens, r.threshold) for r in b.rules]
    for ra, rb in zip(a.rules, b.rules):
        if ra.level == "token":
            assert ra.observed == rb.observed
        else:
            assert rb.observed == pytest.approx(ra.observed, rel=rtol)
    assert (a.weights is None) == (b.weights is None)
    if a.weights is not None:
        assert b.weights == pytest.approx(a.weights, rel=rtol)
    assert [(t.line, t.position, t.token_text, t.token_id, t.rollout_log_prob, t.learner_log_prob)
            for t in a.top_tokens] == [(t.line, t.position, t.token_text, t.token_id, t.rollout_log_prob,
                                        t.learner_log_prob) for t in b.top_tokens]
    for ta, tb in zip(a.top_tokens, b.top_tokens):
        if ta.fate.startswith("kept, w = "):
            assert tb.fate.startswith("kept, w = ")
        else:
            assert ta.fate == tb.fate


@pytest.mark.parametrize("positions", [1, 9, 10**9])
def test_chunked_equals_whole_on_the_sample(positions):
    """The shipped sample's rows (≤ 5 tokens) are summed alike at any padded width: everything matches exactly."""
    dump = read_dump(sample_dump_path())
    for name, config in CONFIGS.items():
        whole = analyze(dump, config, name)
        chunked = analyze_chunks(dump, config, positions, name)
        _same(whole, chunked, rtol=0.0 if positions == 10**9 else 1e-14)
        assert [f.value for f in whole.findings] == [f.value for f in chunked.findings], name


@pytest.mark.parametrize("positions", [1, 300, 4096])
def test_chunked_equals_whole_on_a_ragged_dump(ragged_path, positions):
    dump = read_dump(ragged_path)
    chunks = list(iter_chunks(dump, positions))
    assert sum(len(c) for c in chunks) == len(dump) and len(chunks) > 1
    assert all(c.response_mask.numel() <= positions or len(c) == 1 for c in chunks)
    for name, config in CONFIGS.items():
        if config.opsm_delta is not None or name.startswith("verl"):
            pass  # every row has advantages; verl mode's windows: both run below
        _same(analyze(dump, config, name), analyze_chunks(dump, config, positions, name))


def _reference(dump, config):
    """``compute_correction`` on the whole padded batch, as analyze called it before reading in chunks."""
    version = current = None
    if dump.version is not None:
        version = dump.version
        current = int(dump.version.masked_fill(~dump.response_mask, -(2**62)).max())
    return compute_correction(
        dump.learner_log_prob, dump.rollout_log_prob, dump.response_mask, config,
        log_prob=dump.learner_log_prob if config.mode == "bypass" else None, advantages=dump.advantages,
        version=version, current_version=current, warn=False,
    )


@pytest.mark.parametrize("source", ["sample", "ragged"])
def test_the_analysis_is_compute_correction_on_the_whole_batch(source, ragged_path):
    """Weights, mask and every metric equal ``compute_correction``'s on the whole padded batch (metrics to float
    rounding: the sums run chunk by chunk, per row, in another order)."""
    dump = read_dump(sample_dump_path() if source == "sample" else ragged_path)
    for name, config in CONFIGS.items():
        res, analysis = _reference(dump, config), analyze(dump, config, name)
        assert torch.equal(analysis.kept_mask, res.kept_mask), name
        if res.is_weights is None:
            assert analysis.is_weights is None and analysis.weights is None, name
        else:
            torch.testing.assert_close(analysis.is_weights, res.is_weights, rtol=1e-12, atol=0)
            w = res.is_weights[dump.response_mask]
            assert analysis.weights == pytest.approx((float(w.mean()), float(w.min()), float(w.max())), rel=1e-12)
        want = metrics_to_floats(res.metrics)
        got = {k: v for k, v in analysis.metrics.items() if not k.startswith("routing/")}
        assert list(got) == list(want), name
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet"])
def test_the_reader_in_small_blocks_equals_the_whole_read(ragged_path, tmp_path, monkeypatch, kind):
    path = ragged_path
    if kind == "jsonl.gz":
        path = tmp_path / "ragged.jsonl.gz"
        path.write_bytes(gzip.compress(ragged_path.read_bytes()))
    if kind == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        lines = ragged_path.read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.endswith("}") and "response_mask" in line]
        path = tmp_path / "ragged.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    whole = read_dump(path)
    monkeypatch.setattr(dumps.streams, "READ_BYTES", 20_000)
    monkeypatch.setattr(dumps.reader, "PARQUET_BATCH_ROWS", 7)
    blocks = list(open_dump(path).blocks())
    assert len(blocks) > 3
    for name in ("decoupled_geo_rs_token_tis", "icepop", "slime_veto", "token_bn", "opsm"):
        config = CONFIGS[name]
        reader = open_dump(path)
        chunked = analyze_reader(reader, config, name, positions=2000)
        _same(analyze(whole, config, name), chunked)
        assert chunked.dump.malformed == whole.malformed and chunked.dump.total_rows == whole.total_rows


def test_one_long_row_does_not_pad_the_short_ones(tmp_path):
    """3000 one-token rows and one 5000-token row: chunks stay within the budget (the long row alone in its
    own); a whole-batch read would be 3001 × 5000."""
    rows = [{"rollout_log_probs": [-0.5], "old_log_probs": [-0.51]} for _ in range(3000)]
    rows.insert(1234, {"rollout_log_probs": [-0.5] * 5000, "old_log_probs": [-0.48] * 5000})
    path = tmp_path / "path.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shapes = [tuple(c.response_mask.shape) for c in open_dump(path).chunks(positions=1024)]
    assert (1, 5000) in shapes and sum(b for b, _ in shapes) == 3001
    assert all(b * t <= 1024 for b, t in shapes if (b, t) != (1, 5000))
    analysis = analyze_reader(open_dump(path), preset("decoupled_geo_rs_token_tis"), positions=1024)
    assert analysis.responses == 3001 and analysis.tokens == 8000
    assert [(t.line, t.position) for t in analysis.top_tokens[:3]] == [(1235, 0), (1235, 1), (1235, 2)]  # ties: in order


def test_batch_normalisation_divides_by_the_whole_dumps_mean(ragged_path):
    dump = read_dump(ragged_path)
    for name in ("token_bn", "seq_bn"):
        whole, chunked = analyze(dump, CONFIGS[name]), analyze_chunks(dump, CONFIGS[name], 300)
        factor = whole.metrics["rollout_corr/rollout_is_batch_norm_factor"]
        assert chunked.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-13)
        assert factor != 1.0
        if name == "token_bn":  # token level: the applied weights average 1 over the dump's tokens
            assert whole.weights[0] == pytest.approx(1.0, rel=1e-12) == chunked.weights[0]


def test_quantiles_are_torch_quantile():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 10, 1001):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        want = torch.quantile(x, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
        assert list(quantiles(x.numpy())) == want


def test_most_mismatched_tokens_are_real_tokens(tmp_path, capsys):
    """Fewer tokens with ℓ ≠ 0 than --top: the table lists valid tokens only (padding is never "kept, w = 0")."""
    rows = [
        {"rollout_log_probs": [-0.5, -0.2, 0.0, 0.0], "old_log_probs": [-0.5, -0.3, 0.0, 0.0], "response_mask": [1, 1, 0, 0]},
        {"rollout_log_probs": [-0.7], "old_log_probs": [-0.7]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    analysis = analyze(read_dump(path), preset("decoupled_token_is"))
    assert [(t.line, t.position) for t in analysis.top_tokens] == [(1, 1), (1, 0), (2, 0)]
    assert main(["analyze", str(path), "--preset", "decoupled_token_is", "--top", "8"]) == 0
    out = capsys.readouterr().out
    assert "largest |ℓ|, 3 of 3" in out and "w = 0\n" not in out and "w = 0 " not in out


def test_streams_are_read(tmp_path, monkeypatch, capsys):
    """``-`` (standard input, plain or gzipped, JSONL or Parquet) and a FIFO (``<(cat f)``) read the dump."""
    data = sample_dump_path().read_bytes()
    want = analyze(read_dump(sample_dump_path()), preset("icepop")).metrics

    class Stdin:
        def __init__(self, raw: bytes) -> None:
            self.buffer = io.BufferedReader(io.BytesIO(raw))

    for raw in (data, gzip.compress(data)):
        monkeypatch.setattr("sys.stdin", Stdin(raw))
        got = analyze_reader(open_dump("-"), preset("icepop")).metrics
        assert got == pytest.approx(want, rel=1e-14)
    monkeypatch.setattr("sys.stdin", Stdin(data))
    assert main(["analyze", "-", "--preset", "icepop"]) == 0
    assert "128 responses, 577 tokens from stdin" in capsys.readouterr().out
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        writer = threading.Thread(target=lambda: fifo.write_bytes(data))
        writer.start()
        got = analyze_reader(open_dump(fifo), preset("icepop")).metrics
        writer.join()
        assert got == pytest.approx(want, rel=1e-14)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    dump = read_dump(sample_dump_path())
    rows = [{"rollout_log_probs": dump.rollout_log_prob[b][m].tolist(), "old_log_probs": dump.learner_log_prob[b][m].tolist()}
            for b, m in enumerate(dump.response_mask)]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    monkeypatch.setattr("sys.stdin", Stdin(sink.getvalue()))
    assert analyze_reader(open_dump("-"), preset("icepop")).tokens == 577


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"rollout_log_probs": [-0.1, True], "old_log_probs": [-0.1, -0.2], "response_mask": [1, 0]},
         "field 'rollout_log_probs' is not a list of numbers"),
        ({"rollout_log_probs": [-0.1, -0.2], "old_log_probs": [False, -0.2]}, "is not a list of numbers"),
        ({"rollout_log_probs": [-0.1], "old_log_probs": [-0.1], "responses": [True]}, "not a list of integers"),
        ({"rollout_log_probs": [-0.1], "old_log_probs": [-0.1], "responses": [2**63]}, "outside the int64 range"),
        ({"rollout_log_probs": [-0.1], "old_log_probs": [-0.1], "responses": [1.0]}, "not a list of integers"),
        ({"rollout_log_probs": [-0.1, "x"], "old_log_probs": [-0.1, -0.2], "response_mask": [1, 0]},
         "is not a list of numbers"),
        ({"rollout_log_probs": [-0.1], "old_log_probs": [-0.1], "response_mask": [None]}, "0/1"),
        ({"rollout_log_probs": [-0.1], "old_log_probs": [-0.1], "token_text": [3]}, "not a list of strings"),
    ],
)
def test_column_checks_give_the_per_row_reasons(tmp_path, row, reason):
    """Bools (numpy would read them as 1 / 0), strings, nulls and out-of-range integers anywhere in a list,
    padding included, are found by the column checks and reported with the per-row reason."""
    good = {"rollout_log_probs": [-0.3, -0.4], "old_log_probs": [-0.3, -0.41], "token_text": ["true", "a"]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n" + json.dumps(good) + "\n")
    dump = read_dump(path)
    assert len(dump) == 2 and [m.line for m in dump.malformed] == [2]
    assert reason in dump.malformed[0].reason


def test_nulls_and_garbage_in_padding_are_ignored(tmp_path):
    row = {"rollout_log_probs": [-0.1, None, 5.0], "old_log_probs": [-0.2, float("nan"), None],
           "response_mask": [1, 0, 0], "advantages": [1.0, None, float("inf")]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    dump = read_dump(path)
    assert not dump.malformed and dump.rollout_log_prob.tolist() == [[-0.1, 0.0, 0.0]]
    assert dump.advantages.tolist() == [[1.0, 0.0, 0.0]]


def test_an_optional_field_first_seen_further_on_is_read_from_there(tmp_path, monkeypatch):
    monkeypatch.setattr(dumps.streams, "READ_BYTES", 64)
    rows = [{"rollout_log_probs": [-0.1], "old_log_probs": [-0.2]} for _ in range(6)]
    rows[4]["version"] = [3]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reader = open_dump(path)
    assert "version" not in reader.fields
    list(reader.blocks())
    info = reader.info()
    assert info.fields["version"] == "version" and info.partial["version"] == [1, 2, 3, 4, 6]


def test_a_sparse_mask_is_a_one_line_error():
    mask = torch.ones(2, 3).to_sparse()
    with pytest.raises(ValueError, match=r"response_mask must be a dense tensor, got layout torch.sparse_coo"):
        compute_correction(-torch.rand(2, 3), -torch.rand(2, 3), mask, preset("tis"))


def test_the_reader_keeps_one_block_of_rows(tmp_path, monkeypatch):
    """Chunks come out while the file is read: at most a pool of rows is held (no whole-file list)."""
    monkeypatch.setattr(dumps.streams, "READ_BYTES", 4096)
    monkeypatch.setattr(dumps.reader, "POOL_TOKENS", 256)
    rows = [{"rollout_log_probs": [-0.1] * 20, "old_log_probs": [-0.2] * 20} for _ in range(400)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reader = open_dump(path)
    seen = []
    for chunk in reader.chunks(positions=200, pool_tokens=256):
        seen.append((reader.rows, len(chunk)))
    assert seen[0][0] < 400 and sum(n for _, n in seen) == 400  # the first chunk before the last row was read
    assert np.all(np.diff([r for r, _ in seen]) >= 0)
