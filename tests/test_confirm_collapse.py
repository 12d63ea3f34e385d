"""Study 7 (experiments/confirm_collapse.py): its statistics and rules do what docs/confirm-collapse.md says,
its protocol is unchanged since the commit that added it, and its --quick path runs."""

import json
import math
from pathlib import Path

import pytest
from experiments import confirm_collapse as cc

ROOT = Path(__file__).resolve().parents[1]


def test_exact_permutation_p_on_a_hand_case():
    # a = (1, 2), b = (3, 4): of the 6 splits of {1,2,3,4} into two pairs, |mean difference| ≥ 2 for 2 of them
    assert cc.permutation_p([1, 2], [3, 4]) == pytest.approx(2 / 6)
    assert cc.permutation_p([1, 1, 1], [1, 1, 1]) == 1.0
    # completely separated arms of ten: only the two extreme splits reach the observed difference
    assert cc.permutation_p(list(range(10, 20)), list(range(10))) == pytest.approx(2 / math.comb(20, 10))


def test_holm_is_step_down_and_monotone():
    assert cc.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert cc.holm([0.5]) == [0.5]
    assert cc.holm([0.4, 0.4]) == [0.8, 0.8]


def test_verdict_follows_the_adjusted_p_and_the_sign():
    assert cc.verdict(0.1, 0.01) == "reproduced"
    assert cc.verdict(-0.1, 0.01) == "opposite"
    assert cc.verdict(0.1, 0.2) == "not reproduced"
    assert cc.verdict(0.1, 0.05) == "not reproduced"  # strictly below α


def test_fisher_one_sided_matches_the_hypergeometric_tail():
    # 2 of 3 collapse against 0 of 3: P(X ≥ 2) with 2 collapses among 6 runs, 3 drawn = 3/15 = 0.2
    assert cc.fisher_one_sided(2, 3, 0, 3) == pytest.approx(0.2)
    assert cc.fisher_one_sided(0, 10, 0, 10) == 1.0
    assert cc.fisher_one_sided(10, 10, 0, 10) == pytest.approx(1 / math.comb(20, 10))


def test_bootstrap_intervals_cover_the_difference_and_are_reproducible():
    a, b = [0.6, 0.62, 0.65, 0.7, 0.66], [0.5, 0.4, 0.55, 0.6, 0.45]
    lo, hi = cc.difference_ci(a, b)
    assert lo < 0.626 - 0.5 < hi and lo > 0
    assert cc.difference_ci(a, b) == [lo, hi]  # fixed generator seed
    lo, hi = cc.mean_ci(a)
    assert lo <= sum(a) / len(a) <= hi


def test_sustained_collapse_needs_two_consecutive_drops_or_ending_below_the_start():
    dip_and_recover = [(0, 0.476), (25, 0.5), (50, 0.345), (75, 0.491), (100, 0.55)]
    assert cc.sustained_collapse(dip_and_recover) is None  # study 6's one-evaluation dip is not a collapse
    assert cc.sustained_collapse([(0, 0.4), (25, 0.6), (50, 0.45), (75, 0.49), (100, 0.6)]) == 50
    assert cc.sustained_collapse([(0, 0.4), (25, 0.42), (50, 0.39)]) == 50  # ends below its start
    assert cc.sustained_collapse([(0, 0.4), (25, 0.6), (50, 0.65)]) is None


def test_warning_uses_absolute_values_so_a_negative_median_does_not_fire_at_once():
    noise = [-1e-9, -2e-9, -1e-9, -1.5e-9, -1e-9, -1e-9, -2e-9, -1e-9, -1e-9, -1e-9]
    assert cc.warning_step(noise + [-1.2e-9] * 20) is None  # "3 × a negative median" would fire at step 11
    assert cc.warning_step(noise + [-1e-9] * 5 + [1e-8] + [0.0] * 5) == 16
    assert cc.warning_step([1.0] * 5) is None  # shorter than the baseline


def test_early_warning_counts_hits_false_alarms_and_refuses_to_judge_few_collapses():
    def run(arm, evals, metric_jump_at=None, steps=60):
        values = [0.01] * steps
        if metric_jump_at:
            values[metric_jump_at - 1 :] = [0.1] * (steps - metric_jump_at + 1)
        return {"arm": arm, "seed": 0, "evals": evals,
                "series": {cc.REWARD: [0.5] * steps, **{k: values for k in cc.WARNING_KEYS}}}

    collapsing = [(0, 0.4), (25, 0.6), (50, 0.3), (60, 0.3)]
    steady = [(0, 0.4), (25, 0.5), (50, 0.6), (60, 0.6)]
    runs = [run("q4_0/ppo", collapsing, 20), run("q4_0/ppo", steady), run("fp32/ppo", collapsing, 12)]
    result = cc.early_warning(runs)
    assert len(result["runs"]) == 2  # the fp32 run is not judged
    m = result["metrics"][cc.WARNING_KEYS[0]]
    assert (m["hits"], m["collapsed"], m["false_alarms"], m["steady"]) == (1, 1, 0, 1)
    assert m["verdict"].startswith("not judged")
    many = (
        [run("q4_0/ppo", collapsing, 20)] * 3 + [run("bf16/ppo", steady, 30)] + [run("bf16/ppo", steady)] * 4
    )
    m = cc.early_warning(many)["metrics"][cc.WARNING_KEYS[0]]
    assert (m["hits"], m["false_alarms"], m["verdict"]) == (3, 1, "useful")  # 1 false alarm of 5 ≤ 20 %
    m = cc.early_warning(many + [run("bf16/ppo", steady, 30)])["metrics"][cc.WARNING_KEYS[0]]
    assert m["verdict"] == "not useful"  # 2 of 6 > 20 %


def test_schedule_is_seed_major_with_ten_fresh_seeds_and_the_ladder_is_fixed():
    order = cc.schedule(1)
    assert len(order) == 60 and order[:6] == [(arm, 10) for arm in cc.RUNGS[1][1]]
    assert set(cc.SEEDS) == set(range(10, 20)) and not set(cc.SEEDS) & {0, 1, 2}
    assert cc.RUNGS[2] == (300, ("fp32/ppo", "q4_0/ppo", "q4_0/tis"))
    rung1 = {"complete": True, "tests": {"fp32/ppo vs q4_0/ppo": {"verdict": "not reproduced"}}}
    assert cc.rung2_called(rung1) is True
    assert cc.rung2_called({**rung1, "tests": {"fp32/ppo vs q4_0/ppo": {"verdict": "reproduced"}}}) is False
    assert cc.rung2_called({**rung1, "complete": False}) is None


def test_protocol_unchanged_since_its_commit_and_results_record_it(protocol_held):
    protocol_held(cc.PROTOCOL, cc.protocol_commit(), ROOT / "experiments/results/confirm_collapse")


def test_quick_runs_every_rung1_arm_and_assembles(tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="the q4_0 arms need llama-cpp-python")
    assert cc.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["summary"]["arms"]) == set(cc.RUNGS[1][1])
    assert all(a["seeds"] == 1 for a in report["summary"]["arms"].values())
    assert report["summary"]["complete"] is False and report["summary"]["rung2_called"] is None
    assert len(list((tmp_path / "runs").glob("*.json"))) == 6
    capsys.readouterr()  # forget the first call's output
    cc.main(["--quick", "--out", str(tmp_path)])  # finished runs are read back, not rerun
    assert "rung 1" not in capsys.readouterr().err


def _write_runs(out: Path, rung: int, scores: dict[str, float]) -> None:
    """Run files as ``one_run`` writes them, each arm's ten seeds ending near ``scores[arm]`` (no collapse, flat
    warning metrics): the inputs of ``assemble`` without training."""
    steps = cc.RUNGS[rung][0]
    for arm, seed in cc.schedule(rung):
        final = scores[arm] + 0.001 * (seed - 10)
        evals = [[0, 0.3]] + [[s, final] for s in range(25, steps + 1, 25)]
        record = {"rung": rung, "arm": arm, "seed": seed, "steps": steps, "final_score": cc.final_score(evals),
                  "evals": evals, "series": {key: [0.5] * steps for key in cc.SERIES}, "machine": {"cpu": "test"},
                  "code_commit": "0" * 40}
        path = cc.run_file(out, rung, arm, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))


def test_the_docs_state_each_rung_as_its_rule_gives_it(tmp_path):
    """The summary rows and the README sentence follow results.json through the ladder: rung 1's verdicts, then
    rung 2 pending when rung 1's first comparison is not reproduced, then rung 2's verdicts."""
    from experiments import summary

    out = tmp_path / "confirm_collapse"
    flat = {"fp32/ppo": 0.6, "q4_0/ppo": 0.6, "q4_0/tis": 0.7, "q4_0/icepop": 0.6, "fp16/ppo": 0.6, "bf16/ppo": 0.6}
    _write_runs(out, 1, flat)
    report = cc.assemble(out)
    rows = summary.confirm_collapse(report)
    verdicts = {row.claim.removeprefix("confirmatory: "): row.verdict for row in rows if row.study == "7"}
    assert verdicts["token TIS repairs it"] == "reproduced"
    assert verdicts["a 4-bit sampler makes uncorrected GRPO learn worse on 70-token answers"] == "not reproduced"
    rung2 = [row for row in rows if row.study.startswith("7 (rung 2")]
    assert [row.verdict for row in rung2] == ["pending", "pending"] and "0 of 30" in rung2[0].numbers
    readme = summary.readme_confirmatory(tmp_path)
    assert '"token TIS repairs it" is **reproduced** (q4_0/tis − q4_0/ppo = +0.100' in readme
    assert "Rung 2 (300 steps, run because the first comparison of rung 1 is not reproduced): **pending**" in readme

    _write_runs(out, 2, {"fp32/ppo": 0.7, "q4_0/ppo": 0.5, "q4_0/tis": 0.5})
    report = cc.assemble(out)
    rung2 = [row for row in summary.confirm_collapse(report) if row.study.startswith("7 (rung 2")]
    assert [row.verdict for row in rung2] == ["reproduced", "not reproduced", summary.OBSERVATION]
    assert rung2[0].note == "rung 2 ran because rung 1's first comparison is not reproduced"  # runs → ran
    assert "fp32/ppo vs q4_0/tis: +0.200" in rung2[-1].numbers
    assert '"a 4-bit sampler makes uncorrected GRPO learn worse on 70-token answers" is **reproduced** (fp32/ppo' in (
        summary.readme_confirmatory(tmp_path).split("Rung 2")[1]
    )


def test_the_studys_answer_is_stated_only_where_the_ladder_defines_one(tmp_path):
    """The protocol defines the study's answer in one case: rung 2 does not separate fp32/ppo from q4_0/ppo
    either → "not reproduced at 150 and at 300 steps". Then a summary row and the README say so; while rung 2
    is pending, or when it separates, neither does (each rung's verdicts are the report)."""
    from experiments import summary

    out = tmp_path / "confirm_collapse"
    _write_runs(out, 1, {"fp32/ppo": 0.6, "q4_0/ppo": 0.6, "q4_0/tis": 0.6, "q4_0/icepop": 0.6, "fp16/ppo": 0.6,
                         "bf16/ppo": 0.6})
    assert summary.study_answer(cc.assemble(out)["summary"]) is None  # rung 2 called, not run
    _write_runs(out, 2, {"fp32/ppo": 0.6, "q4_0/ppo": 0.6, "q4_0/tis": 0.6})
    report = cc.assemble(out)
    assert summary.study_answer(report["summary"]) == "not reproduced"
    answer = [row for row in summary.confirm_collapse(report) if row.study == "7 (its answer)"]
    assert len(answer) == 1 and answer[0].verdict == "not reproduced" and "at 150 and at 300 steps" in answer[0].numbers
    assert "The study's answer: **not reproduced** — neither rung separates" in summary.readme_confirmatory(tmp_path)

    _write_runs(out, 2, {"fp32/ppo": 0.7, "q4_0/ppo": 0.5, "q4_0/tis": 0.5})  # rung 2 separates: no answer row
    report = cc.assemble(out)
    assert summary.study_answer(report["summary"]) is None
    assert not [row for row in summary.confirm_collapse(report) if row.study == "7 (its answer)"]
    assert "The study's answer" not in summary.readme_confirmatory(tmp_path)


def test_no_rung_2_when_rung_1_reproduces_the_claim(tmp_path):
    from experiments import summary

    out = tmp_path / "confirm_collapse"
    _write_runs(out, 1, {"fp32/ppo": 0.7, "q4_0/ppo": 0.5, "q4_0/tis": 0.5, "q4_0/icepop": 0.5, "fp16/ppo": 0.6,
                         "bf16/ppo": 0.6})
    report = cc.assemble(out)
    assert report["summary"]["rung2_called"] is False
    rows = summary.confirm_collapse(report)
    assert {row.study for row in rows} == {"7"} and rows[0].verdict == "reproduced"
    assert rows[-1].verdict == summary.OBSERVATION and "Early warning: prob_diff_seq_max_mean: not judged" in rows[-1].numbers
    assert "Rung 2" not in summary.readme_confirmatory(tmp_path)
    with pytest.raises(SystemExit):  # the ladder refuses rung 2 here
        cc.main(["--rung", "2", "--out", str(out)])


def _seconds_span(values: list[float]) -> str:
    """"low–high" wall seconds as docs/results.md writes them (thousands with a thin space)."""
    low, high = (f"{round(x):,}".replace(",", " ") for x in (min(values), max(values)))
    return f"{low}–{high}"


def test_the_hand_written_prose_on_each_rung_agrees_with_the_results():
    """docs/results.md's paragraph on rung 1 and its wall-time row say what the results and run files hold; once
    rung 2 is complete, its paragraph and wall times too."""
    from experiments import summary

    report = json.loads((ROOT / "experiments/results/confirm_collapse/results.json").read_text())
    s = report["summary"]
    text = (ROOT / "docs/results.md").read_text()
    if not s["complete"]:
        pytest.skip("rung 1 is not complete: no paragraph to check")
    assert "**Rung 1 is complete**" in text
    assert {t["verdict"] for t in s["tests"].values()} == {"not reproduced"}  # "none of the four separates"
    first = s["tests"]["fp32/ppo vs q4_0/ppo"]
    assert first["difference"] > 0 and first["ci95"][0] < 0 < first["ci95"][1] and first["p_holm"] > 0.05
    assert all(a["collapses"] == 0 for a in s["arms"].values())  # "no run of any arm has a sustained collapse"
    assert s["rung2_called"] is True and len(report["machines"]) == 1 and report["code_commits"] == [s["protocol_commit"]]
    # "by study 6's looser criterion ... 2 of the 30 rung-1 q4_0 runs dip (q4_0/tis seed 15, q4_0/icepop seed 18)
    # and 0 of the 30 fp32, fp16 and bf16 runs" (study 6's collapse_step: one evaluation ≥ 0.10 below the best)
    from experiments.long_mismatch import collapse_step

    dipped: dict[str, list[str]] = {"q4_0": [], "other": []}
    for path in sorted((ROOT / "experiments/results/confirm_collapse/runs").glob("rung1_*.json")):
        run = json.loads(path.read_text())
        records = [{"step": step, "eval/reward": score} for step, score in run["evals"]]
        if collapse_step(records) is not None:
            dipped["q4_0" if run["arm"].startswith("q4_0") else "other"].append(f"{run['arm']} seed {run['seed']}")
    rung1 = " ".join(text[text.index("**Rung 1 is complete**") :].split("\n\n")[0].split())
    assert not dipped["other"] and f"{len(dipped['q4_0'])} of the 30 rung-1 q4_0 runs dip" in rung1
    assert f"({', '.join(sorted(dipped['q4_0'], key=lambda x: int(x.split()[-1])))})" in rung1, dipped
    seconds: dict[str, list[float]] = {"fp32 and q4_0": [], "fp16 and bf16": []}
    for path in (ROOT / "experiments/results/confirm_collapse/runs").glob("rung1_*.json"):
        run = json.loads(path.read_text())
        seconds["fp16 and bf16" if run["arm"].split("/")[0] in ("fp16", "bf16") else "fp32 and q4_0"].append(run["seconds"])
    for group, values in seconds.items():
        assert f"{group} runs {_seconds_span(values)} s" in text, (group, _seconds_span(values))
    rung2 = s.get("rung2", {"complete": False})
    if rung2["complete"]:  # then its own paragraph and its wall times, from its run files
        assert "**Rung 2 is complete**" in text
        values = [json.loads(path.read_text())["seconds"]
                  for path in (ROOT / "experiments/results/confirm_collapse/runs").glob("rung2_*.json")]
        assert f"rung 2: runs {_seconds_span(values)} s" in text, _seconds_span(values)
        paragraph = text[text.index("**Rung 2 is complete**") :].split("\n\n")[0]
        first, tis = rung2["tests"]["fp32/ppo vs q4_0/ppo"], rung2["tests"]["q4_0/tis vs q4_0/ppo"]
        # "neither comparison separates ... the ladder gives the study's answer"
        assert first["verdict"] == tis["verdict"] == "not reproduced" and summary.study_answer(s) == "not reproduced"
        # "ends 0.050 below fp32 (0.037 at 150 steps) ... interval just above zero ... p = 0.062, and 0.124 after Holm"
        assert first["ci95"][0] > 0 and first["p_value"] > 0.05 and first["p_holm"] > 0.05
        quoted = [f"{first['difference']:.3f} below fp32", f"({s['tests']['fp32/ppo vs q4_0/ppo']['difference']:.3f} at 150",
                  f"p = {first['p_value']:.3f}, and {first['p_holm']:.3f} after", f"TIS ends {tis['difference']:.3f}"]
        assert all(q in " ".join(paragraph.split()) for q in quoted), quoted
        assert first["ci95"][1] < 0.1 + 0.005 and tis["ci95"][0] < 0  # "up to about 0.1"; "reaching below zero"
        # "one run of the whole study has a sustained collapse: q4_0/ppo seed 13 ..." (rung 1 has none: above);
        # the arms count every arm's collapses, the early-warning table names the mismatched arms' runs
        assert {arm: a["collapses"] for arm, a in rung2["arms"].items() if a["collapses"]} == {"q4_0/ppo": 1}
        collapsed = [w for w in report["rung1"]["early_warning"]["runs"] + rung2["early_warning"]["runs"]
                     if w["collapse_step"] is not None]
        assert [(w["arm"], w["seed"]) for w in collapsed] == [("q4_0/ppo", 13)] and first["collapse_fisher_p"] == 0.5
        run = json.loads((ROOT / "experiments/results/confirm_collapse/runs/rung2_q4_0-ppo_s13.json").read_text())
        evals = dict(run["evals"])  # [step, score] pairs
        assert f"{evals[25]:.3f} at step 25 to {evals[75]:.3f} at step 75 and recovered to {evals[300]:.3f}" in (
            " ".join(paragraph.split()))
        # "k3 fired before that collapse but also in all 19 ... runs without one; the max-|Δp| metric only after it"
        k3, dp = (rung2["early_warning"]["metrics"][f"rollout_corr/{m}"] for m in ("k3_kl", "prob_diff_seq_max_mean"))
        assert k3["hits"] == 1 and k3["false_alarms"] == k3["steady"] == 19 and dp["hits"] == 0
        assert collapsed[0]["rollout_corr/prob_diff_seq_max_mean"] > collapsed[0]["collapse_step"]
        # the exploratory paragraph's sample size: normal approximation, α = 0.025 two-sided, 80 % power
        from statistics import NormalDist

        sd = ((rung2["arms"]["fp32/ppo"]["final_score_std"] ** 2 + rung2["arms"]["q4_0/ppo"]["final_score_std"] ** 2) / 2) ** 0.5
        z = NormalDist().inv_cdf(1 - 0.025 / 2) + NormalDist().inv_cdf(0.8)
        seeds = math.ceil(2 * (z * sd / first["difference"]) ** 2)
        exploratory = " ".join(text[text.index("**Exploratory (written after the results") :].split("\n\n")[0].split())
        assert f"pooled: {sd:.3f})" in exploratory and f"about {seeds} seeds per arm" in exploratory, (sd, seeds)
        assert f"difference of {first['difference']:.3f}, rung 2's estimate" in exploratory
        readme = " ".join((ROOT / "README.md").read_text().split())
        runs1 = summary.finished_runs(s)
        assert f"Study 7 is complete ({runs1} runs at 150 steps, {rung2['runs']} at 300)" in readme


def test_rung_2_is_called_and_named_when_rung_1_gives_the_opposite(tmp_path):
    from experiments import summary

    out = tmp_path / "confirm_collapse"
    _write_runs(out, 1, {"fp32/ppo": 0.5, "q4_0/ppo": 0.7, "q4_0/tis": 0.7, "q4_0/icepop": 0.7, "fp16/ppo": 0.6,
                         "bf16/ppo": 0.6})
    report = cc.assemble(out)
    assert report["summary"]["rung2_called"] is True
    rung2 = [row for row in summary.confirm_collapse(report) if row.study.startswith("7 (rung 2")]
    assert rung2 and all(row.note == "rung 2 runs because rung 1's first comparison is opposite" for row in rung2)
    assert "Rung 2 (300 steps, run because the first comparison of rung 1 is opposite): **pending**" in (
        summary.readme_confirmatory(tmp_path)
    )
