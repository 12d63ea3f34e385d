"""Study 11 (experiments/correction_study.py): its statistics and rules do what docs/correction-study.md says,
its protocol is unchanged since the commit that added it, and --quick runs every arm."""

import itertools
import json
import statistics
from pathlib import Path

import pytest
from experiments import correction_study as cs
from experiments import power

ROOT = Path(__file__).resolve().parents[1]


def brute_force_p(a, b):
    """Every split of the pooled values, enumerated one by one (the slow, obvious way)."""
    pooled, na = [*a, *b], len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b)) - 1e-12
    hits = total = 0
    for chosen in itertools.combinations(range(len(pooled)), na):
        rest = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        total += 1
        hits += abs(statistics.fmean(pooled[i] for i in chosen) - statistics.fmean(rest)) >= observed
    return hits / total


@pytest.mark.parametrize(("na", "nb", "shift"), [(6, 5, 0.0), (7, 7, 0.08), (5, 8, 0.3), (4, 4, 1.0)])
def test_exact_permutation_p_counts_every_split(na, nb, shift):
    g = [((i * 37 + 11) % 23) / 50 for i in range(na + nb)]
    a, b = [x + shift for x in g[:na]], g[na:]
    assert cs.exact_permutation_p(a, b) == pytest.approx(brute_force_p(a, b), abs=1e-15)


def test_exact_permutation_p_at_the_studys_size():
    # 15 vs 15 with every value of one arm above the other: only the observed split and its mirror reach it
    a, b = [0.5 + 0.01 * i for i in range(15)], [0.1 + 0.01 * i for i in range(15)]
    assert cs.exact_permutation_p(a, b) == pytest.approx(2 / 155_117_520)
    assert cs.exact_permutation_p(b, b) == 1.0  # no difference: every split is at least as far


def test_fisher_two_sided_matches_the_textbook_values():
    assert cs.fisher_two_sided(3, 4, 1, 4) == pytest.approx(0.4857, abs=1e-4)  # Fisher's tea tasting
    assert cs.fisher_two_sided(8, 10, 1, 6) == pytest.approx(0.03497, abs=1e-4)
    assert cs.fisher_two_sided(0, 15, 0, 15) == 1.0
    assert cs.fisher_two_sided(8, 10, 1, 6) == pytest.approx(cs.fisher_two_sided(1, 6, 8, 10))  # symmetric


def test_gap_recovered_is_the_share_of_the_fp32_gap():
    fp32, ppo = [0.6, 0.62, 0.64], [0.2, 0.22, 0.24]
    full, none, half = [0.6, 0.62, 0.64], [0.2, 0.22, 0.24], [0.4, 0.42, 0.44]
    assert cs.gap_recovered(full, ppo, fp32)["share"] == pytest.approx(1.0)
    assert cs.gap_recovered(none, ppo, fp32)["share"] == pytest.approx(0.0)
    result = cs.gap_recovered(half, ppo, fp32)
    assert result["share"] == pytest.approx(0.5) and result["ci95"][0] < 0.5 < result["ci95"][1]


def test_primary_family_is_four_tests_against_tis_with_holm_and_the_mde():
    scores = {arm: [0.3 + 0.01 * (i % 5) for i in range(15)] for arm in (*cs.PRIMARY_ARMS, *cs.SECONDARY_ARMS)}
    scores["rtn2/removed"] = [x + 0.3 for x in scores["rtn2/tis"]]
    scores["rtn2/seq_mis"] = [x - 0.2 for x in scores["rtn2/tis"]]
    tests = cs.primary_tests(scores, complete=True)
    assert list(tests) == [f"rtn2/{m} vs rtn2/tis" for m in cs.ALTERNATIVES]
    assert tests["rtn2/removed vs rtn2/tis"]["verdict"] == "better than token TIS"
    assert tests["rtn2/seq_mis vs rtn2/tis"]["verdict"] == "worse than token TIS"
    assert tests["rtn2/icepop vs rtn2/tis"]["verdict"] == "not separated from token TIS"
    a, b = scores["rtn2/icepop"], scores["rtn2/tis"]
    assert tests["rtn2/icepop vs rtn2/tis"]["mde"] == pytest.approx(power.mde_two_sample(a, b, 0.05, 4))
    ps = [t["p_value"] for t in tests.values()]
    assert [t["p_holm"] for t in tests.values()] == pytest.approx(cs.holm(ps))
    assert cs.primary_tests(scores, complete=False)["rtn2/removed vs rtn2/tis"]["verdict"].startswith("pending")
    said = cs.answer(tests, complete=True)
    assert said.startswith("at rtn2, rtn2/removed scores above token TIS by 0.300") and "rtn2/seq_mis scores below" in said


def test_schedule_is_the_protocols_order_and_arms():
    plan = cs.schedule()
    assert len(plan) == 7 * 15 + 6 * 10 == 165
    assert plan[:7] == [(arm, 40) for arm in cs.PRIMARY_ARMS]  # seed-major, primary block first
    assert {seed for _, seed in plan[:105]} == set(range(40, 55)) and plan[105] == ("rtn3/ppo", 40)
    assert cs.arm_overrides("rtn2/removed", 300)[-3:] == ["model.sampler=hf:rtn2", "model.learner=hf:rtn2",
                                                          "algorithm.correction={preset: disabled}"]
    assert "model.learner=hf:fp32" in cs.arm_overrides("rtn3/icepop", 300)


def test_protocol_unchanged_since_its_commit_and_results_record_it(protocol_held):
    protocol_held(cs.PROTOCOL, cs.protocol_commit(), ROOT / "experiments/results/correction_study")


@pytest.mark.slow
def test_quick_runs_every_arm_and_assembles(tmp_path, capsys):
    assert cs.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    summary = report["summary"]
    assert set(summary["arms"]) == {*cs.PRIMARY_ARMS, *cs.SECONDARY_ARMS} and summary["complete"] is False
    assert summary["arms"]["rtn2/removed"]["training_k3_median"] < 1e-4  # the mismatch removed
    assert summary["arms"]["rtn2/ppo"]["training_k3_median"] > 1e-2
    assert summary["arms"]["rtn2/tis"]["served_score_mean"] is not None and "served_score_mean" in summary["arms"]["fp32/ppo"]
    capsys.readouterr()
    cs.main(["--quick", "--out", str(tmp_path)])  # finished runs are read back, not rerun
    assert "seed 40" not in capsys.readouterr().err
