"""Study 9 (experiments/dose_response.py): its statistics and rules do what docs/dose-study.md says, its
protocol is unchanged since the commit that added it, the doses are the audited ones, and --quick runs."""

import json
import math
import statistics
from pathlib import Path

import pytest
from experiments import dose_audit as da
from experiments import dose_response as dr
from experiments import power

ROOT = Path(__file__).resolve().parents[1]


def test_t_quantiles_match_the_tables():
    # Student's t table values (e.g. NIST/SEMATECH handbook), to the table's 3 decimals
    for p, df, value in [(0.975, 18, 2.101), (0.80, 18, 0.862), (0.975, 1, 12.706), (0.995, 5, 4.032),
                         (0.9875, 18, 2.445), (0.95, 36, 1.688)]:
        assert power.t_quantile(p, df) == pytest.approx(value, abs=1e-3)
    assert power.t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)  # → the normal quantile
    assert power.t_quantile(0.3, 7) == pytest.approx(-power.t_quantile(0.7, 7))


def test_mde_follows_the_stated_formula():
    a, b = [0.6, 0.65, 0.7, 0.62, 0.68], [0.55, 0.5, 0.6, 0.58, 0.52]
    sp = math.sqrt((4 * statistics.variance(a) + 4 * statistics.variance(b)) / 8)
    want = (power.t_quantile(1 - 0.05 / 4, 8) + power.t_quantile(0.8, 8)) * sp * math.sqrt(2 / 5)
    assert power.mde_two_sample(a, b, 0.05, 2) == pytest.approx(want)
    assert power.mde_two_sample(a, b, 0.05, 1) < power.mde_two_sample(a, b, 0.05, 2)  # a larger family costs power


def test_trend_test_sees_a_falling_score_and_not_a_flat_one():
    falling = [[0.7 - 0.05 * r + 0.002 * i for i in range(10)] for r in range(4)]
    result = dr.trend_test(falling, [0, 1, 2, 3], n=20_000)
    assert result["slope"] == pytest.approx(-0.05)
    assert result["p_value"] == pytest.approx(1 / 20_001)  # no relabelling reaches it
    assert result["ci95"][0] < -0.05 < result["ci95"][1] < 0
    flat = [[0.6 + 0.01 * ((i * 7 + r) % 5) for i in range(10)] for r in range(4)]
    assert dr.trend_test(flat, [0, 1, 2, 3], n=20_000)["p_value"] > 0.05
    # the slope's MDE: the formula with the slope's standard error s / √Σ(x − x̄)², Σ = 10·(2.25+0.25+0.25+2.25)
    sd = result["pooled_sd"]
    want = (power.t_quantile(1 - 0.05 / 4, 36) + power.t_quantile(0.8, 36)) * sd / math.sqrt(50)
    assert result["mde_slope"] == pytest.approx(want)


def test_stratified_test_relabels_within_each_dose():
    # within every dose tis − ppo = +0.1 exactly, while the doses differ a lot: a pooled test would be swamped
    # by the dose spread; the stratified one is not
    pairs = [([0.3 + d + 0.1 + 0.001 * i for i in range(10)], [0.3 + d + 0.001 * i for i in range(10)])
             for d in (0.0, 0.2, 0.4)]
    result = dr.stratified_test(pairs, n=20_000)
    assert result["difference"] == pytest.approx(0.1)
    assert result["p_value"] == pytest.approx(1 / 20_001)
    same = [(list(b), list(b)) for _, b in pairs]
    assert dr.stratified_test(same, n=2_000)["p_value"] == 1.0


def test_dips_count_single_evaluations_and_collapses_need_two_or_a_stop():
    evals = [(0, 0.4), (25, 0.6), (50, 0.45), (75, 0.62), (100, 0.5), (125, 0.65)]
    assert dr.dips(evals) == 2
    assert not dr.collapsed({"evals": evals, "stopped": None})
    assert dr.collapsed({"evals": evals, "stopped": "3 consecutive steps had a non-finite loss"})
    assert dr.collapsed({"evals": [(0, 0.4), (25, 0.6), (50, 0.45), (75, 0.48)], "stopped": None})


def test_schedule_seeds_and_arms_are_the_protocols():
    order = dr.schedule()
    assert len(order) == 70 and order[:7] == [(arm, 20) for arm in dr.ARMS]
    assert set(dr.SEEDS) == set(range(20, 30)) and not set(dr.SEEDS) & set(range(0, 20))
    assert [dr.DOSES[d][1] for d in ("fp32", "rtn4", "rtn3", "rtn2")] == [0, 1, 2, 3]
    assert "model.sampler=hf:rtn2" in dr.arm_overrides("rtn2/tis", 300)
    assert "trainer.steps=300" in dr.arm_overrides("fp32/ppo", 300)


def test_committed_doses_are_the_ones_the_study_runs():
    report = json.loads((da.OUT / "doses.json").read_text())
    chosen = [d["sampler"] for d in report["choice"]["doses"].values()]
    assert report["choice"]["distinct"]
    assert chosen == [dr.DOSES[name][0] for name in dr.MISMATCHED]
    assert "rtn2" in report["choice"]["doses"]["D3"]["sampler"]


def _write_runs(out: Path, scores: dict[str, float]) -> None:
    """Run files as ``one_run`` writes them, each arm's ten seeds ending near ``scores[arm]``."""
    for arm, seed in dr.schedule():
        final = scores[arm] + 0.004 * (seed - 24.5)
        evals = [[0, 0.3]] + [[s, final] for s in range(25, dr.STEPS + 1, 25)]
        record = {"arm": arm, "seed": seed, "steps": dr.STEPS, "final_score": final, "evals": evals,
                  "series": {k: [0.01] * dr.STEPS for k in dr.SERIES}, "stopped": None, "seconds": 1.0,
                  "machine": {"cpu": "test"}, "code_commit": "0" * 40}
        path = dr.run_file(out, arm, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))


def test_assembly_gives_verdicts_only_when_complete_and_the_answer_follows_them(tmp_path):
    harm = {"fp32/ppo": 0.66, "rtn4/ppo": 0.63, "rtn4/tis": 0.66, "rtn3/ppo": 0.6, "rtn3/tis": 0.65,
            "rtn2/ppo": 0.5, "rtn2/tis": 0.6}
    _write_runs(tmp_path, harm)
    summary = dr.assemble(tmp_path)["summary"]
    assert summary["complete"] and summary["runs"] == 70
    assert summary["tests"]["H1"]["verdict"] == "reproduced" and summary["tests"]["H1"]["slope"] < 0
    assert summary["tests"]["H2"]["verdict"] == "reproduced"
    assert summary["answer"].startswith("mismatch harms uncorrected RL")
    assert set(summary["secondary"]) == {f"{a} vs fp32/ppo" for a in dr.ARMS[1:]}
    flat = dict.fromkeys(harm, 0.6)
    _write_runs(tmp_path, flat)
    summary = dr.assemble(tmp_path)["summary"]
    assert summary["tests"]["H1"]["verdict"] == "not reproduced"
    assert "a smaller one could easily go unseen" in summary["answer"] and "rtn2" in summary["answer"]
    dr.run_file(tmp_path, "rtn2/tis", 29).unlink()
    summary = dr.assemble(tmp_path)["summary"]
    assert not summary["complete"] and summary["answer"] is None
    assert all(t["verdict"].startswith("pending") for t in summary["tests"].values())


def test_protocol_unchanged_since_its_commit_and_results_record_it(protocol_held):
    protocol_held(dr.PROTOCOL, dr.protocol_commit(), ROOT / "experiments/results/dose_response")


def test_quick_runs_every_arm_and_assembles(tmp_path, capsys):
    assert dr.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["summary"]["arms"]) == set(dr.ARMS)
    assert report["summary"]["complete"] is False
    capsys.readouterr()
    dr.main(["--quick", "--out", str(tmp_path)])  # finished runs are read back, not rerun
    assert "seed 20" not in capsys.readouterr().err


def test_the_summary_reads_the_study_by_its_protocol(tmp_path):
    """experiments.summary: "pending" until every arm has ten seeds; then H1 and H2 with their numbers and the
    effect each could have seen, and the study's answer."""
    from experiments import summary

    flat = dict.fromkeys(dr.ARMS, 0.6)
    _write_runs(tmp_path, flat)
    dr.run_file(tmp_path, "rtn2/tis", 29).unlink()
    rows = summary.dose_response(dr.assemble(tmp_path))
    assert [r.verdict for r in rows] == ["pending", "pending"] and "69 of 70 runs" in rows[0].numbers
    _write_runs(tmp_path, flat)
    rows = summary.dose_response(report := dr.assemble(tmp_path))
    h1, h2 = report["summary"]["tests"]["H1"], report["summary"]["tests"]["H2"]
    assert [r.verdict for r in rows] == ["not reproduced"] * 3
    assert f"{h1['mde_slope']:.4f} per dose rank" in rows[0].numbers and f"{h2['mde']:.4f}" in rows[1].numbers
    assert rows[2].numbers == report["summary"]["answer"].rstrip(".")  # the list adds the full stop
    assert summary.MDE_LABEL in rows[0].shown_numbers()
