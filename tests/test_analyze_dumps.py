"""The rollout-dump reader: JSONL and Parquet, field names, every malformed-row kind with its line number."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcorr.dumps import POSITIVE_TOL, read_dump


def test_the_former_address_is_the_same_module(tmp_path, monkeypatch):
    """``rollcorr.analyze.dumps`` (docs named it before the format moved below the apps) is ``rollcorr.dumps``
    itself: the same functions, and a setting changed through either name is seen by both."""
    import rollcorr.analyze.dumps as former
    from rollcorr import dumps
    from rollcorr.analyze.dumps import read_dump as former_read_dump
    from rollcorr.analyze.dumps import write_dump as former_write_dump

    assert former is dumps and former_read_dump is read_dump and former_write_dump is dumps.write_dump
    monkeypatch.setattr(former, "READ_BYTES", 64)
    assert dumps.READ_BYTES == 64


def _row(n: int = 3, shift: float = 0.05, **extra):
    rollout = [-0.5 - 0.1 * i for i in range(n)]
    row = {
        "rollout_log_probs": rollout,
        "old_log_probs": [x - shift for x in rollout],
        "response_mask": [1] * n,
    }
    row.update(extra)
    return row


def _write_jsonl(path, rows):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_pads_rows_and_keeps_line_numbers(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [_row(3), _row(5, advantages=0.5), "", _row(1)])
    dump = read_dump(path)
    assert len(dump) == 3
    assert dump.line_numbers == [1, 2, 4]  # the blank line 3 is skipped, not malformed
    assert dump.malformed == []
    assert dump.rollout_log_prob.shape == (3, 5) and dump.rollout_log_prob.dtype == torch.float64
    assert dump.response_mask.dtype == torch.bool
    assert dump.response_mask.sum(-1).tolist() == [3, 5, 1]
    assert dump.rollout_log_prob[0, :3].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert dump.rollout_log_prob[0, 3:].tolist() == [0.0, 0.0]
    assert dump.learner_log_prob[1, 4].item() == pytest.approx(-0.9 - 0.05)
    # advantages only on one row -> not kept as a tensor (padding would masquerade as data)
    assert dump.advantages is None
    assert dump.num_tokens == 9


def test_mask_derived_from_lengths_and_scalar_advantages_broadcast(tmp_path):
    rows = []
    for n, adv in ((2, 1.0), (4, -0.5)):
        r = _row(n)
        del r["response_mask"]
        r["advantages"] = adv
        r["responses"] = list(range(n))
        r["token_text"] = [f"t{i}" for i in range(n)]
        r["response_text"] = "".join(r["token_text"])
        r["prompt"] = "1+1="
        rows.append(r)
    dump = read_dump(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert "mask" not in dump.fields
    assert dump.response_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert dump.advantages.tolist() == [[1.0, 1.0, 0.0, 0.0], [-0.5] * 4]
    assert dump.tokens.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]
    assert dump.token_text[1] == ["t0", "t1", "t2", "t3"]
    assert dump.text == ["t0t1", "t0t1t2t3"]
    assert dump.extras["prompt"] == ["1+1=", "1+1="]
    assert dump.extras["reward"] == [None, None]


def test_padding_positions_may_hold_garbage(tmp_path):
    r = _row(4)
    r["response_mask"] = [1, 1, 0, 0]
    r["rollout_log_probs"][2:] = [float("nan"), 3.0]
    r["old_log_probs"][2:] = [float("inf"), 0.0]
    dump = read_dump(_write_jsonl(tmp_path / "d.jsonl", [r]))
    assert dump.malformed == []
    assert torch.isfinite(dump.rollout_log_prob).all()
    assert dump.rollout_log_prob[0, 2:].tolist() == [0.0, 0.0]


def test_tiny_positive_log_probs_are_rounding_noise(tmp_path):
    r = _row(2)
    r["rollout_log_probs"][0] = POSITIVE_TOL / 2
    dump = read_dump(_write_jsonl(tmp_path / "d.jsonl", [r]))
    assert dump.malformed == [] and dump.rollout_log_prob[0, 0].item() == 0.0


MALFORMED = [
    ('{"rollout_log_probs": [-0.1], "old_log_probs": [-0.1]', "bad JSON"),
    ("[1, 2, 3]", "expected a JSON object"),
    ({"rollout_log_probs": [-0.1, -0.2]}, "missing field 'old_log_probs'"),
    ({**_row(3), "old_log_probs": [-0.1, -0.2]}, "ragged"),
    ({**_row(3), "response_mask": [1, 1]}, "ragged"),
    ({**_row(2), "rollout_log_probs": [-0.1, float("nan")]}, "non-finite 'rollout_log_probs' at token 1"),
    ({**_row(2), "old_log_probs": [float("-inf"), -0.2]}, "non-finite 'old_log_probs' at token 0"),
    ({**_row(2), "old_log_probs": [-0.1, None]}, "non-finite 'old_log_probs' at token 1"),
    ({**_row(2), "rollout_log_probs": [-0.1, 0.5]}, "positive log-prob in 'rollout_log_probs' at token 1"),
    ({**_row(2), "response_mask": [0, 0]}, "empty response"),
    ({"rollout_log_probs": [], "old_log_probs": [], "response_mask": []}, "empty response"),
    ({**_row(2), "old_log_probs": "oops"}, "not a list of numbers"),
    ({**_row(2), "response_mask": [1, 2]}, "0/1"),
    ({**_row(2), "advantages": [0.1]}, "ragged"),
    ({**_row(2), "advantages": [0.1, float("nan")]}, "non-finite 'advantages'"),
    ({**_row(2), "responses": [1, "a"]}, "not a list of integers"),
]


@pytest.mark.parametrize("bad, reason", MALFORMED, ids=[m[1] for m in MALFORMED])
def test_each_malformed_kind_is_skipped_with_its_line(tmp_path, bad, reason):
    path = _write_jsonl(tmp_path / "d.jsonl", [_row(3), _row(2), bad, _row(4)])
    dump = read_dump(path)
    assert len(dump) == 3 and dump.line_numbers == [1, 2, 4]
    assert len(dump.malformed) == 1
    assert dump.malformed[0].line == 3
    assert reason in dump.malformed[0].reason
    assert dump.total_rows == 4


def test_all_rows_bad_is_an_error(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{**_row(2), "response_mask": [0, 0]}, "{nope"])
    with pytest.raises(
        ValueError, match=r"all 2 rows are malformed.*line 1: empty response.*line 2: bad JSON"
    ):
        read_dump(path)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        read_dump(tmp_path / "e.jsonl")
    with pytest.raises(FileNotFoundError, match="not found"):
        read_dump(tmp_path / "nope.jsonl")


def test_required_field_absent_everywhere_names_it(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"a": [-0.1], "b": [-0.2]}])
    with pytest.raises(
        ValueError, match=r"rollout log-prob field 'rollout_log_probs'.*fields present: \['a', 'b'\]"
    ):
        read_dump(path)
    dump = read_dump(path, rollout_field="a", learner_field="b")
    assert dump.fields == {"rollout": "a", "learner": "b"}
    with pytest.raises(ValueError, match="mask field 'm'"):
        read_dump(path, rollout_field="a", learner_field="b", mask_field="m")
    with pytest.raises(ValueError, match="unknown field role"):
        read_dump(path, fields={"bogus": "x"})


def test_custom_field_names_and_fields_mapping(tmp_path):
    rows = [{"mu": [-0.2, -0.3], "pi": [-0.25, -0.3], "valid": [1, 0], "adv": [1.0, 1.0]}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    a = read_dump(path, rollout_field="mu", learner_field="pi", mask_field="valid", advantages_field="adv")
    b = read_dump(path, fields={"rollout": "mu", "learner": "pi", "mask": "valid", "advantages": "adv"})
    for dump in (a, b):
        assert dump.response_mask.tolist() == [[True, False]]
        assert dump.learner_log_prob.tolist() == [[-0.25, 0.0]]
        assert dump.advantages.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "rollout, learner, mask",
    [
        ("generation_logprobs", "prev_logprobs", "token_mask"),  # NeMo-RL
        ("sampling_per_token_logps", "old_per_token_logps", "completion_mask"),  # TRL
    ],
)
def test_peer_field_names_are_auto_detected(tmp_path, rollout, learner, mask):
    path = _write_jsonl(tmp_path / "d.jsonl", [{rollout: [-0.1, -0.2], learner: [-0.1, -0.3], mask: [1, 0]}])
    dump = read_dump(path)
    assert dump.fields == {"rollout": rollout, "learner": learner, "mask": mask}
    assert dump.learner_log_prob.tolist() == [[-0.1, 0.0]]


def test_gzip_jsonl(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(_row(3)) + "\n" + "garbage\n")
    dump = read_dump(path)
    assert len(dump) == 1 and dump.malformed[0].line == 2


def test_parquet_matches_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        _row(3, advantages=[0.1, 0.2, 0.3]),
        _row(5, advantages=[1.0] * 5),
        _row(2, advantages=[0.0, 0.0]),
    ]
    rows[2]["old_log_probs"][1] = float("nan")  # row 3 is malformed
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "d.parquet")
    pdump = read_dump(tmp_path / "d.parquet")
    jdump = read_dump(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert pdump.line_numbers == jdump.line_numbers == [1, 2]
    assert [m.line for m in pdump.malformed] == [3]
    assert "non-finite" in pdump.malformed[0].reason
    for name in ("rollout_log_prob", "learner_log_prob", "response_mask", "advantages"):
        assert torch.equal(getattr(pdump, name), getattr(jdump, name)), name


def test_to_rollout(tmp_path):
    dump = read_dump(
        _write_jsonl(tmp_path / "d.jsonl", [_row(3, responses=[5, 6, 7]), _row(1, responses=[9])])
    )
    rollout = dump.to_rollout()
    assert rollout.batch_size == 2
    assert rollout.rollout_log_prob.dtype == torch.float32
    assert rollout.response_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert math.isclose(rollout.old_log_prob[0, 0].item(), -0.55, rel_tol=1e-6)
    assert rollout.meta[1]["line"] == 2


logp = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


@settings(deadline=None, max_examples=25)
@given(
    st.lists(st.lists(st.tuples(logp, logp, st.booleans()), min_size=1, max_size=6), min_size=1, max_size=5)
)
def test_round_trip_of_random_rows(tmp_path_factory, rows):
    """Whatever valid rows go in come out at the right place, padded with 0 / False."""
    path = tmp_path_factory.mktemp("rt") / "d.jsonl"
    records = []
    for row in rows:
        mask = [int(m) for _, _, m in row]
        mask[0] = 1  # at least one valid token per row
        records.append(
            {
                "rollout_log_probs": [r for r, _, _ in row],
                "old_log_probs": [o for _, o, _ in row],
                "response_mask": mask,
            }
        )
    _write_jsonl(path, records)
    dump = read_dump(path)
    assert dump.malformed == [] and len(dump) == len(rows)
    assert dump.rollout_log_prob.shape == (len(rows), max(len(r) for r in rows))
    for i, rec in enumerate(records):
        n = len(rec["response_mask"])
        assert dump.response_mask[i, :n].tolist() == [bool(m) for m in rec["response_mask"]]
        assert not dump.response_mask[i, n:].any()
        for t, m in enumerate(rec["response_mask"]):
            want_r = rec["rollout_log_probs"][t] if m else 0.0
            assert dump.rollout_log_prob[i, t].item() == want_r
            assert dump.learner_log_prob[i, t].item() == (rec["old_log_probs"][t] if m else 0.0)
