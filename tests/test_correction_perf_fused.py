"""The fused statistics (correction/fused.py, compiled on request by ``fused.warm``) agree with the default
plain-torch statistics (correction/statistics.py) to float rounding, and nothing compiles unless asked.

Most cases run the kernel function eagerly (``_row_pass`` is a pure function; compiling it changes the summation
order, not the formulas), on small batches with holes, all-padding rows and every rule; a few compile it for
real on a batch above ``MIN_POSITIONS``. Nothing here measures time.
"""

import dataclasses
import math
import warnings

import pytest
import torch

from conftest import EPS32, EveryVariant, assert_as_accurate, assert_metrics_as_accurate
from rollcorr.config import CorrectionConfig, preset
from rollcorr.correction import compute_correction, fused
from rollcorr.correction.metrics import DIAGNOSTIC_METRICS

CONFIGS = [
    preset("disabled"),
    preset("decoupled_token_is"),
    preset("decoupled_token_icepop"),
    preset("decoupled_seq_is"),
    preset("decoupled_seq_is_rs"),
    preset("decoupled_geo_rs_token_tis"),
    preset("decoupled_k3_rs_seq_tis"),
    preset("seq_mis"),
    preset("geo_is"),
    preset("tis"),
    preset("bypass_pg_is"),
    CorrectionConfig(is_level="token", is_upper=2.0, is_lower=0.5, batch_normalize=True),
    CorrectionConfig(
        is_level="geometric",
        is_mode="mask",
        is_upper=1.05,
        is_lower=0.95,
        batch_normalize=True,
        rs=("seq_max_k2", "seq_sum_k2", "seq_mean_k3", "seq_sum_k1"),
        rs_thresholds=(0.5, 3.0, 0.01, "0.2_5.0"),
    ),
    CorrectionConfig(is_level="sequence", is_lower=0.5, sampler_distribution="full"),
]


def _batch(b=7, t=40, noise=0.3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4 - 1e-3
    old = (roll + noise * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0], lengths[-1] = t, 0  # a full row and an all-padding row
    mask = torch.arange(t)[None] < lengths[:, None]
    mask[1, 0] = False  # a hole inside a response
    log_prob = (old + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-5)
    kept = -0.1 * torch.rand(b, t, generator=g, dtype=torch.float64)
    return old.to(dtype), roll.to(dtype), mask, log_prob.to(dtype), kept.to(dtype)


def _call(config, old, roll, mask, log_prob, kept, **kw):
    return compute_correction(
        old, roll, mask, config, log_prob if config.mode == "bypass" else None,
        log_kept_mass=kept if config.sampler_distribution == "full" else None, **kw,
    )


@pytest.fixture
def eager_kernel(monkeypatch):
    """Take the fused path on any batch size, as if warmed for every variant, the kernel function run eagerly."""
    monkeypatch.setattr(fused, "MIN_POSITIONS", 0)
    monkeypatch.setitem(fused._state, "compiled", fused._row_pass)
    monkeypatch.setitem(fused._state, "warm", EveryVariant())


def _assert_close(got, want, exact=None, rel=None):
    """The fused result ``got`` against the eager one ``want``: the same kept mask, and values

    - float32 (``exact``: the eager path on float64 copies of the inputs, ``_exact``): each path's error
      against ``exact`` (conftest.assert_as_accurate, the fused path no less accurate than the eager one up to
      the stated factor); the metrics reduce over at most every position of the batch, the sequence-level
      weights over a row: those lengths set the floors (conftest.metric_floor);
    - float64, or ``rel=0`` (the same computation twice): within ``rel`` of ``want`` (absolute 1e-6, 1e-3 on
      standard deviations: sqrt(E[x²] − E[x]²) moves by ~sqrt(δ) for a rounding δ of the variance).
    """
    assert torch.equal(got.kept_mask, want.kept_mask) and got.kept_mask.dtype == want.kept_mask.dtype
    assert (got.is_weights is None) == (want.is_weights is None)
    assert list(got.metrics) == list(want.metrics)
    if rel is None:
        assert exact is not None, "float32 results are compared through a float64 reference"
        positions, row = want.kept_mask.numel(), want.kept_mask.shape[-1]
        if want.is_weights is not None:
            assert got.is_weights.dtype == want.is_weights.dtype
            floor = row * EPS32 * float(exact.is_weights.double().norm())
            assert_as_accurate(got.is_weights, want.is_weights, exact.is_weights, floor=floor, what="is_weights")
        metrics = [{k: v.item() for k, v in m.metrics.items()} for m in (got, want, exact)]
        assert_metrics_as_accurate(*metrics, n=positions)
        return
    if want.is_weights is not None:
        assert got.is_weights.dtype == want.is_weights.dtype
        torch.testing.assert_close(got.is_weights, want.is_weights, rtol=rel, atol=1e-7)
    for key, w in want.metrics.items():
        g, w = got.metrics[key].item(), w.item()
        if math.isnan(w) or math.isinf(w):
            assert g == w or (math.isnan(g) and math.isnan(w)), key
            continue
        assert g == pytest.approx(w, rel=rel, abs=1e-3 if key.endswith("_std") else 1e-6), key


def _eager(monkeypatch, *args, **kw):
    """The default (plain torch) statistics: no kernel warmed."""
    with monkeypatch.context() as m:
        m.setitem(fused._state, "warm", set())
        return _call(*args, **kw)


def _float64(x):
    """``x`` with every float tensor in it (through tuples, lists, dicts and dataclasses such as a Rollout) as
    float64: the inputs of a float64 reference, the same values exactly."""
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, tuple | list):
        return type(x)(_float64(v) for v in x)
    if isinstance(x, dict):
        return {k: _float64(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
        if any(isinstance(v, torch.Tensor) for v in fields.values()):
            return dataclasses.replace(x, **{k: _float64(v) for k, v in fields.items()})
    return x


def _exact(monkeypatch, fn, *args, **kw):
    """``fn`` on the default path with float64 copies of its inputs: the reference both float32 paths are
    measured against (compute_correction computes in float64 for float64 inputs)."""
    with monkeypatch.context() as m:
        m.setitem(fused._state, "warm", set())
        return fn(*_float64(args), **_float64(kw))


def _reference(monkeypatch, *args, **kw):
    return _exact(monkeypatch, _call, *args, **kw)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.mode}-{c.is_level}-{c.is_mode}-{c.rs}")
@pytest.mark.parametrize("noise", [0.3, 30.0])  # 30: |ℓ| exceeds the ±20 bound, the clamp matters
def test_fused_path_matches_eager_path(config, noise, eager_kernel, monkeypatch):
    args = (config, *_batch(noise=noise))
    _assert_close(_call(*args), _eager(monkeypatch, *args), _reference(monkeypatch, *args))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fused_path_other_dtypes(dtype, eager_kernel, monkeypatch):
    for config in (preset("decoupled_token_is"), preset("decoupled_seq_is_rs")):
        args = (config, *_batch(dtype=dtype))
        if dtype == torch.float64:  # float64 math: the two paths' summation orders differ by ~1e-16
            _assert_close(_call(*args), _eager(monkeypatch, *args), rel=1e-12)
        else:  # bfloat16 inputs, float32 arithmetic
            _assert_close(_call(*args), _eager(monkeypatch, *args), _reference(monkeypatch, *args))


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32])
def test_fused_path_non_bool_masks(mask_dtype, eager_kernel, monkeypatch):
    config = preset("decoupled_seq_is_rs")
    old, roll, mask, lp, kept = _batch()
    args = (config, old, roll, mask.to(mask_dtype), lp, kept)
    _assert_close(_call(*args), _eager(monkeypatch, *args), _reference(monkeypatch, *args))
    with pytest.raises(ValueError, match="response_mask has values other than 0 and 1"):
        _call(config, old, roll, mask.to(mask_dtype) * 2, lp, kept)


def test_fused_path_checks_its_inputs(eager_kernel):
    assert_the_input_errors(_call)


def assert_the_input_errors(call):
    """``call`` (``_call``'s signature) refuses a NaN or a positive log-prob on a valid token, naming it and its
    position, and a batch without a valid token, in the default path's words; garbage in the padding is ignored."""
    config = preset("decoupled_token_is")
    old, roll, mask, lp, kept = _batch()
    bad = old.clone()
    bad[0, 3] = math.nan
    with pytest.raises(ValueError, match=r"old_log_prob is NaN/inf on valid tokens at \(row 0, pos 3\)"):
        call(config, bad, roll, mask, lp, kept)
    bad = roll.clone()
    bad[0, 2] = 0.5
    with pytest.raises(ValueError, match=r"rollout_log_prob is positive .* \(row 0, pos 2\)"):
        call(config, old, bad, mask, lp, kept)
    with pytest.raises(ValueError, match="response_mask has no valid token"):
        call(config, old, roll, torch.zeros_like(mask), lp, kept)
    # garbage in the padding is ignored, as on the eager path
    dirty = call(config, torch.where(mask, old, math.nan), torch.where(mask, roll, 5.0), mask, lp, kept)
    _assert_close(dirty, call(config, old, roll, mask, lp, kept), rel=0)


@pytest.mark.parametrize("name", ["slime_veto", "opsm", "skyrl_outlier", "token_k1", "seq_mean_binary_kl"])
def test_rules_that_read_tokens_take_them_beside_the_kernel(name, eager_kernel, monkeypatch):
    """Veto, OPSM, token-level and binary-KL rules read the (B, T) tokens (built on first use) while the kernel
    serves every per-row sum: the same result as the default path."""
    thresholds = {"token_k1": "0.5_2.0", "seq_mean_binary_kl": 0.1}
    config = (CorrectionConfig(rs=(name,), rs_thresholds=(thresholds[name],)) if name in thresholds
              else preset(name))
    old, roll, mask, lp, kept = _batch(noise=0.3)
    kw = dict(advantages=torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(2)))
    calls = []
    monkeypatch.setitem(fused._state, "compiled", lambda *a: calls.append(1) or fused._row_pass(*a))
    got = compute_correction(old, roll, mask, config, lp, **kw)
    assert len(calls) == 1
    want = _eager_run(monkeypatch, compute_correction, old, roll, mask, config, lp, **kw)
    _assert_close(got, want, _exact(monkeypatch, compute_correction, old, roll, mask, config, lp, **kw))


def _eager_run(monkeypatch, fn, *args, **kw):
    """``fn`` on the default path (no kernel warmed)."""
    with monkeypatch.context() as m:
        m.setitem(fused._state, "warm", set())
        return fn(*args, **kw)


def test_nothing_compiles_unless_warmed(monkeypatch):
    """A process that never called ``fused.warm`` corrects every batch, small or large, on the default path:
    no compiled function exists and the kernel is never asked."""
    monkeypatch.setitem(fused._state, "compiled", None)
    monkeypatch.setitem(fused._state, "warm", set())
    args = (preset("decoupled_geo_rs_token_tis"), *_batch(b=4, t=fused.MIN_POSITIONS // 4 + 8))
    _call(*args)
    assert fused._state["compiled"] is None
    with monkeypatch.context() as m:  # a warmed variant is used only for its own configuration
        m.setitem(fused._state, "warm", {fused.variant(preset("decoupled_token_is"), torch.float32)})
        m.setitem(fused._state, "compiled", lambda *a: pytest.fail("another variant's kernel was called"))
        _call(*args)


def test_compile_failure_falls_back_to_the_eager_path(monkeypatch):
    """``fused.warm`` that cannot compile says so (``FusedUnavailableWarning``) and returns False; every call then
    takes the default path."""

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused, "MIN_POSITIONS", 0)
    monkeypatch.setitem(fused._state, "compiled", broken)
    monkeypatch.setitem(fused._state, "warm", set())
    config = preset("decoupled_token_is")
    with pytest.warns(fused.FusedUnavailableWarning, match=r"no C\+\+ compiler"):
        assert fused.warm(config) is False
    assert fused._state["warm"] == set()
    args = (config, *_batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _call(*args)
    want = _eager(monkeypatch, *args)
    assert torch.equal(got.is_weights, want.is_weights)
    assert all(torch.equal(got.metrics[k], v) for k, v in want.metrics.items())


def _compiled_or_skip(config, dtype=torch.float32, diagnostics=True):
    """Warm the real kernel for ``config`` (seconds to a minute), or skip where this machine cannot compile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fused.FusedUnavailableWarning)
        ok = fused.warm(config, dtype, diagnostics=diagnostics)
    if not ok:  # e.g. Inductor's C++ under ATEN_CPU_CAPABILITY=default
        assert any(issubclass(w.category, fused.FusedUnavailableWarning) for w in caught)
        pytest.skip("the fused kernel could not be compiled on this machine")


@pytest.mark.parametrize("name", ["disabled", "decoupled_geo_rs_token_tis"])
def test_compiled_kernel_matches_eager_path(name, monkeypatch):
    """The real torch.compile'd kernel, warmed on a small batch, serves a batch of another shape (dynamic shapes:
    no recompile) and agrees with the default path; a call it would have to recompile for (a strided input)
    is refused and served by the default path instead."""
    config = preset(name)
    _compiled_or_skip(config)
    calls = []
    compiled = fused._state["compiled"]
    monkeypatch.setitem(fused._state, "compiled", lambda *a: calls.append(1) or compiled(*a))
    args = (config, *_batch(b=64, t=fused.MIN_POSITIONS // 64, noise=0.05))
    got = _call(*args)
    assert calls == [1]
    _assert_close(got, _eager(monkeypatch, *args), _reference(monkeypatch, *args))
    old, roll, mask, lp, kept = _batch(b=fused.MIN_POSITIONS // 64, t=64, noise=0.05)
    strided = (config, old.t().contiguous().t(), roll, mask, lp, kept)  # column-major: another stride
    _assert_close(_call(*strided), _eager(monkeypatch, *strided), _reference(monkeypatch, *strided))


def test_kernels_are_cached_per_cpu_capability(tmp_path):
    """Inductor's cache does not key on ATEN_CPU_CAPABILITY: on an AVX512 machine, kernels a native run had
    cached crashed a later run under ATEN_CPU_CAPABILITY=avx2 (segmentation fault). Each capability compiles
    into its own folder under the cache (fused.capability_cache_dir), so no process loads another's kernels."""
    import os
    import subprocess
    import sys

    script = (  # what run_row_pass does before its first compile, in a fresh process per capability
        "import os\n"
        "from rollcorr.correction import fused\n"
        "fused.capability_cache_dir()\n"
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
    )
    seen = {}
    for capability in ("default", "avx2"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "ATEN_CPU_CAPABILITY": capability}
        env.pop("ROLLCORR_FUSED", None)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        seen[capability] = done.stdout.strip().splitlines()[-1]
    assert seen["default"] == str(tmp_path / "rollcorr-default")
    # avx2 where the CPU has it (torch falls back to default on an older CPU: the same folder, rightly)
    assert seen["avx2"] in (str(tmp_path / "rollcorr-avx2"), str(tmp_path / "rollcorr-default"))


def _without_diagnostics(want, got):
    """``got`` (diagnostics=False) is ``want`` (the default) less the diagnostic metrics, every value, the
    weights and the mask bit for bit; returns the keys left out."""
    dropped = [k for k in want.metrics if k not in got.metrics]
    assert list(got.metrics) == [k for k in want.metrics if k not in dropped]
    assert {k.removeprefix("rollout_corr/") for k in dropped} <= DIAGNOSTIC_METRICS
    assert not any(k.removeprefix("rollout_corr/") in DIAGNOSTIC_METRICS for k in got.metrics)
    for key, value in got.metrics.items():
        assert torch.equal(value, want.metrics[key]) or (value.isnan() and want.metrics[key].isnan()), key
    assert (got.is_weights is None) == (want.is_weights is None)
    assert got.is_weights is None or torch.equal(got.is_weights, want.is_weights)
    assert torch.equal(got.kept_mask, want.kept_mask)
    return dropped


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.mode}-{c.is_level}-{c.is_mode}-{c.rs}")
@pytest.mark.parametrize("path", ["eager", "fused"])
def test_diagnostics_false_leaves_out_only_the_diagnostics(config, path, monkeypatch):
    """``diagnostics=False`` computes every weight, rule and count metric exactly as the default and leaves out
    the mismatch diagnostics (metrics.DIAGNOSTIC_METRICS), on either path (fused: the kernel run eagerly).
    The default path computes the rules' terms the same way with or without them: the values bit for bit."""
    if path == "fused":
        monkeypatch.setattr(fused, "MIN_POSITIONS", 0)
        monkeypatch.setitem(fused._state, "compiled", fused._row_pass)
        monkeypatch.setitem(fused._state, "warm", EveryVariant())
    else:
        monkeypatch.setitem(fused._state, "warm", set())
    args = (config, *_batch(noise=30.0))  # the clamp matters
    dropped = _without_diagnostics(_call(*args), _call(*args, diagnostics=False))
    assert len(dropped) == 28  # off-policy 13, divergence 6, probability mismatch 9


def test_diagnostics_false_leaves_out_the_whole_documented_set(monkeypatch):
    """With π_θ given in decoupled mode (the discrepancy/drift split) every name of DIAGNOSTIC_METRICS is one
    the default reports, and diagnostics=False leaves each of them out."""
    old, roll, mask, lp, _ = _batch()
    config = preset("decoupled_seq_is_rs")
    want = compute_correction(old, roll, mask, config, lp)
    dropped = _without_diagnostics(want, compute_correction(old, roll, mask, config, lp, diagnostics=False))
    assert {k.removeprefix("rollout_corr/") for k in dropped} == DIAGNOSTIC_METRICS


def test_the_kernel_writes_token_weights_with_its_row_loop_operand(eager_kernel):
    """``row_one`` ((B, 1) ones) only shapes Inductor's loops: the kernel's outputs are the same without it."""
    old, roll, mask, _, _ = _batch()
    args = (old, roll, mask, 20.0, 1e-6, 1e-6, ("truncate", 2.0, None), ("sum_k1",), False, True)
    with_one = fused.row_pass(*args, row_one=torch.ones(old.shape[0], 1))
    plain = fused.row_pass(*args)
    assert list(with_one) == list(plain)
    assert all(torch.equal(with_one[k], plain[k]) for k in plain)


@pytest.mark.slow  # a compile per variant: seconds to a minute each
@pytest.mark.parametrize("diagnostics", [True, False])
def test_compiled_kernel_on_rows_it_splits(diagnostics, monkeypatch):
    """The real compiled kernel on rows of 8192 positions, which it reduces as two pieces of 4096
    (fused.split_for), with and without the diagnostics (each its own variant), against the default path, both
    measured against float64, as test_compiled_kernel_matches_eager_path does for unsplit rows."""
    t = 8192
    assert fused.split_for(t) == 2
    config = preset("decoupled_geo_rs_token_tis")
    _compiled_or_skip(config, diagnostics=diagnostics)
    args = (config, *_batch(b=fused.MIN_POSITIONS // t, t=t, noise=0.05))
    got = _call(*args, diagnostics=diagnostics)
    want = _eager(monkeypatch, *args, diagnostics=diagnostics)
    _assert_close(got, want, _reference(monkeypatch, *args, diagnostics=diagnostics))
    assert got.is_weights.shape == want.is_weights.shape and got.is_weights.is_contiguous()
    assert any(k.removeprefix("rollout_corr/") in DIAGNOSTIC_METRICS for k in got.metrics) == diagnostics


@pytest.mark.parametrize("t", [8192, 8190, 12288, 8191, 4096])
def test_split_rows_give_the_whole_rows_reductions(t):
    """row_pass with ``split`` reduces each row as fused.split_for(t) pieces (2 for 8192 and 8190, 4 for 12288,
    1 for an odd or short row) and combines them: counts, maxima and minima equal to the whole rows', sums as
    accurate (against the same reductions in float64: conftest.assert_as_accurate, a row of t terms), the
    token weights the same values as (B·k, T / k) pieces."""
    old, roll, mask, _, _ = _batch(b=3, t=t, noise=0.3)
    k = fused.split_for(t)
    assert k == {8192: 2, 8190: 2, 12288: 4}.get(t, 1)
    args = (20.0, 1e-6, 1e-6, ("truncate", 2.0, None), ("sum_k1", "max_k2"), False, True)
    whole = fused.row_pass(old, roll, mask, *args, row_one=torch.ones(3, 1))
    split = fused.row_pass(old, roll, mask, *args, row_one=torch.ones(3 * k, 1), split=True)
    one = torch.ones(3, 1, dtype=torch.float64)
    exact = fused.row_pass(old.double(), roll.double(), mask, *args, row_one=one)
    assert list(split) == list(whole)
    assert torch.equal(split["w"].view(3, t), whole["w"])
    counts = {"n", "bad_old", "bad_rollout", "small_diff_count", "ge0", "ge1", "ge2", "high", "low"}
    extremes = {"max_k2", "d_max", "w_max", "w_min"}
    for key in whole.keys() - {"w"}:
        got, established, reference = split[key], whole[key], exact[key]
        if key in counts | extremes:  # integers below 2^24, and maxima / minima: exact either way
            assert torch.equal(got, established), key
        else:  # a float32 sum of t terms: within t·ε₃₂ of its magnitude
            floor = t * EPS32 * float(reference.abs().sum())
            assert_as_accurate(got, established, reference, floor=floor, what=key)
