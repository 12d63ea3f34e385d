"""Study 8 (experiments/moe_study.py): its arms and rules do what docs/moe-study.md says, its protocol is
unchanged since the commit that added it, every run file was made by a descendant of that commit, and its
--quick path runs (slow)."""

import json
from pathlib import Path

import pytest
from experiments import moe_study as ms

ROOT = Path(__file__).resolve().parents[1]


def test_arms_seeds_and_comparisons_are_the_protocols():
    assert set(ms.SEEDS) == set(range(20, 30)) and not set(ms.SEEDS) & (set(range(3)) | set(range(10, 20)))
    assert len(ms.ARMS) == 7 and ms.schedule()[:7] == [(arm, 20) for arm in ms.ARMS]
    overrides = ms.arm_overrides("moe-int8/lag2-ewma+r3", 600)
    for key in ("model.path=builtin:moe", "trainer.steps=600", "model.sampler=hf:int8", "trainer.lag=2",
                "algorithm.proximal.name=ewma", "model.routing_replay=r3", "optim.skip_zero_grad=true"):
        assert key in overrides, key
    assert "model.routing_replay=r3" not in ms.arm_overrides("moe-int8/lag2-ewma", 600)
    assert all(hi in ms.ARMS and lo in ms.ARMS for hi, lo in ms.COMPARISONS + ms.SECONDARY)


def _audit(k3, dp, flips=None):
    routing = None if flips is None else {"routing_flip_share": flips}
    return {"k3_kl": k3, "prob_diff_mean": dp, "routing": routing}


def test_mismatch_rules_read_the_audits():
    audits = {"moe/fp32": _audit(0.0, 1e-7, 0.0), "moe/bf16": _audit(1e-3, 6e-3, 0.006),
              "moe/fp16": _audit(3e-5, 7e-4, 0.0), "moe/int8": _audit(2e-3, 8e-3, 0.006),
              "moe/bf16+r3": _audit(5e-4, 5e-3, 0.006), "moe/int8+r3": _audit(2.1e-3, 7e-3, 0.006),
              "dense/bf16": _audit(5e-4, 3e-3)}
    rules = ms.mismatch_rules(audits)
    assert rules["A1_fp32_flips_nothing"] is True
    assert rules["A2_lower_precisions_flip"] == {"bf16": True, "fp16": False, "int8": True}
    assert rules["A3_replay_shrinks_the_gap"] == {
        "bf16": True,
        "int8": False,
    }  # int8's k3 rose: both must fall
    assert rules["A4_moe_over_dense"] == {
        "bf16": {"k3_kl": pytest.approx(2.0), "prob_diff_mean": pytest.approx(2.0)}
    }
    assert ms.mismatch_rules({"moe/fp32": _audit(0.0, 1e-7, 1e-3)})["A1_fp32_flips_nothing"] is False


def _run(arm, seed, score):
    evals = [(0, 0.175), (500, score), (550, score), (600, score)]
    return {"arm": arm, "seed": seed, "final_score": score, "evals": evals}


def test_training_summary_gives_verdicts_only_when_complete():
    runs = [_run(arm, s, 0.70 + 0.001 * s) for arm in ms.ARMS for s in ms.SEEDS]
    runs = [r if r["arm"] != "moe-int8/ppo" else {**r, "final_score": r["final_score"] - 0.2} for r in runs]
    summary = ms.training_summary(runs)
    assert summary["complete"] and summary["arms"]["moe-int8/ppo"]["seeds"] == 10
    p1, p2, p3, p4 = (summary["tests"][f"{hi} vs {lo}"] for hi, lo in ms.COMPARISONS)
    assert p1["verdict"] == "reproduced" and p1["difference"] == pytest.approx(0.2)
    assert p2["verdict"] == "reproduced"
    assert p3["verdict"] == p4["verdict"] == "not reproduced"  # identical arms: p = 1
    assert p1["p_holm"] >= p1["p_value"]
    flipped = [r if r["arm"] != "moe-int8/r3" else {**r, "final_score": r["final_score"] - 0.3} for r in runs]
    assert ms.training_summary(flipped)["tests"]["moe-int8/r3 vs moe-int8/ppo"]["verdict"] == "opposite"
    partial = ms.training_summary([r for r in runs if r["seed"] < 25])
    assert not partial["complete"] and all(
        t["verdict"].startswith("pending") for t in partial["tests"].values()
    )


def test_protocol_unchanged_since_its_commit_and_runs_descend_from_it(protocol_held):
    protocol_held(ms.PROTOCOL, ms.protocol_commit(), ROOT / "experiments/results/moe", ("runs", "audits"))


@pytest.mark.slow
def test_quick_runs_every_audit_and_arm_and_assembles(tmp_path, capsys):
    assert ms.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["audits"]) == set(ms.AUDITS) and set(report["summary"]["arms"]) == set(ms.ARMS)
    assert report["summary"]["mismatch"]["A1_fp32_flips_nothing"] is True
    assert report["audits"]["dense/bf16"]["routing"] is None and report["audits"]["moe/bf16"]["routing"]
    assert report["summary"]["complete"] is False
    capsys.readouterr()
    ms.main(["--quick", "--out", str(tmp_path)])  # finished audits and runs are read back, not redone
    assert "seed 20" not in capsys.readouterr().err


def test_the_wall_times_and_the_detectable_effect_quoted_are_the_files():
    """docs/results.md's study-8 row quotes the run and audit files' seconds, and its reading of "not
    reproduced" P2's minimum detectable effect, as the summary computes it."""
    import statistics

    from experiments import summary

    text = " ".join((ROOT / "docs/results.md").read_text().split())
    runs = [json.loads(p.read_text())["seconds"] for p in (ROOT / "experiments/results/moe/runs").glob("*.json")]
    audits = [json.loads(p.read_text())["seconds"] for p in (ROOT / "experiments/results/moe/audits").glob("*.json")]

    def spaced(x: float) -> str:  # 1148 → "1 148", as the table writes thousands
        return f"{x:,.0f}".replace(",", " ")

    assert f"audits {min(audits):.0f}–{max(audits):.0f} s each" in text
    assert f"runs {spaced(min(runs))}–{spaced(max(runs))} s wall each, median {statistics.median(runs):.0f} s" in text
    p2 = next(row for row in summary.rows("moe") if "R3) repairs it" in row.claim)
    assert f"none below {p2.mde:.3f} for R3's repair" in text


def test_docs_moe_flip_shares_are_the_audit_files():
    """docs/moe.md's 2,048-response rows quote the study's audit files (flip share of pairs and of tokens)."""
    text = (ROOT / "docs/moe.md").read_text()
    for name, spec in (("moe_bf16", "hf:bf16"), ("moe_fp16", "hf:fp16"), ("moe_int8", "hf:int8")):
        audit = json.loads((ROOT / f"experiments/results/moe/audits/{name}.json").read_text())
        routing = audit["routing"]
        tokens = f"{audit['tokens']:,}".replace(",", " ")
        row = next(line for line in text.splitlines() if line.startswith(f"| {spec}, `-n 2048 --batch-size 64` |"))
        pairs, flipped = (100 * routing[k] for k in ("routing_flip_share", "routing_flip_token_share"))
        assert f"| {tokens} | {pairs:.2f} % | {flipped:.2f} % |" in row, (row, pairs, flipped)
