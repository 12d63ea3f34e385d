"""Study 9's doses (experiments/dose_audit.py): the rule that turns audits into doses, and its smoke run."""

import json

import pytest
from experiments import dose_audit as da


def _row(spec, k3):
    return {"sampler": spec, "k3": k3, "k3_ci95": [k3 / 2, k3 * 2]}


def test_doses_are_the_rtn_samplers_nearest_to_k_4k_16k_on_a_log_scale():
    rows = [_row(da.Q4_0, 0.004), _row("hf:rtn5", 0.0011), _row("hf:rtn4", 0.0035), _row("hf:rtn3", 0.018),
            _row("hf:rtn2", 0.17), _row("hf:fp32", 1e-13)]
    choice = da.choose_doses(rows)
    assert [d["sampler"] for d in choice["doses"].values()] == ["hf:rtn4", "hf:rtn3", "hf:rtn2"]
    assert choice["doses"]["D2"]["target_k3"] == pytest.approx(0.016) and choice["distinct"]
    # 16K = 0.064: log-distance to 0.17 is 0.98, to 0.018 is 1.27 → rtn2
    assert choice["doses"]["D3"]["ratio_to_q4_0"] == pytest.approx(42.5)
    # a grid that cannot separate the doses is said so, not hidden
    same = da.choose_doses([_row(da.Q4_0, 0.004), _row("hf:rtn4", 0.0035), _row("hf:rtn3", 0.0036)])
    assert not same["distinct"]


def test_prompt_bootstrap_keeps_prompts_together():
    lo, hi = da.prompt_bootstrap_ci([1.0, 1.0, 1.0], [10, 10, 10])
    assert lo == hi == pytest.approx(0.1)
    lo, hi = da.prompt_bootstrap_ci([0.0, 10.0], [10, 10])
    assert lo == 0.0 and hi == 1.0


def test_quick_dose_audit_runs(tmp_path):
    assert da.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "doses.json").read_text())
    k3 = {r["sampler"]: r["k3"] for r in report["audits"]}
    assert k3["hf:rtn3"] > k3["hf:rtn4"] > 0  # fewer bits, more mismatch

