"""Study 10 (experiments/fp16_study.py): its ratio rule, intervals and test do what docs/fp16-study.md says, the
protocol is unchanged since the commit that added it, and --quick runs both parts."""

import json
from pathlib import Path

import pytest
from experiments import fp16_study as fs

ROOT = Path(__file__).resolve().parents[1]


def _audit(k3_per_prompt: list[float], tokens: int = 10) -> dict:
    return {"k3_sum": [k * tokens for k in k3_per_prompt], "tokens": [tokens] * len(k3_per_prompt),
            "ge_001": [1.0] * len(k3_per_prompt), "k3": sum(k3_per_prompt) / len(k3_per_prompt),
            "share_ge_0.01": 0.1}


def test_the_ratio_rule_and_its_interval():
    fp16 = _audit([1e-5, 1.2e-5, 0.9e-5, 1.1e-5] * 8)
    bf16 = _audit([3e-4, 2.8e-4, 3.1e-4, 2.9e-4] * 8)
    ratio, ci = fs.ratio_ci(fp16, bf16)
    assert ratio == pytest.approx(bf16["k3"] / fp16["k3"]) and ci[0] > 10 and ci[0] < ratio < ci[1]
    assert fs.ratio_verdict(ci) == "reproduced"
    assert fs.ratio_verdict([2.0, 40.0]) == "not reproduced"  # above 1, not shown ≥ 10
    assert fs.ratio_verdict([0.2, 0.9]) == "opposite"


def test_arms_and_seeds_are_the_protocols():
    assert fs.schedule()[:2] == [("fp16/ppo", 30), ("bf16/ppo", 30)] and len(fs.schedule()) == 20
    assert not set(fs.SEEDS) & set(range(0, 30))
    overrides = fs.arm_overrides("fp16/ppo", 150)
    assert "model.learner=hf:amp-fp16" in overrides and "model.sampler=hf:fp16" in overrides
    assert "algorithm.correction={preset: disabled}" in overrides and "trainer.steps=150" in overrides


def test_protocol_unchanged_since_its_commit_and_results_record_it(protocol_held):
    protocol_held(fs.PROTOCOL, fs.first_commit(fs.PROTOCOL), ROOT / "experiments/results/fp16_study", ("runs", "audits"))


def test_quick_runs_both_parts_and_assembles(tmp_path):
    assert fs.main(["--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert {"A:builtin", "A:builtin:moe"} <= set(summary["tests"])  # SmolLM2 needs --model
    assert not summary["complete_a"] and not summary["complete_b"]
    assert set(summary["arms"]) == set(fs.ARMS) and all(a["seeds"] == 1 for a in summary["arms"].values())


def test_the_exploratory_largest_prompt_reading(tmp_path):
    """experiments/fp16_exploratory.py: the largest fp16 prompt, its share, R with and without it."""
    import json

    from experiments.fp16_exploratory import largest_prompt, paragraph

    assert largest_prompt(audits=tmp_path) is None and "pending" in paragraph(tmp_path)
    bf16 = {"k3_sum": [1.0, 1.0, 1.0], "tokens": [10, 10, 10]}
    fp16 = {"k3_sum": [0.01, 0.9, 0.09], "tokens": [10, 10, 10]}
    for pair, audit in (("bf16", bf16), ("fp16", fp16)):
        (tmp_path / f"builtin-moe_{pair}.json").write_text(json.dumps(audit))
    found = largest_prompt(audits=tmp_path)
    assert found["prompt"] == 1 and found["share"] == pytest.approx(0.9)
    assert found["ratio"] == pytest.approx(3.0) and found["ratio_without"] == pytest.approx(2.0 / 0.1)


def test_a_ratio_verdict_shows_the_ratio_it_could_have_seen():
    """A "not reproduced" of part A carries the ratio its prompts could have shown ≥ 10× with 80 % power: on the
    log scale, the interval's lower half-width gives σ, and the detectable ratio is 10 · e^{(z₀.₉₇₅ + z₀.₈) σ}."""
    import math

    from experiments.power import detectable_ratio

    sigma = math.log(2) / 1.959964
    assert detectable_ratio(20.0, 10.0, 10.0) == pytest.approx(10 * math.exp((1.959964 + 0.841621) * sigma), rel=1e-5)
    assert detectable_ratio(5.0, 4.0, 10.0) < detectable_ratio(5.0, 1.0, 10.0)  # a wider interval sees less


def test_the_readme_paragraph_gives_part_b_its_verdict_once_complete(tmp_path):
    """experiments.summary.readme_fp16: part A's verdicts always, part B "pending" with its count until all
    twenty runs are in, then its verdict with the interval, p, the effect it could have seen, collapses,
    overflow skips and the training-time k3 of each arm."""
    from experiments import summary

    results = json.loads((ROOT / "experiments/results/fp16_study/results.json").read_text())
    s = results["summary"]
    (tmp_path / "fp16_study").mkdir()

    def paragraph(**changes):
        (tmp_path / "fp16_study" / "results.json").write_text(json.dumps({**results, "summary": {**s, **changes}}))
        return summary.readme_fp16(tmp_path)

    arms = {"fp16/ppo": {"seeds": 10, "final_score_mean": 0.6, "final_score_std": 0.04, "collapses": 0,
                         "overflow_skips": 3.0, "k3_median": 1.5e-6},
            "bf16/ppo": {"seeds": 10, "final_score_mean": 0.61, "final_score_std": 0.04, "collapses": 1,
                         "overflow_skips": 0.0, "k3_median": 1.1e-4}}
    b = {"difference": -0.01, "ci95": [-0.05, 0.03], "p_value": 0.6, "verdict": "not reproduced", "mde": 0.052}
    pending = paragraph(complete_b=False, arms={k: {**v, "seeds": 7} for k, v in arms.items()})
    assert "builtin **reproduced**" in pending and "**pending** (14 of 20 runs finished)" in pending
    done = paragraph(complete_b=True, arms=arms, tests={**s["tests"], "B": b})
    assert "**not reproduced** (fp16/ppo − bf16/ppo = -0.010, 95 % CI [-0.050, +0.030], permutation p = 0.6" in done
    assert "the test had an 80 % chance to detect an effect of 0.052" in done
    assert "sustained collapses 0 (fp16) and 1 (bf16) of ten, 3 fp16 overflow skips" in done
    assert "training-time k3 1.5e-06 (fp16) against 0.00011 (bf16)" in done
