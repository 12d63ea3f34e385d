"""Dumps as peers write them are read with no field options, and write_dump's output reads back."""

from __future__ import annotations

import json

import pytest
import torch

from rollcorr.dumps import read_dump, write_dump


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_areal_rows_are_detected(tmp_path):
    """AReaL's per-token batch fields: ``logprobs`` (inference engine, μ), ``prox_logp`` (π_prox, the
    learner), ``loss_mask`` (0 on prompt tokens), ``versions`` (−1 on the prompt), ``advantages``."""
    rows = [
        {"input_ids": [5, 6, 7, 8], "logprobs": [0.0, 0.0, -0.5, -1.2], "prox_logp": [0.0, 0.0, -0.45, -1.3],
         "loss_mask": [0, 0, 1, 1], "versions": [-1, -1, 3, 3], "advantages": [0.0, 0.0, 0.7, 0.7]},
        {"input_ids": [5, 9, 2], "logprobs": [0.0, -0.1, -0.2], "prox_logp": [0.0, -0.12, -0.2],
         "loss_mask": [0, 1, 1], "versions": [-1, 4, 4], "advantages": [0.0, -0.7, -0.7]},
    ]
    dump = read_dump(_jsonl(tmp_path / "areal.jsonl", rows))
    assert dump.fields["rollout"] == "logprobs" and dump.fields["learner"] == "prox_logp"
    assert dump.fields["mask"] == "loss_mask" and dump.fields["version"] == "versions"
    assert dump.num_tokens == 4 and not dump.malformed
    torch.testing.assert_close(dump.learner_log_prob[dump.response_mask], torch.tensor([-0.45, -1.3, -0.12, -0.2], dtype=torch.float64))


def test_prime_rl_rows_are_detected(tmp_path):
    """prime-rl's loss inputs: ``inference_logprobs`` (μ), ``trainer_logprobs`` (π), ``loss_mask``,
    ``advantages``."""
    rows = [
        {"inference_logprobs": [-0.3, -0.9, -2.0], "trainer_logprobs": [-0.31, -0.85, -2.2],
         "loss_mask": [True, True, True], "advantages": [1.0, 1.0, 1.0]},
        {"inference_logprobs": [-0.5, -0.6], "trainer_logprobs": [-0.5, -0.7], "loss_mask": [True, False],
         "advantages": [-1.0, -1.0]},
    ]
    dump = read_dump(_jsonl(tmp_path / "prime.jsonl", rows))
    assert dump.fields["rollout"] == "inference_logprobs" and dump.fields["learner"] == "trainer_logprobs"
    assert dump.num_tokens == 4


def test_write_dump_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    roll = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    old = roll - 0.01
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5])
    path = tmp_path / "run" / "rollouts.jsonl"
    assert write_dump(path, roll, old, mask, advantages=adv, tokens=torch.arange(15).view(3, 5),
                      extras={"step": [7, 7, 7]}) == 3
    assert write_dump(path, roll, old, mask, tokens=torch.zeros(3, 5, dtype=torch.long)) == 3  # appends
    dump = read_dump(path, extra_fields=("step",))
    assert len(dump) == 6 and dump.num_tokens == 18
    torch.testing.assert_close(dump.rollout_log_prob[:3][mask], roll[mask])
    torch.testing.assert_close(dump.learner_log_prob[:3][mask], old[mask])
    assert dump.extras["step"][:3] == [7, 7, 7] and dump.tokens is not None


def test_write_dump_checks_before_writing(tmp_path):
    path = tmp_path / "d.jsonl"
    with pytest.raises(ValueError, match="learner_log_prob has shape"):
        write_dump(path, torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="extras"):
        write_dump(path, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), extras={"step": [1]})
    with pytest.raises(ValueError, match="Out of range float values"):
        write_dump(path, torch.full((2, 3), float("nan")), torch.zeros(2, 3), torch.ones(2, 3))
    assert not path.exists()  # nothing half-written


def test_docs_analyze_write_dump_snippet_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "analyze.md").read_text()
    code = re.search(r"### Writing a dump: `write_dump`.*?```python\n(.*?)```", doc, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(code, {})
    dump = read_dump("runs/example/rollouts.jsonl", extra_fields=("step",))
    assert len(dump) == 2 and dump.extras["step"] == [0, 0]


def test_write_dump_gz_round_trips(tmp_path):
    """A ``.gz`` path is written gzip-compressed and appended to, and the reader inflates it."""
    path = tmp_path / "rollouts.jsonl.gz"
    roll, old = -torch.rand(2, 3), -torch.rand(2, 3)
    assert write_dump(path, roll, old, torch.ones(2, 3)) == 2
    assert write_dump(path, roll, old, torch.ones(2, 3)) == 2  # appended: a second gzip member
    dump = read_dump(path)
    assert len(dump) == 4
    assert torch.allclose(dump.rollout_log_prob[:2].float(), roll)
