"""Routing data is checked, not trusted: expert ids must be integers, the two sides' routing must be comparable,
and when they cannot be compared (part of the rows, another top-k) the report says so; r3 on a dense model is a
one-line config error."""

import json

import pytest

from rollcorr.cli import main


def _dump(tmp_path, make_row, n=6):
    rows = []
    for i in range(n):
        row = {"rollout_log_probs": [-1.0, -0.5], "old_log_probs": [-1.1, -0.4], "response_mask": [1, 1]}
        row.update(make_row(i))
        rows.append(json.dumps(row))
    path = tmp_path / "dump.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("routes, reason", [
    ([[[1.9, 2]], [[0, 3]]], "non-integer expert id (1.9)"),
    ([[[True, False]], [[True, True]]], "holds booleans, not expert ids"),
])
def test_expert_ids_that_are_not_integers_are_refused_naming_the_field_and_row(tmp_path, capsys, routes, reason):
    path = _dump(tmp_path, lambda i: {"routed_experts": routes, "learner_routed_experts": [[[1, 2]], [[0, 3]]]})
    assert main(["audit", "--from-log", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "line 1: field 'routed_experts'" in err and reason in err and "Traceback" not in err


@pytest.mark.parametrize("make_row, note", [
    (lambda i: {"routed_experts": [[[1, 2]], [[0, 3]]], "learner_routed_experts": [[[1, 2, 3]], [[0, 3, 4]]]},
     "the sampler's routing has (layers, top-k) (1, 2) and the learner's (1, 3)"),
    (lambda i: {"routed_experts": [[[1, 2]], [[0, 3]]], "learner_routed_experts": [[[1, 2]], [[0, 4]]]} if i % 2 else {},
     "the sampler's routed experts are on 3 of 6 rows"),
])
def test_routing_that_cannot_be_compared_is_said_not_dropped(tmp_path, make_row, note):
    """Another top-k on each side (a traceback and an empty folder before), or routing on half the rows (the
    routing section vanished): the report says why routing was not compared."""
    path = _dump(tmp_path, make_row)
    out = tmp_path / "out"
    assert main(["audit", "--from-log", str(path), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "routing" not in summary and note in summary["routing_note"]
    assert any(note in sentence for sentence in summary["verdict"])
    assert "routing not compared" in (out / "report.html").read_text()


def test_routing_replay_on_a_dense_model_is_a_one_line_config_error(tmp_path, capsys):
    assert main(["train", "model.routing_replay=r3", "trainer.steps=1", f"trainer.out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("rollcorr train: config error: model.routing_replay: routing_replay='r3' needs a "
                           "mixture-of-experts model; builtin is dense")
    assert not (tmp_path / "run").exists()
