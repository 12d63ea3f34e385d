"""verl parity: the drop-in reproduces verl's weights, masks and every metric on verl_vectors.json (float64),
and rollcorr's own mode differs from verl exactly where it says it does (K1 direction, all-padding rows,
finite k3_kl)."""

import json
import math
from pathlib import Path

import pytest
import torch

from rollcorr.compat.verl_correction import compute_rollout_correction_and_rejection_mask
from rollcorr.config import CorrectionConfig, from_verl
from rollcorr.correction import compute_correction, metrics_to_floats

VECTORS = Path(__file__).resolve().parent / "data" / "verl_vectors.json"  # verl's own outputs (docs/spec.md §9)
pytestmark = pytest.mark.skipif(not VECTORS.exists(), reason="verl_vectors.json not available")


def _cases():
    if not VECTORS.exists():
        return []
    return [c for c in json.loads(VECTORS.read_text())["cases"] if c["kind"] == "correction"]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["name"])
def test_matches_verl(case):
    proto, mask, metrics = compute_rollout_correction_and_rejection_mask(
        _t(case["old_log_prob"]),
        _t(case["rollout_log_prob"]),
        _t(case["response_mask"]),
        **case["verl_config"],
    )
    weights = None if proto is None else proto.batch["rollout_is_weights"]  # verl wraps them in a DataProto
    if case["weights"] is None:
        assert weights is None
    else:
        assert weights.dtype == torch.float64
        torch.testing.assert_close(weights, _t(case["weights"]), rtol=1e-6, atol=1e-12)
    assert torch.equal(mask, _t(case["mask"]))
    assert set(metrics) == set(case["metrics"])
    for key, expected in case["metrics"].items():
        assert metrics[key] == pytest.approx(expected, rel=1e-6, abs=1e-12), key
    kept = mask.sum() / _t(case["response_mask"]).sum()
    assert kept.item() == pytest.approx(case["kept_fraction"], rel=1e-9)


def test_verl_threshold_none_disables_is_like_verl():
    old, roll = torch.full((2, 3), -1.0), torch.full((2, 3), -1.2)
    w, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old, roll, torch.ones(2, 3), rollout_is="token", rollout_is_threshold=None
    )
    assert w is None and not any("rollout_is_" in k for k in metrics)


def test_verl_bool_mask_round_trips_as_bool():
    old, roll = torch.full((2, 3), -1.0), torch.full((2, 3), -1.2)
    _, mask, _ = compute_rollout_correction_and_rejection_mask(
        old, roll, torch.ones(2, 3, dtype=torch.bool), rollout_rs="token_k2", rollout_rs_threshold=0.5
    )
    assert mask.dtype == torch.bool


# ---- deliberate differences ------------------------------------------------------------------------
def test_k1_window_direction():
    """docs/rejection.md, K1 direction: token_k1 with "0.6_1.5" and ρ = [.55, .7, 1.45, 1.9]: verl keeps [0,1,1,0] (the ρ-window
    [1/1.5, 1/0.6]); rollcorr keeps the documented window 0.6 ≤ ρ ≤ 1.5: [0,1,1,0] too here, so use a ρ
    that separates them: 1.6 (inside verl's [0.667, 1.667], outside [0.6, 1.5]) and 0.62."""
    rho = torch.tensor([[0.55, 0.62, 1.45, 1.6, 1.9]], dtype=torch.float64)
    roll = torch.full_like(rho, -2.0)
    old = roll + rho.log()
    mask = torch.ones_like(rho)
    _, verl_mask, _ = compute_rollout_correction_and_rejection_mask(
        old, roll, mask, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.5"
    )
    assert verl_mask.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0]]
    ours = compute_correction(old, roll, mask, CorrectionConfig(rs=("token_k1",), rs_thresholds=("0.6_1.5",)))
    assert ours.kept_mask.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]


def test_geo_rs_recipe_window():
    """docs/rejection.md, K1 direction: seq_mean_k1 "0.99_1.001" with ρ_geo = [0.995, 0.9985, 1.0005, 1.005, 1.02]:
    verl keeps [0,0,1,1,0]; the intended window [0.99, 1.001] keeps [1,1,1,0,0]."""
    geo = torch.tensor([0.995, 0.9985, 1.0005, 1.005, 1.02], dtype=torch.float64)
    roll = torch.full((5, 4), -1.5, dtype=torch.float64)
    old = roll + geo.log()[:, None]
    mask = torch.ones_like(roll)
    cfg = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.99_1.001"}
    _, verl_mask, _ = compute_rollout_correction_and_rejection_mask(old, roll, mask, **cfg)
    assert verl_mask[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
    ours = compute_correction(old, roll, mask, from_verl(cfg))
    assert ours.kept_mask[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_all_padding_rows_excluded_from_sequence_metrics():
    """docs/metrics.md (verl bias): one real row with Σℓ = 1 plus one all-padding row: verl chi2_seq = 3.19, rollcorr 6.39."""
    old = torch.tensor([[-1.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    roll = torch.tensor([[-1.5, -1.5], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    _, _, verl = compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is="sequence")
    ours = metrics_to_floats(
        compute_correction(old, roll, mask, CorrectionConfig(is_level="sequence")).metrics
    )
    assert verl["rollout_corr/chi2_seq"] == pytest.approx((math.exp(2) + 1) / 2 - 1)
    assert ours["rollout_corr/chi2_seq"] == pytest.approx(math.exp(2) - 1)
    assert verl["rollout_corr/training_ppl"] == pytest.approx((math.e + 1) / 2)
    assert ours["rollout_corr/training_ppl"] == pytest.approx(math.e)
    assert verl["rollout_corr/rollout_is_seq_mean"] == pytest.approx(1.0)  # (2 + 0) / 2: pad row weight 0
    assert ours["rollout_corr/rollout_is_seq_mean"] == pytest.approx(2.0)


def test_k3_kl_is_finite():
    """docs/metrics.md (verl bias): a log-ratio of 100 gives verl k3_kl = inf (float32); rollcorr clamps ℓ to ±20 first."""
    old = torch.tensor([[-1.0, -1.0]])
    roll = torch.tensor([[-101.0, -1.0]])
    mask = torch.ones_like(old)
    _, _, verl = compute_rollout_correction_and_rejection_mask(old, roll, mask)
    assert math.isinf(verl["rollout_corr/k3_kl"])
    ours = metrics_to_floats(compute_correction(old, roll, mask, CorrectionConfig()).metrics)
    assert math.isfinite(ours["rollout_corr/k3_kl"])
    assert ours["rollout_corr/k3_kl"] == pytest.approx((math.exp(20) - 21) / 2, rel=1e-5)
