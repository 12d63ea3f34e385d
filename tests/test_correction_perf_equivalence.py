"""The fast paths of the correction's plain-torch pass give bit-identical results to the general ones.

make_tokens masks by multiplication and skips the ±bound clamp when validated inputs allow it; the
general path (``validate=False``, or garbage in the padding) masks with ``torch.where`` and always clamps.
compute_correction reuses its own (B, T) buffers in place: the caller's tensors must never change.
"""

import dataclasses
import math

import pytest
import torch

from rollcorr.config import CorrectionConfig, preset
from rollcorr.correction import compute_correction, metrics
from rollcorr.correction.ratios import any_per_row, make_tokens

pytestmark = pytest.mark.usefixtures("plain_torch")  # the plain-torch pass's fast paths (test_correction_native.py
# compares the built kernel with it)

CONFIGS = [
    preset("disabled"),
    preset("decoupled_token_is"),
    preset("decoupled_token_icepop"),
    preset("decoupled_seq_is_rs"),
    preset("decoupled_geo_rs_token_tis"),
    preset("decoupled_k3_rs_seq_tis"),
    preset("trm_max_k2_mean_k3"),
    preset("slime_veto"),
    preset("bypass_pg_is"),
    CorrectionConfig(
        is_level="token",
        is_mode="mask",
        is_upper=2.0,
        is_lower=0.5,
        rs=("token_k1", "token_k2", "seq_max_k3", "seq_sum_k2", "seq_mean_k1"),
        rs_thresholds=("0.5_2.0", 0.5, 0.5, 3.0, "0.9_1.1"),
        veto_threshold=1e-3,
        veto_upper=50.0,
    ),
    CorrectionConfig(is_level="geometric", batch_normalize=True, trm_max_k2=0.1, opsm_delta=0.0),
    CorrectionConfig(is_level="sequence", is_lower=0.5, sampler_distribution="full"),
]
CONFIGS += [dataclasses.replace(c, verl_compat=True) for c in CONFIGS[:4]]


def _batch(dtype, noise=0.3, b=6, t=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4 - 1e-3
    old = (roll + noise * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None] < lengths[:, None]
    mask[1, 1] = False  # a hole inside a response
    extra = {
        "log_prob": (old + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-5),
        "advantages": torch.randn(b, generator=g, dtype=torch.float64),
        "log_kept_mass": -0.1 * torch.rand(b, t, generator=g, dtype=torch.float64),
    }
    cast = {k: v.to(dtype) for k, v in extra.items()}
    return old.to(dtype), roll.to(dtype), mask, cast


def _call(config, old, roll, mask, extra, **kw):
    lp = extra["log_prob"]
    return compute_correction(
        old, roll, mask, config, lp,
        advantages=extra["advantages"] if config.opsm_delta is not None else None,
        log_kept_mass=extra["log_kept_mass"] if config.sampler_distribution == "full" else None,
        **kw,
    )


def _assert_identical(a, b):
    assert torch.equal(a.kept_mask, b.kept_mask) and a.kept_mask.dtype == b.kept_mask.dtype
    assert (a.is_weights is None) == (b.is_weights is None)
    if a.is_weights is not None:
        assert a.is_weights.dtype == b.is_weights.dtype and torch.equal(a.is_weights, b.is_weights)
    assert list(a.metrics) == list(b.metrics)
    for key in a.metrics:
        x, y = a.metrics[key], b.metrics[key]
        assert x.dtype == y.dtype, key
        assert torch.equal(x, y) or (x.isnan() & y.isnan()).all(), (key, x.item(), y.item())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.is_level}-{c.rs}-{c.verl_compat}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("noise", [0.3, 30.0])  # 30: |ℓ| exceeds the ±20 bound, the clamp is needed
def test_fast_path_matches_general_path(config, dtype, noise):
    old, roll, mask, extra = _batch(dtype, noise)
    fast = _call(config, old, roll, mask, extra)
    general = _call(config, old, roll, mask, extra, validate=False)
    _assert_identical(fast, general)


@pytest.mark.parametrize("config", CONFIGS[:6], ids=lambda c: f"{c.is_level}-{c.rs}")
@pytest.mark.parametrize("pad", [math.nan, math.inf, 5.0])
def test_garbage_padding_gives_the_same_result(config, pad):
    old, roll, mask, extra = _batch(torch.float32)
    clean = _call(config, old, roll, mask, extra)
    dirty = _call(config, torch.where(mask, old, pad), torch.where(mask, roll, -pad), mask, extra)
    _assert_identical(clean, dirty)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.is_level}-{c.rs}-{c.verl_compat}")
def test_inputs_are_never_modified(config):
    old, roll, mask, extra = _batch(torch.float64)  # float64: no dtype conversion copy to hide aliasing
    before = [x.clone() for x in (old, roll, mask, *extra.values())]
    for cfg in (config, dataclasses.replace(config, mode="bypass")):
        _call(cfg, old, roll, mask, extra)
        _call(cfg, old, roll, mask, extra, validate=False)
    for x, y in zip((old, roll, mask, *extra.values()), before):
        assert torch.equal(x, y)


def test_masked_reductions_match_their_definitions():
    old, roll, mask, _ = _batch(torch.float32)
    tok = make_tokens(old, roll, mask, bound=20.0, verl=False)
    x = torch.randn(mask.shape)
    assert torch.equal(tok.valid_max(x), x.masked_fill(~mask, -math.inf).max())
    assert torch.equal(tok.valid_min(x), x.masked_fill(~mask, math.inf).min())
    assert torch.equal(tok.valid_max(x, dim=-1), x.masked_fill(~mask, -math.inf).amax(dim=-1))
    assert torch.equal(any_per_row(mask), mask.any(dim=-1))
    assert torch.equal(any_per_row(mask[:, :1].expand(mask.shape)), mask[:, 0])  # stride-0 view


@pytest.mark.parametrize("verl", [False, True])
def test_stacked_row_reductions_match_one_row_at_a_time(verl):
    """Rows.over_rows / rows_max / rows_min on k per-row values stacked (k, B) give, bit for bit, what each
    gives alone (the metrics stack their (B,) values to make one operation of k)."""
    old, roll, mask, _ = _batch(torch.float32)
    mask[2] = False  # a row without a valid token
    rows = make_tokens(old, roll, mask, bound=20.0, verl=verl)
    stacked = torch.randn(5, mask.shape[0], dtype=torch.float32) * 100
    for reduce in (rows.over_rows, rows.rows_max, rows.rows_min):
        assert torch.equal(reduce(stacked), torch.stack([reduce(x) for x in stacked]))
    x = stacked[0]
    valid = mask.any(dim=-1)
    if verl:
        assert torch.equal(rows.over_rows(x), x.mean()) and torch.equal(rows.rows_max(x), x.max())
    else:
        assert torch.equal(rows.over_rows(x), torch.where(valid, x, 0).sum() / valid.sum())
        assert torch.equal(rows.rows_max(x), x[valid].max()) and torch.equal(rows.rows_min(x), x[valid].min())


@pytest.mark.parametrize("verl", [False, True])
def test_prob_metrics_read_the_batch_counts_as_their_definitions(verl):
    """prob_from_sums reads the batch's cached counts (valid rows, n clamped to 1, rows with a token): bit for bit
    the per-row means computed from n alone, in either mode (verl's mode changes none of these)."""
    old, roll, mask, _ = _batch(torch.float32)
    mask[2] = False  # a row without a valid token
    rows = make_tokens(old, roll, mask, bound=20.0, verl=verl)
    b = mask.shape[0]
    d_max, d_sum = torch.rand(b) * (rows.n > 0), torch.rand(b) * rows.n
    zero = torch.zeros(())
    out = metrics.prob_from_sums(rows, p_old_sum=zero, p_rollout_sum=zero, p_old_sq_sum=zero,
                                 p_rollout_sq_sum=zero, p_cross_sum=zero, d_row_max=d_max, d_row_sum=d_sum,
                                 small_diff_count=zero, ge=[zero] * len(metrics.PROB_SHARES))
    n = mask.sum(dim=-1).to(torch.float32)
    valid = n > 0
    per_row = torch.where(valid, torch.stack([d_max, d_sum / n.clamp_min(1)]), 0.0)
    expected = per_row.sum(-1) / valid.sum().clamp_min(1)
    assert torch.equal(out["prob_diff_seq_max_mean"], expected[0])
    assert torch.equal(out["prob_diff_seq_mean_mean"], expected[1])
    assert torch.equal(out["prob_diff_mean"], d_sum.sum() / n.sum().clamp_min(1))

def test_bool_masks_combine_as_bytes():
    """compute_correction's kept mask ``mask ∧ keep`` (api._masked: the bool masks' uint8 bytes, a vectorised
    ``&``) is ``mask & keep``, for a (B, 1) row keep, a (B, T) keep and a non-contiguous mask."""
    from rollcorr.correction.api import _masked

    _, _, mask, _ = _batch(torch.float32)
    g = torch.Generator().manual_seed(3)
    row_keep = torch.rand(mask.shape[0], 1, generator=g) > 0.5
    keep = torch.rand(mask.shape, generator=g) > 0.3
    transposed = mask.t().contiguous().t()
    for m, k in ((mask, row_keep), (mask, keep), (transposed, keep), (mask[:, ::2], keep[:, ::2])):
        got = _masked(m, k)
        assert got.dtype == torch.bool and torch.equal(got, m & k)
    assert torch.equal(_masked(mask.float(), row_keep), (mask & row_keep).float())


def test_scratch_and_overwrite_do_not_change_metrics():
    old, roll, mask, _ = _batch(torch.float32)
    tok = make_tokens(old, roll, mask, bound=20.0, verl=False)
    scratch = (torch.full(mask.shape, math.nan), torch.full(mask.shape, math.nan))
    plain = metrics.divergence_metrics(tok)
    reused = metrics.divergence_metrics(tok, scratch=scratch)
    assert all(torch.equal(plain[k], reused[k]) for k in plain)
    a, b = tok.anchor.exp(), tok.rollout.exp()
    kept = metrics.prob_mismatch(a, b, tok)
    assert torch.equal(b, tok.rollout.exp())  # not overwritten unless asked
    overwritten = metrics.prob_mismatch(a, b.clone(), tok, overwrite=True)
    assert all(torch.equal(kept[k], overwritten[k]) for k in kept)


@pytest.mark.parametrize("config", [preset("disabled"), CONFIGS[9]], ids=["disabled", "rules"])
@pytest.mark.parametrize("noise", [0.3, 30.0])
def test_diagnostics_match_the_standalone_metric_functions(config, noise):
    """compute_correction's diagnostics come from one pass of row sums (correction/statistics.py, their identities
    in its docstring); the metric functions on ``Tokens`` are the definitions. float64: equal to 1e-12;
    float32: as accurate as the definitions computed in float32, both against float64 (conftest's rule)."""
    from conftest import assert_metrics_as_accurate

    def definitions(old, roll, mask, extra):
        tok = make_tokens(old, roll, mask, bound=config.safety_bound, verl=config.verl_compat)
        return metrics.metrics_to_floats({
            **metrics.offpolicy_metrics(tok),
            **metrics.divergence_metrics(tok),
            **metrics.prob_mismatch(tok.anchor.exp(), tok.rollout.exp(), tok),
            **metrics.decomposition_metrics(extra["log_prob"], tok.anchor, tok.rollout, tok.mask, tok),
        })

    inputs = {dtype: _batch(dtype, noise) for dtype in (torch.float32, torch.float64)}
    got = {dtype: metrics.metrics_to_floats(_call(config, *args).metrics) for dtype, args in inputs.items()}
    want = {dtype: definitions(*args) for dtype, args in inputs.items()}
    exact = want[torch.float64]
    for key, value in exact.items():
        assert got[torch.float64]["rollout_corr/" + key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert_metrics_as_accurate({k: got[torch.float32]["rollout_corr/" + k] for k in exact}, want[torch.float32],
                               exact, n=inputs[torch.float32][2].numel())


@pytest.mark.parametrize("config", [preset("decoupled_token_is"), preset("decoupled_seq_is_rs"), CONFIGS[9],
                                    dataclasses.replace(preset("decoupled_token_is"), verl_compat=True)],
                         ids=["token-is", "seq-is-rs", "rules", "token-is-verl"])
@pytest.mark.parametrize("grouped", [True, False], ids=["one-exp", "exp2"])
@pytest.mark.parametrize("noise", [0.3, 30.0])
def test_blocks_of_rows_and_both_exponential_layouts_match_the_definitions(config, grouped, noise, monkeypatch):
    """The statistics pass walked in several blocks of rows (the last one shorter) with either layout of its
    exponentials (statistics.grouped_exp: one exp for a small block; exp2 for the probabilities and e^|ℓ| from ρ and
    e for a large one): the diagnostics agree with the definitions (float64 to 1e-12; float32 as accurate as the
    definitions in float32, both against float64), and weights, mask and every other metric with one whole block's
    to float rounding."""
    from conftest import assert_metrics_as_accurate
    from rollcorr.correction import statistics

    inputs = {dtype: _batch(dtype, noise, b=7, t=17) for dtype in (torch.float32, torch.float64)}
    whole = {dtype: _call(config, *args) for dtype, args in inputs.items()}  # 119 positions: one block, one exp
    monkeypatch.setattr(statistics, "BLOCK_POSITIONS", 40)  # blocks of 2 rows: 2, 2, 2, 1
    monkeypatch.setattr(statistics, "GROUPED_EXP_BELOW", 1 << 30 if grouped else 1)
    got = {dtype: _call(config, *args) for dtype, args in inputs.items()}

    def definitions(old, roll, mask, extra):
        tok = make_tokens(old, roll, mask, bound=config.safety_bound, verl=config.verl_compat)
        return metrics.metrics_to_floats({**metrics.offpolicy_metrics(tok), **metrics.divergence_metrics(tok),
                                          **metrics.prob_mismatch(tok.anchor.exp(), tok.rollout.exp(), tok)})

    want = {dtype: definitions(*args) for dtype, args in inputs.items()}
    floats = {dtype: metrics.metrics_to_floats(r.metrics) for dtype, r in got.items()}
    exact = want[torch.float64]
    for key, value in exact.items():
        assert floats[torch.float64]["rollout_corr/" + key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert_metrics_as_accurate({k: floats[torch.float32]["rollout_corr/" + k] for k in exact}, want[torch.float32],
                               exact, n=inputs[torch.float32][2].numel())
    for dtype, result in got.items():
        reference = whole[dtype]
        assert torch.equal(result.kept_mask, reference.kept_mask)
        if reference.is_weights is not None:
            assert torch.equal(result.is_weights, reference.is_weights)  # elementwise: the same in any block
        eps = torch.finfo(dtype).eps
        for key, value in metrics.metrics_to_floats(reference.metrics).items():
            if key.removeprefix("rollout_corr/") not in exact:  # the correction's own: sums in another order
                assert floats[dtype][key] == pytest.approx(value, rel=64 * eps, abs=64 * eps), key
