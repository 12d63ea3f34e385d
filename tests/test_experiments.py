"""Smoke tests of experiments/: the shared helpers, study 1 on its cheapest path, the training studies'
--quick mode (slow: each trains for real, ~15-60 s on the shared machine)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from conftest import EPS32, ERROR_RATIO

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments import common  # noqa: E402


def test_summary_mean_spread_and_nonfinite():
    s = common.summary([1.0, 3.0, float("nan"), None])
    assert s["mean"] == 2.0
    assert math.isclose(s["std"], math.sqrt(2.0))
    assert s["n_nonfinite"] == 2
    assert s["values"] == [1.0, 3.0, None, None]
    assert common.summary([None])["mean"] is None


def test_separated_needs_difference_beyond_spread_and_two_seeds():
    a, b = common.summary([1.0, 1.1, 0.9]), common.summary([2.0, 2.1, 1.9])
    assert common.separated(a, b)
    wide = common.summary([0.0, 2.0, 4.0])
    assert not common.separated(a, wide)
    # one seed has no spread: nothing counts as reproduced
    assert not common.separated(common.summary([1.0]), common.summary([5.0]))


def test_write_json_is_atomic_and_nan_free(tmp_path):
    path = common.write_json({"x": float("nan"), "p": tmp_path, "t": (1, 2)}, tmp_path / "a" / "r.json")
    assert json.loads(path.read_text()) == {"x": None, "p": str(tmp_path), "t": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_grid_points_and_mean_curve():
    assert common.grid_points({"a": [1, 2], "b": ["x"]}) == [["a=1", "b=x"], ["a=2", "b=x"]]
    runs = [[{"step": 1, "k": 1.0}, {"step": 2, "k": 3.0}], [{"step": 1, "k": 3.0}, {"step": 3, "k": 0.0}]]
    steps, mean, std = common.mean_curve(runs, "k")
    assert steps == [1] and mean == [2.0] and math.isclose(std[0], math.sqrt(2.0))


def test_train_config_uses_the_trainer_defaults_and_rejects_bad_keys():
    from rollcorr.train.config import ConfigError

    config = common.train_config(["trainer.steps=3"])
    assert config.trainer.steps == 3 and config.trainer.progress is False
    with pytest.raises(ConfigError, match="nonsense"):
        common.train_config(["trainer.nonsense=1"])


def test_pass_at_k_estimator():
    from experiments.oapl_lag import pass_at_k

    assert pass_at_k(16, 0, 4) == 0.0
    assert pass_at_k(16, 16, 1) == 1.0
    assert math.isclose(pass_at_k(4, 1, 1), 0.25)
    assert math.isclose(pass_at_k(4, 1, 2), 0.5)
    with pytest.raises(ValueError, match="k=8"):
        pass_at_k(4, 1, 8)


def _float64_scorer():
    """The study's fp32 scorer with its model in float64: the reference of the fp32 comparisons (inside
    conftest's ``float64_reference``)."""
    from experiments import mismatch_anatomy as ma

    learner = ma.scorer(None)
    learner.model.double()
    return learner


def _fp32_control_bounds(fp64_alone: float) -> tuple[float, float]:
    """Bounds on the study's fp32 batch-composition control from the float64 scorer's distance to the fp32
    reference scores A (its max |p64 − p_A| = ‖A − R‖∞ over the target tokens). Every fp32 scoring B of the
    same tokens is as close to R as A is (conftest.ERROR_RATIO C, floor f = 4 ε₃₂ for p ≤ 1), so
    |B − A| ≤ (C + 1) ‖A − R‖ + f, and two of them differ by ≤ 2 C ‖A − R‖ + 2 f."""
    f = 4 * EPS32
    return (ERROR_RATIO + 1) * fp64_alone + f, 2 * ERROR_RATIO * fp64_alone + 2 * f


def test_mismatch_anatomy_pieces(float64_reference):
    """The study's measurements on 4 prompts: int8 sampling disagrees with the fp32 learner, the length
    profile covers every response, and int8 scoring depends on the batch while fp32 scoring does not (its
    changes are float rounding: within the bounds a float64 scorer sets, _fp32_control_bounds)."""
    from experiments import mismatch_anatomy as ma

    from rollcorr.audit.collect import builtin_prompts
    from rollcorr.audit.stats import probability_mismatch
    from rollcorr.engines import make_sampler

    fp32 = ma.scorer(None)
    rollout, view = ma.scored(make_sampler("hf:int8"), fp32, builtin_prompts(4, 0), 6, seed=0, batch_size=4)
    assert probability_mismatch(view)["prob_diff_max"] > 1e-4
    prof = ma.length_profile(view)
    assert sum(b["n"] for b in prof["bins"]) == 4
    assert (
        prof["prefix"][0]["n"] == 4
        and prof["prefix"][0]["max_abs_diff"] >= prof["prefix"][0]["mean_abs_diff"]
    )
    targets = rollout.replace(old_log_prob=fp32.log_prob(rollout).detach())
    with float64_reference():
        comp = ma.batch_composition(targets, targets.select([0]),
                                    {"fp32": fp32, "int8": ma.scorer("int8"), "fp64": _float64_scorer()}, 4)
    to_reference, between = _fp32_control_bounds(comp["fp64"]["alone"]["max_abs_diff_to_fp32"])
    assert comp["fp32"]["alone"]["max_abs_diff_to_fp32"] <= to_reference
    assert comp["fp32"]["batch_8"]["max_change_vs_alone"] <= between
    assert comp["int8"]["alone"]["mean_abs_diff_to_fp32"] > 1e-4
    assert comp["int8"]["batch_8"]["max_change_vs_alone"] > 0  # per-tensor activation scale sees the batch


@pytest.mark.slow
def test_mismatch_anatomy_cheapest_path(tmp_path, float64_reference, monkeypatch):
    """1 seed, 4 prompts, fp32 vs int8: fp32 sampling and fp32 scoring agree to float rounding, int8 does
    not, and the batch-composition control (fp32 scored alone vs in a batch) changes nothing beyond float
    rounding. "Float rounding" is measured with a float64 scorer of the same tokens (_fp32_control_bounds)."""
    from experiments import mismatch_anatomy as ma

    fp64 = _float64_scorer()
    learner_to_float64 = {}  # sampler → max |p_learner − p64| over the task batch's tokens (seed 0)
    scored, composition = ma.scored, ma.batch_composition

    def scored_and_measured(sampler, learner, prompts, *args, **kwargs):
        rollout, view = scored(sampler, learner, prompts, *args, **kwargs)
        if len(prompts) == 4:  # the task batch (n_task = 4; the long batch has 2)
            with float64_reference():
                p64 = fp64.log_prob(rollout).exp()
            m = rollout.response_mask
            learner_to_float64[repr(sampler)] = float((rollout.old_log_prob.double().exp() - p64)[m].abs().max())
        return rollout, view

    def with_float64(targets, fillers, reference, n_alone):
        with float64_reference():
            return composition(targets, fillers, {**reference, "fp64": fp64}, n_alone)

    monkeypatch.setattr(ma, "scored", scored_and_measured)
    monkeypatch.setattr(ma, "batch_composition", with_float64)
    report = ma.run(("hf:fp32", "hf:int8"), (0,), n_task=4, n_long=2, n_batch=4, out=tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["samplers"].keys() == {"hf:fp32", "hf:int8"}
    fp32 = report["samplers"]["hf:fp32"]["table"]
    int8 = report["samplers"]["hf:int8"]["table"]
    # the fp32 sampler's decode B vs the fp32 learner A: |B − A| ≤ (C + 1) ‖A − R‖ + f (one seed: its max)
    (fp32_sampler,) = [k for k in learner_to_float64 if "float32" in k]
    assert fp32["prob_diff_max"]["mean"] <= _fp32_control_bounds(learner_to_float64[fp32_sampler])[0]
    assert int8["prob_diff_max"]["mean"] > fp32["prob_diff_max"]["mean"]
    control = report["batch_composition"]["fp32"]["batch_8"]
    fp64_alone = report["batch_composition"]["fp64"]["alone"]["max_abs_diff_to_fp32"]
    assert control["max_change_vs_alone"] <= _fp32_control_bounds(fp64_alone)[1]
    assert report["claims"]["hf:int8"]["max_grows"] is False  # one seed: no claim is "reproduced"
    for name in ("scatter_hf_int8.png", "histogram_hf_int8.png", "length.png", "table.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, arm",
    [
        ("quantised_rollouts", "int8/tis"),
        ("staleness", "lag2/ewma_reset"),
        ("oapl_lag", "oapl_sync10"),
        ("throughput", "async"),
    ],
)
def test_training_study_quick(module, arm, tmp_path, capsys):
    import importlib

    study = importlib.import_module(f"experiments.{module}")
    assert study.main(["--quick", "--arms", arm, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    runs = next(iter(report["runs"][arm].values()))["runs"]
    assert len(runs) == 1 and runs[0]["steps"] == 2 and runs[0]["stopped"] is None
    assert any("eval/accuracy" in r for r in runs[0]["records"])
    for name in report["figures"].values():
        assert (tmp_path / name).stat().st_size > 1000
    assert "wall time" in capsys.readouterr().out
    from experiments import report as tables

    table = tables.STUDIES[module](report)  # the markdown docs/results.md shows
    assert f"| {arm} |" in table and "±" in table


def test_run_arms_restricts_diagnostic_arms_to_their_grid_points(tmp_path, monkeypatch):
    """``only`` keeps an arm to the listed grid points; the others run the whole grid (the trainer is
    replaced by a recorder: this checks which runs are requested, not training)."""
    calls = []

    def record(overrides, run_dir):
        calls.append((run_dir.name, [o for o in overrides if o.startswith("optim.lr=")]))
        return {"records": [{"step": 1, "eval/accuracy": 0.5}]}

    monkeypatch.setattr(common, "train", record)
    grid = {"optim.lr": [0.0002, 0.0004]}
    results = common.run_arms({"a/x": [], "a/diag": []}, [], tmp_path / "out", seeds=[0], grid=grid,
                              only={"a/diag": ["optim.lr=0.0002"]})
    assert list(results["a/x"]) == ["optim.lr=0.0002", "optim.lr=0.0004"]
    assert list(results["a/diag"]) == ["optim.lr=0.0002"]
    assert [name for name, _ in calls] == ["a-x_0.0002_s0", "a-x_0.0004_s0", "a-diag_0.0002_s0"]


def test_finished_run_is_reused_only_for_the_same_config():
    saved = {"trainer": {"steps": 30, "seed": 0}, "algorithm": {"correction": {"preset": "tis"}}}
    current = {
        "trainer": {"steps": 30, "seed": 0, "executor": "local"},
        "algorithm": {"correction": {"preset": "tis"}},
    }
    assert common._same(saved, current)  # keys the trainer added since are ignored
    assert not common._same(saved, {**current, "trainer": {"steps": 30, "seed": 1}})
    changed = {**current, "algorithm": {"correction": {"preset": "tis", "is_upper": None}}}
    assert not common._same(saved, changed)  # the correction dict is compared whole


def test_long_mismatch_collapse_and_early_warning_rules():
    """Collapse = first evaluation ≥ 10 points below the best before it; a warning metric fires at 3× its
    median over the first 10 steps; the verdict needs every collapsed run warned strictly before."""
    from experiments import long_mismatch as lm

    def run(seed, scores, kl):
        records = [{"step": s, "rollout_corr/k3_kl": v, "rollout_corr/prob_diff_seq_max_mean": 0.1}
                   for s, v in enumerate(kl, start=1)]
        records += [{"step": s, "eval/reward": a} for s, a in scores]
        return {"seed": seed, "records": sorted(records, key=lambda r: r["step"])}

    steady = run(0, [(0, 0.3), (10, 0.5), (20, 0.55)], [1e-3] * 20)
    assert lm.collapse_step(steady["records"]) is None
    falls = run(1, [(0, 0.3), (10, 0.5), (20, 0.45), (30, 0.2)], [1e-3] * 12 + [5e-3] * 18)
    assert lm.collapse_step(falls["records"]) == 30
    assert lm.warning_step(falls["records"], "rollout_corr/k3_kl") == 13
    verdict = lm.early_warning([steady, falls])
    assert verdict["collapsed"] == 1
    assert verdict["warned_first"] == {
        "rollout_corr/k3_kl": True,
        "rollout_corr/prob_diff_seq_max_mean": False,
    }
    assert verdict["steady"] == 1 and verdict["false_alarms"]["rollout_corr/k3_kl"] == 0
    assert lm.early_warning([steady])["warned_first"]["rollout_corr/k3_kl"] is False  # nothing collapsed
    noisy = run(2, [(0, 0.3), (10, 0.5), (20, 0.55)], [1e-3] * 12 + [9e-3] + [1e-3] * 7)  # fires, no collapse
    assert lm.early_warning([noisy, falls])["false_alarms"] == {
        "rollout_corr/k3_kl": 1,
        "rollout_corr/prob_diff_seq_max_mean": 0,
    }


def test_long_mismatch_arms_and_one_learning_rate():
    """Every arm of the protocol exists, the Geo-RS band is not verl's default, and --lr is refused."""
    from experiments import long_mismatch as lm

    assert "fp32/ppo" in lm.ARM_NAMES and len(lm.ARM_NAMES) == 13
    for s in ("bf16", "int8"):
        assert {f"{s}/{m}" for m in ("ppo", "tis", "seq_mis", "icepop", "geo_rs", "seq_mis_mean")} <= set(
            lm.ARM_NAMES
        )
    assert "preset: trl_sequence_mask" in lm.METHODS["seq_mis"][0]
    assert lm.FOLLOW_UP == [f"q4_0/{m}" for m in lm.METHODS] and lm.SAMPLERS["q4_0"] == "llamacpp:q4_0"
    with pytest.raises(SystemExit):
        lm.main(["--quick", "--lr", "0.0002"])


def _has_chain_checkpoint() -> bool:
    from rollcorr.models.builtin import BUILTIN_MODELS

    return (BUILTIN_MODELS["builtin:chain"].directory / "model.safetensors").exists()


@pytest.mark.skipif(not _has_chain_checkpoint(), reason="no builtin:chain checkpoint")
def test_long_mismatch_quick(tmp_path, capsys):
    """--quick on the reference arm: 2 steps, the summary object of the issue, curves, and the run is read
    back (not retrained) by a second invocation."""
    from experiments import long_mismatch as lm

    assert lm.main(["--quick", "--arms", "fp32/ppo", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    summary = report["summary"]
    assert summary["seeds"] == 1 and summary["mean_response_length"] > 10
    assert set(summary["arms"]) == {"fp32/ppo"}
    assert set(summary["arms"]["fp32/ppo"]) == {"final_score_mean", "final_score_std"}
    runs = next(iter(report["runs"]["fp32/ppo"].values()))["runs"]
    assert len(runs) == 1 and runs[0]["steps"] == 2 and not runs[0]["reused"]
    assert any("rollout_corr/k3_kl" in r for r in runs[0]["records"])
    for name in report["figures"].values():
        assert (tmp_path / name).stat().st_size > 1000
    assert "wall time" in capsys.readouterr().out
    from experiments import report as tables

    table = tables.STUDIES["long_mismatch"](report)  # the markdown docs/results.md shows
    assert "| fp32/ppo |" in table and "±" in table
    assert lm.main(["--quick", "--arms", "fp32/ppo", "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "results.json").read_text())
    assert next(iter(again["runs"]["fp32/ppo"].values()))["runs"][0]["reused"]


def test_code_commit_names_this_checkout():
    commit = common.code_commit()
    assert commit is not None and len(commit.removesuffix("+dirty")) == 40


def test_carry_over_keeps_other_arms_in_order_and_names_their_commit(tmp_path):
    """``--keep-other-arms``: the arms of the previous results file that were not rerun stay, in the file's order;
    runs older than the code_commit field get the commit that recorded them."""
    old = {"runs": {"a": {"x": {"runs": [{"seed": 0}]}}, "b": {"x": {"runs": [{"seed": 0, "old": 1}]}}}}
    common.write_json(old, tmp_path / "results.json")
    new = {"b": {"x": {"runs": [{"seed": 0, "code_commit": "c" * 40}]}}, "z": {"x": {"runs": []}}}
    merged = common.carry_over(new, tmp_path / "results.json", "abc1234")
    assert list(merged) == ["a", "b", "z"]
    assert merged["b"] is new["b"] and merged["a"]["x"]["runs"][0]["recorded_in_commit"] == "abc1234"
    assert common.code_commits(merged) == {"a": ["abc1234"], "b": ["c" * 40], "z": []}
    with pytest.raises(FileNotFoundError, match="no previous results file"):
        common.carry_over(new, tmp_path / "missing.json")
