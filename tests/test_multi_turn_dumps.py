"""Multi-turn dumps in verl's agent-loop layout (docs/multi-turn.md, "Reading agent-loop dumps"): the tool's
tokens sit in the response at response_mask 0, whatever their log-probs hold, and `rollcorr analyze` and
`rollcorr audit --from-log` break the mismatch down per turn (a turn: a run of mask-1 tokens, or the turn field)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rollcorr.analyze.analysis import analyze, analyze_reader
from rollcorr.analyze.cli import load_config
from rollcorr.audit import dump_audit
from rollcorr.audit.collect import from_log
from rollcorr.audit.report import build_summary
from rollcorr.dumps import open_dump, read_dump, write_dump
from rollcorr.turns import place_in_turn, turn_index, turn_summary

# one trajectory: 3 model turns (5, 4, 3 tokens) with a tool's reply (3 and 2 tokens) between them, then padding
MASK = [1] * 5 + [0] * 3 + [1] * 4 + [0] * 2 + [1] * 3 + [0] * 2
TURN_OF = [0] * 5 + [0] * 3 + [1] * 4 + [1] * 2 + [2] * 3 + [0] * 2  # rollcorr's turn field (observations: the turn answered)


def _rows(n: int = 7, seed: int = 0) -> list[dict]:
    """Per trajectory: the sampler's and the learner's log-probs on every position, the mask, the ids."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        mu = [math.log(rng.uniform(0.05, 1.0)) for _ in MASK]
        old = [min(0.0, m + rng.gauss(0.0, 0.08)) for m in mu]
        rows.append({"mu": mu, "old": old, "ids": [100 + i + t for t in range(len(MASK))]})
    return rows


def _verl_row(row: dict, filler: float, layout: str) -> dict:
    """A row as verl's agent loop leaves it: the tool's tokens in the response with mask 0 and ``filler`` as their
    sampler log-prob (verl writes 0.0); the learner's log-probs of every position (verl's old_log_probs)."""
    mu = [m if k else filler for m, k in zip(row["mu"], MASK)]
    if layout == "batch":  # AgentLoopOutput.as_dict → the training batch's keys
        return {"prompts": [1, 2, 3], "responses": row["ids"], "response_mask": MASK, "rollout_log_probs": mu,
                "old_log_probs": row["old"], "__num_turns__": 6}
    return {"prompt_ids": [1, 2, 3], "response_ids": row["ids"], "response_mask": MASK, "response_logprobs": mu,
            "old_log_probs": row["old"], "num_turns": 6}


def _write(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # NaN written as NaN (json's default)
    return str(path)


def _by_hand(rows: list[dict]) -> list[dict]:
    """Each turn's tokens, mean |Δp|, share |Δp| ≥ 0.01, k1 and k3 computed with math, token by token."""
    runs, turn, previous = [], -1, 0
    for k in MASK:
        turn += bool(k and not previous)
        runs.append(turn if k else -1)
        previous = k
    out = []
    for t in range(max(runs) + 1):
        d, k1, k3 = [], [], []
        for row in rows:
            for mu, old, r in zip(row["mu"], row["old"], runs):
                if r == t:
                    lr = old - mu
                    d.append(abs(math.exp(mu) - math.exp(old)))
                    k1.append(-lr)
                    k3.append(math.exp(lr) - 1 - lr)
        out.append({"tokens": len(d), "prob_diff_mean": math.fsum(d) / len(d), "k3_kl": math.fsum(k3) / len(d),
                    "kl": math.fsum(k1) / len(d), "prob_diff_frac_ge_0.01": sum(x >= 0.01 for x in d) / len(d),
                    "prob_diff_max": max(d)})
    return out


def test_a_turn_is_a_run_of_mask_1_tokens_or_the_turn_field():
    mask = torch.tensor([MASK, [1] * 4 + [0] * 15])
    turns = turn_index(mask)
    assert turns[0].tolist() == [0] * 5 + [-1] * 3 + [1] * 4 + [-1] * 2 + [2] * 3 + [-1] * 2
    assert turns[1].tolist() == [0] * 4 + [-1] * 15
    assert place_in_turn(mask, turns)[0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1, 0, 1, 2, 3, -1, -1, 0, 1, 2, -1, -1]
    field = torch.tensor([TURN_OF, [0] * 19])
    assert torch.equal(turn_index(mask, field), turns)
    # a turn field says what runs cannot: two model turns with no environment token between them
    joined = torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]])
    assert turn_index(*joined).tolist() == [[0, 0, 1, 1]] and turn_index(joined[0]).tolist() == [[0, 0, 0, 0]]
    assert place_in_turn(joined[0], turn_index(*joined)).tolist() == [[0, 1, 0, 1]]


@pytest.mark.parametrize("layout", ["batch", "agent_loop"])
def test_per_turn_numbers_match_a_hand_computation(tmp_path, layout):
    rows = _rows()
    path = _write(tmp_path / "dump.jsonl", [_verl_row(r, 0.0, layout) for r in rows])
    want = _by_hand(rows)
    dump = read_dump(path)
    assert dump.fields["rollout"] == ("rollout_log_probs" if layout == "batch" else "response_logprobs")
    summaries = {
        "audit, whole": build_summary(from_log(path))["turns"],
        "audit, chunk by chunk": dump_audit.audit_log(path, positions=40, whole_positions=0).summary["turns"],
        "analyze": analyze(dump, load_config("decoupled_token_is")[0]).turns,
    }
    for where, got in summaries.items():
        assert got["turns_from"] == "runs of mask-1 tokens", where
        assert [t["turn"] for t in got["turns"]] == [0, 1, 2], where
        for g, w in zip(got["turns"], want):
            assert g["responses"] == len(rows) and g["tokens"] == w["tokens"], where
            for key in ("prob_diff_mean", "k3_kl", "kl", "prob_diff_frac_ge_0.01", "prob_diff_max"):
                assert g[key] == pytest.approx(w[key], rel=1e-12, abs=1e-15), (where, key)
    # the token-weighted mean of a turn's k3 is the audit's k3 over all tokens
    whole = build_summary(from_log(path))
    pooled = sum(t["k3_kl"] * t["tokens"] for t in whole["turns"]["turns"]) / whole["n_tokens"]
    assert pooled == pytest.approx(whole["divergence"]["k3_kl"], rel=1e-12)
    # by place in the turn: place 0 holds each trajectory's three turn openings
    place = whole["turns"]["position_in_turn"]
    assert place["start"][0] == 0 and place["tokens"][0] == 3 * len(rows) and sum(place["tokens"]) == whole["n_tokens"]


@pytest.mark.parametrize("filler", [0.0, 1.0, math.nan])
def test_the_tools_log_probs_change_nothing(tmp_path, filler):
    """verl fills the tool's positions of rollout_log_probs with 0.0; a filler of 1 (a positive log-prob) or NaN
    must be as invisible as 0: same analysis, same audit, same per-turn numbers."""
    rows = _rows()
    base = _write(tmp_path / "zero.jsonl", [_verl_row(r, -0.7, "batch") for r in rows])
    filled = _write(tmp_path / "filled.jsonl", [_verl_row(r, filler, "batch") for r in rows])
    config = load_config("decoupled_geo_rs_token_tis")[0]
    a, b = (analyze_reader(open_dump(p), config) for p in (base, filled))
    assert a.metrics == b.metrics and a.turns == b.turns and a.rejected_tokens == b.rejected_tokens
    assert not b.dump.malformed
    sa, sb = (build_summary(from_log(p)) for p in (base, filled))
    for key in ("probability", "divergence", "turns", "position", "per_response", "verdict_level"):
        assert sa[key] == sb[key], key


def test_rollcorrs_own_multi_turn_rollout_is_written_and_read_back_per_turn(tmp_path):
    """write_dump(turn=...) writes a multi-turn Rollout in the agent-loop layout (the environment's tokens at mask
    0); read back, the audit's per-turn numbers are the rollout's own, from the turn field."""
    from rollcorr.rollout import Rollout

    torch.manual_seed(0)
    model = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    observed = torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    log_mu = torch.where(model, -torch.rand(2, 7), 0.0)
    rollout = Rollout(prompt_ids=torch.tensor([[5, 6], [5, 7]]), prompt_mask=torch.ones(2, 2, dtype=torch.bool),
                      response_ids=torch.tensor([[7, 8, 2, 11, 12, 21, 2], [9, 2, 13, 22, 2, 0, 0]]),
                      response_mask=model, observation_mask=observed, rollout_log_prob=log_mu,
                      turn=torch.tensor([[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 0, 0]]),
                      version=torch.zeros(2, 7, dtype=torch.long), group_ids=torch.zeros(2, dtype=torch.long))
    old = torch.where(model, log_mu - 0.05 * torch.rand(2, 7), 0.0)
    write_dump(tmp_path / "mt.jsonl", rollout.rollout_log_prob, old, rollout.response_mask, tokens=rollout.response_ids,
               turn=rollout.turn)
    dump = read_dump(tmp_path / "mt.jsonl")
    assert dump.fields["turn"] == "turn" and torch.equal(dump.turn, rollout.turn)
    assert torch.equal(dump.tokens, rollout.response_ids) and torch.equal(dump.response_mask, model)
    got = build_summary(from_log(tmp_path / "mt.jsonl"))["turns"]
    want = turn_summary(rollout.rollout_log_prob, old, rollout.response_mask, rollout.turn)
    assert got["turns_from"] == "the turn field" and len(got["turns"]) == len(want["turns"]) == 2
    for g, w in zip(got["turns"], want["turns"]):  # the dump holds the float32 values exactly (as float64)
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15)
    assert [t["tokens"] for t in got["turns"]] == [5, 4]


def test_a_single_turn_dump_has_no_turn_section(tmp_path):
    rows = [{"rollout_log_probs": [-0.1, -0.2, -0.3], "old_log_probs": [-0.1, -0.25, -0.3], "response_mask": [1, 1, 0]}]
    path = _write(tmp_path / "one.jsonl", rows * 3)
    assert "turns" not in build_summary(from_log(path))
    assert analyze(read_dump(path), load_config("decoupled_token_is")[0]).turns is None
