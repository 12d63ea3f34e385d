"""The built statistics kernel (correction/native.py, csrc/row_pass.cpp) agrees with the plain-torch pass
(correction/statistics.py) to float rounding — each measured against the same computation in float64 — checks the
inputs as that pass does, serves only what it was built for, and is never built at call time.

The kernel is built by scripts/setup.sh (``python -m rollcorr.correction.build_kernel``) for each CPU capability
the machine has; under a capability it was not built for (``ATEN_CPU_CAPABILITY=default``) the comparisons are
skipped and every batch takes the plain-torch pass, which the rest of the suite covers. Nothing here measures
time.
"""

import pytest
import torch

from conftest import assert_metrics_as_accurate
from rollcorr.config import CorrectionConfig, preset
from rollcorr.correction import build_kernel, compute_correction, native
from rollcorr.correction.metrics import metrics_to_floats
from test_correction_perf_fused import (
    CONFIGS,
    _assert_close,
    _batch,
    _call,
    _reference,
    assert_the_input_errors,
)

CAPABILITY = torch.backends.cpu.get_cpu_capability().upper()
needs_kernel = pytest.mark.skipif(
    CAPABILITY not in native.CAPABILITIES or not native.loaded(),
    reason=f"no correction kernel for torch's CPU capability {CAPABILITY} in this process",
)


def test_the_kernel_is_built_for_this_cpu():
    """Where torch runs with a capability the kernel is built for, setup.sh built it and it loads: a build that
    failed shows here, not as a slower run."""
    if CAPABILITY not in native.CAPABILITIES:
        pytest.skip(f"torch runs with capability {CAPABILITY}: the plain-torch pass serves")
    if CAPABILITY not in build_kernel.machine_capabilities():
        pytest.skip(f"this CPU lacks {CAPABILITY}")
    assert native.loaded(), "not built: run python -m rollcorr.correction.build_kernel (scripts/setup.sh does)"


def _plain(monkeypatch, fn, *args, **kw):
    with monkeypatch.context() as m:
        m.setitem(native._state, "loaded", False)
        return fn(*args, **kw)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The list of the kernel's calls (``native.run``, counted)."""
    calls, run = [], native.run
    monkeypatch.setattr(native, "run", lambda *a: calls.append(a) or run(*a))
    return calls


@needs_kernel
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.mode}-{c.is_level}-{c.is_mode}-{c.rs}")
@pytest.mark.parametrize("noise", [1e-3, 0.3, 30.0])  # 1e-3: every lane on the series; 30: past the ±20 clamp
def test_the_kernel_matches_the_plain_torch_pass(config, noise, kernel_calls, monkeypatch):
    args = (config, *_batch(noise=noise))
    got = _call(*args)
    assert len(kernel_calls) == 1
    _assert_close(got, _plain(monkeypatch, _call, *args), _reference(monkeypatch, *args))


@needs_kernel
@pytest.mark.parametrize("name", ["decoupled_token_is", "decoupled_seq_is_rs", "decoupled_k3_rs_seq_tis",
                                  "trm_max_k2_mean_k3", "bypass_pg_is"])
def test_without_diagnostics_the_kernel_gives_the_same_metrics(name, kernel_calls, monkeypatch):
    """``diagnostics=False``: the kernel's variant without the diagnostic sums, the same metrics as the plain pass
    (the rules' k1 / k2 / k3 reductions included)."""
    args = (preset(name), *_batch(noise=0.3, seed=7))
    got = _call(*args, diagnostics=False)
    assert len(kernel_calls) == 1
    _assert_close(got, _plain(monkeypatch, _call, *args, diagnostics=False),
                  _reference(monkeypatch, *args, diagnostics=False))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 16384), (9, 1000)])
@pytest.mark.parametrize("name", ["decoupled_token_is", "decoupled_token_icepop", "decoupled_seq_is_rs"])
def test_shapes_around_the_vector_width_and_the_chunk(shape, name, kernel_calls, monkeypatch):
    """Rows shorter than one vector, lengths no vector width divides, rows of many 256-position chunks."""
    b, t = shape
    old, roll, mask, lp, kept = _batch(b=max(b, 2), t=t, noise=0.3, seed=b * t)
    args = (preset(name), old[:b].contiguous(), roll[:b].contiguous(), mask[:b].contiguous() | (b == 1), lp, kept)
    got = _call(*args)
    assert len(kernel_calls) == 1
    _assert_close(got, _plain(monkeypatch, _call, *args), _reference(monkeypatch, *args))


@needs_kernel
def test_verl_mode_and_bounds_of_every_kind(kernel_calls, monkeypatch):
    """verl's unclamped k3, a truncation with a lower bound (padding stays 0), a mask band with a lower bound."""
    configs = [
        CorrectionConfig(is_level="token", is_upper=2.0, verl_compat=True, safety_bound=5.0),
        CorrectionConfig(is_level="token", is_upper=2.0, is_lower=0.5),
        CorrectionConfig(is_level="token", is_mode="mask", is_upper=1.5, is_lower=0.7),
    ]
    for config in configs:
        args = (config, *_batch(noise=3.0, seed=5))
        _assert_close(_call(*args), _plain(monkeypatch, _call, *args), _reference(monkeypatch, *args))
        assert float(_call(*args).is_weights[~args[3]].abs().max()) == 0.0
    assert len(kernel_calls) == 2 * len(configs)


@needs_kernel
def test_the_kernel_checks_its_inputs(kernel_calls):
    """The same one-line errors as the plain-torch pass: a NaN or positive log-prob on a valid token (named with
    its position), no valid token, a mask with other values; garbage in the padding is ignored."""
    assert_the_input_errors(_call)
    config = preset("decoupled_token_is")
    old, roll, mask, lp, kept = _batch()
    with pytest.raises(ValueError, match="response_mask has values other than 0 and 1"):
        _call(config, old, roll, mask.float() * 2, lp, kept)
    assert len(kernel_calls) == 6  # every call above took the kernel (a float mask is compared to bool first)


@needs_kernel
def test_what_the_kernel_does_not_serve_takes_the_plain_torch_pass(kernel_calls):
    """float64 and bfloat16 inputs and non-contiguous tensors: the plain-torch pass."""
    config = preset("decoupled_token_is")
    old, roll, mask, lp, kept = _batch(t=40)
    _call(config, old.double(), roll.double(), mask, lp, kept)
    _call(config, old.bfloat16(), roll.bfloat16(), mask, lp, kept)
    _call(config, old[:, ::2], roll[:, ::2], mask[:, ::2], lp, kept)
    assert kernel_calls == []


@needs_kernel
def test_threads_split_rows_not_sums():
    """At any thread count each row is summed by one thread and the totals in one order: the same bits."""
    old, roll, mask, lp, kept = _batch(b=64, t=3000, noise=0.3)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(compute_correction(old, roll, mask, preset("decoupled_seq_is_rs")))
    finally:
        torch.set_num_threads(threads)
    _assert_close(results[1], results[0], rel=0)


@needs_kernel
def test_small_mismatch_series_are_as_accurate_as_the_library_functions():
    """Where every lane has |ℓ| < 1/2 the kernel's expm1 and log1p are their series: the token weights and k3
    sums (which read expm1) as accurate as the plain pass's, against float64."""
    old, roll, mask, lp, kept = _batch(b=16, t=512, noise=1e-2, seed=3)
    config = preset("decoupled_k3_rs_seq_tis")
    got, exact = (metrics_to_floats(compute_correction(o, r, mask, config).metrics)
                  for o, r in ((old, roll), (old.double(), roll.double())))
    native._state["loaded"] = False
    try:
        plain = metrics_to_floats(compute_correction(old, roll, mask, config).metrics)
    finally:
        native._state.pop("loaded")
    keys = [f"rollout_corr/{k}" for k in ("rollout_rs_seq_mean_k3_mean", "rollout_is_mean", "k3_kl", "policy_kl",
                                          "js_divergence", "token_mult_prob_error")]
    assert_metrics_as_accurate(got, plain, exact, n=mask.numel(), keys=keys)


def test_the_library_is_named_by_its_source_torch_and_capability(tmp_path, monkeypatch):
    """An edited source or another torch never loads a stale build: the file name carries a hash of both."""
    source = tmp_path / "row_pass.cpp"
    source.write_bytes(native.SOURCE.read_bytes())
    monkeypatch.setattr(native, "SOURCE", source)
    before = native.library_path("AVX2")
    assert before.name.startswith("row_pass-avx2-") and native.library_path("AVX512") != before
    source.write_bytes(source.read_bytes() + b"// edited\n")
    assert native.library_path("AVX2") != before


def test_not_built_or_switched_off_means_the_plain_torch_pass(tmp_path, monkeypatch):
    """No library at its name, or ``ROLLCORR_NATIVE=0``: the kernel is not loaded and the correction runs."""
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(native, "library_path", lambda capability: tmp_path / "missing.so")
    assert not native._load()
    monkeypatch.setenv(native.ENV, "0")
    assert not native._load()
    with pytest.MonkeyPatch.context() as m:
        m.setitem(native._state, "loaded", False)
        old, roll, mask, lp, kept = _batch()
        assert compute_correction(old, roll, mask, preset("decoupled_token_is")).is_weights is not None


def test_a_failed_build_says_so_in_one_line(monkeypatch, tmp_path):
    """A compiler that fails: one line naming the capability and the compiler's first error; nothing at the
    library's name."""
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(build_kernel, "library_path", lambda capability: tmp_path / f"{capability}.so")
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match=r"^building the AVX2 correction kernel failed: no output$"):
        build_kernel.build("AVX2")
    assert not (tmp_path / "AVX2.so").exists()


def test_setup_builds_each_capability_once(monkeypatch, tmp_path, capsys):
    """``python -m rollcorr.correction.build_kernel`` leaves a capability whose file exists (the same source and
    torch) as it is, and builds the others."""
    built = tmp_path / "AVX2.so"
    built.write_bytes(b"")
    monkeypatch.setattr(build_kernel, "machine_capabilities", lambda: ["AVX2", "AVX512"])
    monkeypatch.setattr(build_kernel, "library_path", lambda capability: tmp_path / f"{capability}.so")
    asked = []
    monkeypatch.setattr(build_kernel, "build", lambda capability: asked.append(capability) or tmp_path / "x.so")
    assert build_kernel.main([]) == 0
    assert asked == ["AVX512"] and "the AVX2 correction kernel is built" in capsys.readouterr().out
