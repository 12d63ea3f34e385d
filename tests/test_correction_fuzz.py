"""Fuzz: malformed inputs always raise a clear ValueError / TypeError naming the problem, never a silent NaN."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcorr.config import CorrectionConfig, preset
from rollcorr.correction import compute_correction, metrics_to_floats

CONFIGS = [
    CorrectionConfig(),
    preset("decoupled_seq_is_rs"),
    preset("decoupled_token_icepop"),
    preset("trm_max_k2_mean_k3"),
    CorrectionConfig(is_level="geometric", batch_normalize=True, veto_threshold=1e-4),
]


def good(b=3, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(b, t, generator=g) * 3 - 0.01
    old = (roll + 0.1 * torch.randn(b, t, generator=g)).clamp(max=-1e-3)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 3:] = False
    return old, roll, mask


def corrupt(kind, pos, old, roll, mask):
    """Return (old, roll, mask, expected exception, message fragment)."""
    i, j = pos
    if kind == "nan_old":
        old = old.clone()
        old[i, j] = math.nan
        return old, roll, mask, ValueError, "old_log_prob is NaN/inf"
    if kind == "inf_roll":
        roll = roll.clone()
        roll[i, j] = -math.inf
        return old, roll, mask, ValueError, "rollout_log_prob is NaN/inf"
    if kind == "positive_old":
        old = old.clone()
        old[i, j] = 0.5
        return old, roll, mask, ValueError, "old_log_prob is positive"
    if kind == "int_dtype":
        return old.long(), roll, mask, TypeError, "old_log_prob must be a floating tensor"
    if kind == "shape":
        return old, roll[:, :-1], mask, ValueError, "rollout_log_prob has shape"
    if kind == "one_dim":
        return old[0], roll[0], mask[0], ValueError, "response_mask must be (B, T)"
    if kind == "empty_mask":
        return old, roll, torch.zeros_like(mask), ValueError, "no valid token"
    if kind == "zero_size":
        return old[:0], roll[:0], mask[:0], ValueError, "empty"
    if kind == "mask_values":
        m = mask.float()
        m[i, j] = 0.5
        return old, roll, m, ValueError, "values other than 0 and 1"
    if kind == "mask_nan":
        m = mask.float()
        m[i, j] = math.nan
        return old, roll, m, ValueError, "values other than 0 and 1"
    if kind == "not_tensor":
        return old.tolist(), roll, mask, TypeError, "old_log_prob must be a torch.Tensor"
    if kind == "complex_mask":
        return old, roll, mask.to(torch.complex64), TypeError, "response_mask must be bool"
    raise AssertionError(kind)


KINDS = ["nan_old", "inf_roll", "positive_old", "int_dtype", "shape", "one_dim", "empty_mask", "zero_size",
         "mask_values", "mask_nan", "not_tensor", "complex_mask"]


@settings(deadline=None, max_examples=60)
@given(
    st.sampled_from(KINDS), st.sampled_from(CONFIGS), st.integers(1, 2), st.integers(0, 4), st.integers(0, 99)
)
def test_malformed_inputs_raise_clearly(kind, config, i, j, seed):
    old, roll, mask, exc, fragment = corrupt(kind, (i, j), *good(seed=seed))
    with pytest.raises(exc, match=re.escape(fragment)):
        compute_correction(old, roll, mask, config)


def test_error_names_the_position():
    old, roll, mask = good()
    old[2, 4] = math.nan
    with pytest.raises(ValueError, match=r"row 2, pos 4"):
        compute_correction(old, roll, mask, CorrectionConfig())


def test_bad_optional_inputs():
    old, roll, mask = good()
    with pytest.raises(ValueError, match="log_prob has shape"):
        compute_correction(old, roll, mask, CorrectionConfig(), log_prob=old[:, :2])
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_correction(old, roll, mask, CorrectionConfig(opsm_delta=0.1), advantages=torch.zeros(7))
    with pytest.raises(ValueError, match="advantages is NaN"):
        compute_correction(old, roll, mask, CorrectionConfig(opsm_delta=0.1),
                           advantages=torch.tensor([0.0, math.nan, 1.0]))
    with pytest.raises(TypeError, match="config"):
        compute_correction(old, roll, mask, {"is_level": "token"})
    with pytest.raises(ValueError, match="old_log_prob"):
        compute_correction(None, roll, mask, CorrectionConfig())


@settings(deadline=None, max_examples=30)
@given(st.sampled_from(CONFIGS), st.integers(0, 99), st.sampled_from([math.nan, math.inf, -math.inf, 5.0]))
def test_garbage_in_padding_never_leaks(config, seed, garbage):
    old, roll, mask = good(seed=seed)
    old = torch.where(mask, old, garbage)
    roll = torch.where(mask, roll, garbage)
    res = compute_correction(old, roll, mask, config)
    assert res.is_weights is None or torch.isfinite(res.is_weights).all()
    assert all(math.isfinite(v) for v in metrics_to_floats(res.metrics).values())
