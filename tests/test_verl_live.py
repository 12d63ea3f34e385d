"""rollcorr.compat.verl against the installed verl (the `.[verl]` extra, verl 0.9.1 installed --no-deps).

Every case feeds the same tensors to verl's function and to rollcorr's drop-in of the same name:
the rollout-correction helper on random batches, every registered policy loss × every loss_agg_mode
(with and without verl's global-batch info), agg_loss, kl_penalty, the bypass loss, the DataProto entry
points, install(), and the checks of verl's own rollout-correction test files (tests/trainer/ppo/
test_rollout_corr.py and test_rollout_corr_integration.py in the verl repository) rewritten against the
drop-in in strict mode. Without verl these tests are skipped; tests/test_verl_parity_*.py check the stored
verl outputs instead.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from conftest import EPS32, metric_floor

pytest.importorskip(
    "verl.trainer.ppo.rollout_corr_helper", reason="verl not installed (pip install the .[verl] extra)"
)

from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos as V  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as H  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import rollcorr.compat.verl as R  # noqa: E402
from rollcorr.config import from_verl  # noqa: E402

AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


def test_installed_versions():
    import verl

    assert verl.__version__ == "0.9.1"


# ---- the correction helper on random batches ---------------------------------------------------------
IS_SETTINGS = [(None, 2.0), ("token", 2.0), ("token", "0.5_2.0"), ("sequence", 5.0), ("sequence", "0.2_5.0")]
RS_SETTINGS = [
    (None, None),
    ("token_k1", "0.5_2.0"),
    ("token_k2", 0.05),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.2_5.0"),
    ("seq_sum_k3", 0.5),
    ("seq_mean_k1", "0.9_1.1"),
    ("seq_mean_k2", 0.01),
    ("seq_mean_k3", 0.01),
    ("seq_max_k2", 0.5),
    ("seq_max_k3", 0.5),
    ("token_k1,seq_max_k3", "0.4_1.8,3.0"),
]
MASK_DTYPES = [torch.bool, torch.int64, torch.float32]
CASES = [
    (is_, rs, bn, seed)
    for (is_, rs), bn, seed in itertools.product(
        itertools.product(IS_SETTINGS, RS_SETTINGS), [False, True], range(3)
    )
    if not (bn and is_[0] is None)
]


def _batch(seed: int):
    """A random right-padded batch (rows of different lengths, one all-padding row sometimes) with log-probs
    ≤ 0 and a mismatch scale drawn per case, in float32 or float64, with a mask of one of verl's dtypes."""
    g = torch.Generator().manual_seed(seed)
    b, t = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(3, 11, (1,), generator=g))
    dtype = [torch.float32, torch.float64][seed % 2]
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    scale = [0.01, 0.2, 1.0][seed % 3]
    roll = (old + scale * torch.randn(b, t, generator=g, dtype=dtype)).clamp(max=0)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if b > 2 and seed % 4 == 0:
        lengths[-1] = 0  # an all-padding row
    mask = (torch.arange(t)[None] < lengths[:, None]).to(MASK_DTYPES[seed % 3])
    return old, roll, mask


def _assert_metrics(ours: dict, theirs: dict, dtype: torch.dtype, n: int) -> None:
    """rollcorr's metrics ``ours`` against verl's ``theirs`` on the same inputs (``n`` positions)."""
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        got = ours[key]
        if math.isnan(expected) or math.isinf(expected):
            assert got == expected or (math.isnan(got) and math.isnan(expected)), key
            continue
        if dtype == torch.float32:
            # two float32 implementations summing in their own orders: each within metric_floor of the exact
            # value (Higham's bound for an n-term reduction; standard deviations by its sqrt rule), so ≤ 2×
            tol = 2 * metric_floor(expected, n, std=key.endswith("_std"))
            assert abs(got - expected) <= tol, (key, got, expected, tol)
            continue
        # float64: verl computes its share metrics (fraction_high, masked_fraction, …) from `.float()` flags,
        # i.e. an exact fraction rounded once to float32 (≤ ε₃₂/2 relative); a std is sqrt(E[x²] − E[x]²), so
        # a rounding δ of the variance moves it by ~sqrt(δ): stds get an absolute tolerance
        tol = 1e-7 if key.endswith("_std") else 1e-12
        assert got == pytest.approx(expected, rel=1e-6, abs=tol), key


@pytest.mark.parametrize(("is_setting", "rs_setting", "batch_normalize", "seed"), CASES)
def test_correction_helper_matches_verl(is_setting, rs_setting, batch_normalize, seed):
    old, roll, mask = _batch(1000 * CASES.index((is_setting, rs_setting, batch_normalize, seed)) + seed)
    kwargs = dict(
        rollout_is=is_setting[0],
        rollout_is_threshold=is_setting[1],
        rollout_is_batch_normalize=batch_normalize,
        rollout_rs=rs_setting[0],
        rollout_rs_threshold=rs_setting[1],
    )
    w_r, m_r, met_r = R.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)
    try:
        w_v, m_v, met_v = H.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)
    except ZeroDivisionError:  # verl crashes when IcePop zeroes every weight (1 / ESS of zeros)
        assert is_setting[1] == "0.2_5.0" and not w_r.batch["rollout_is_weights"].any()
        return
    assert (w_v is None) == (w_r is None)
    if w_v is not None:
        assert isinstance(w_r, DataProto)
        a, b = w_r.batch["rollout_is_weights"], w_v.batch["rollout_is_weights"]
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-7 if a.dtype == torch.float32 else 1e-12, atol=0)
    assert m_r.dtype == m_v.dtype and torch.equal(m_r, m_v)
    _assert_metrics(met_r, met_v, old.dtype, mask.numel())


def test_separate_weights_and_rejection_functions_match_verl():
    old, roll, mask = _batch(7)
    log_ratio = old - roll
    for level, threshold in [("token", 2.0), ("sequence", "0.5_3.0")]:
        w_v, met_v = H.compute_rollout_correction_weights(log_ratio, mask, level, threshold)
        w_r, met_r = R.compute_rollout_correction_weights(log_ratio, mask, level, threshold)
        torch.testing.assert_close(w_r, w_v, rtol=1e-12, atol=0)
        _assert_metrics(met_r, met_v, log_ratio.dtype, log_ratio.numel())
    m_v, met_v = H.compute_rollout_rejection_mask(log_ratio, mask, "seq_mean_k3,token_k1", "0.01,0.5_2.0")
    m_r, met_r = R.compute_rollout_rejection_mask(log_ratio, mask, "seq_mean_k3,token_k1", "0.01,0.5_2.0")
    assert torch.equal(m_r, m_v)
    _assert_metrics(met_r, met_v, log_ratio.dtype, log_ratio.numel())
    for rollout in (roll, None):
        _assert_metrics(
            R.compute_offpolicy_metrics(old, rollout, mask),
            H.compute_offpolicy_metrics(old, rollout, mask),
            old.dtype,
            old.numel(),
        )


# ---- policy losses ----------------------------------------------------------------------------------
def _actor(**global_batch_info) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_high=0.28,
        # clip_cov draws clip_cov_ratio·N of its candidates at random (verl: the global RNG); ratio 1 takes
        # every candidate, so both sides pick the same tokens.
        policy_loss=PolicyLossConfig(clip_cov_ratio=1.0, kl_cov_ratio=0.2, dro_beta=0.1),
        global_batch_info=global_batch_info,
    )


GLOBAL_INFO = [{}, {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 10}]
LOSS_CASES = [
    (mode, agg, gi, seed)
    for mode in sorted(m for m in V.POLICY_LOSS_REGISTRY if m != "bypass_mode")
    for agg in AGG_MODES
    for gi in range(len(GLOBAL_INFO))
    for seed in range(2)
]


def _loss_batch(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g, dtype=dtype) * 2
    new = (old + 0.3 * torch.randn(4, 6, generator=g, dtype=dtype)).clamp(max=0)
    adv = torch.randn(4, 1, generator=g, dtype=dtype).expand(4, 6).clone()
    mask = (torch.arange(6)[None] < torch.tensor([[6], [2], [4], [0]])).float()
    weights = torch.rand(4, 6, generator=g, dtype=dtype) + 0.5
    return old, new, adv, mask, weights


@pytest.mark.parametrize(("mode", "agg", "gi", "seed"), LOSS_CASES)
def test_every_registered_loss_and_agg_mode_matches_verl(mode, agg, gi, seed):
    assert mode in R.POLICY_LOSS_REGISTRY
    config = _actor(**GLOBAL_INFO[gi])
    old, new, adv, mask, weights = _loss_batch(seed)
    results = []
    for fn in (V.get_policy_loss_fn(mode), R.get_policy_loss_fn(mode)):
        log_prob = new.clone().requires_grad_()
        loss, metrics = fn(old, log_prob, adv, mask, agg, config, weights if seed else None)
        (grad,) = torch.autograd.grad(loss, log_prob)
        results.append((loss.detach(), grad, metrics))
    (l_v, g_v, m_v), (l_r, g_r, m_r) = results
    torch.testing.assert_close(l_r, l_v, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_r, g_v, rtol=1e-12, atol=1e-15)
    assert set(m_r) == set(m_v)
    for key in m_v:  # verl's clip fractions are float32 means of .float() flags
        assert m_r[key] == pytest.approx(m_v[key], rel=1e-6, abs=1e-12), key


def test_agg_loss_global_batch_example_from_the_issue():
    """dp_size=2, batch_num_tokens=32: verl −0.553, rollcorr's local token-mean was −1.105."""
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(4, 8, generator=g)
    mask = torch.ones(4, 8)
    for kwargs in [{}, {"dp_size": 2, "batch_num_tokens": 32}, {"dp_size": 2, "global_batch_size": 8}]:
        for agg in AGG_MODES:
            if (
                agg.startswith("seq")
                and "batch_num_tokens" in kwargs
                or agg == "token-mean"
                and "global_batch_size" in kwargs
            ):
                with pytest.raises(ValueError, match="required when dp_size > 1"):
                    R.agg_loss(loss_mat, mask, agg, **kwargs)
                continue
            expected = V.agg_loss(loss_mat, mask, agg, **kwargs)
            # two float32 weighted sums of the 32 terms in their own orders: each within Higham's γ_32 of
            # Σ w |x| — the same aggregation of |loss| — so ≤ 2 · 32 ε₃₂ · agg(|loss|) apart
            tol = 2 * loss_mat.numel() * EPS32 * float(V.agg_loss(loss_mat.abs(), mask, agg, **kwargs))
            torch.testing.assert_close(R.agg_loss(loss_mat, mask, agg, **kwargs), expected, rtol=0, atol=tol)
    local = R.agg_loss(loss_mat, mask, "token-mean")
    dp = R.agg_loss(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=32)
    torch.testing.assert_close(dp, local * 2 * 32 / 32)  # local count 32 = global count: the dp factor stays


@pytest.mark.parametrize("mode", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "abs+"])
def test_kl_penalty_value_and_gradient(mode):
    g = torch.Generator().manual_seed(3)
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    base = ref + torch.randn(3, 5, generator=g, dtype=torch.float64)
    base[0, 0] = ref[0, 0] - 30  # beyond k3's ±20 clamp
    out = []
    for fn in (V.kl_penalty, R.kl_penalty):
        lp = base.clone().requires_grad_()
        value = fn(lp, ref, mode)
        (grad,) = torch.autograd.grad(value.sum(), lp)
        out.append((value.detach(), grad))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-12, atol=0)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_loss_matches_verl(loss_type):
    corr = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_rs="seq_mean_k3",
        rollout_rs_threshold=0.05,
        bypass_mode=True,
        loss_type=loss_type,
    )
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=corr),
    )
    old, new, adv, mask, _ = _loss_batch(5)
    l_v, m_v = V.get_policy_loss_fn("bypass_mode")(old, new, adv, mask, "token-mean", config)
    l_r, m_r = R.get_policy_loss_fn("bypass_mode")(old, new, adv, mask, "token-mean", config)
    torch.testing.assert_close(l_r, l_v, rtol=1e-12, atol=1e-15)
    _assert_metrics(m_r, m_v, torch.float64, mask.numel())


# ---- DataProto entry points and configs --------------------------------------------------------------
def _proto(seed: int) -> DataProto:
    old, roll, mask = _batch(seed)
    return DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask.float()}
    )


def test_add_to_batch_and_bypass_on_dataproto():
    cfg = RolloutCorrectionConfig(
        rollout_is="sequence", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"
    )
    a, b = _proto(11), _proto(11)
    a, met_v = H.compute_rollout_correction_and_add_to_batch(a, cfg)
    b, met_r = R.compute_rollout_correction_and_add_to_batch(b, cfg)
    for key in ("response_mask", "rollout_is_weights"):
        torch.testing.assert_close(b.batch[key], a.batch[key], rtol=1e-6, atol=0)
    _assert_metrics(met_r, met_v, a.batch["old_log_probs"].dtype, a.batch["old_log_probs"].numel())

    from omegaconf import OmegaConf

    pl_v, pl_r = OmegaConf.create({"loss_mode": "vanilla"}), OmegaConf.create({"loss_mode": "vanilla"})
    OmegaConf.set_struct(pl_v, True)
    OmegaConf.set_struct(pl_r, True)
    H.apply_bypass_mode(a, cfg, pl_v)
    R.apply_bypass_mode(b, cfg, pl_r)
    assert torch.equal(b.batch["old_log_probs"], b.batch["rollout_log_probs"])
    assert pl_r.loss_mode == pl_v.loss_mode == "bypass_mode"


def test_from_verl_takes_verl_configs():
    from omegaconf import OmegaConf

    assert from_verl(RolloutCorrectionConfig()).is_level == "sequence"  # verl's dataclass default
    node = OmegaConf.structured(
        RolloutCorrectionConfig(
            rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.99_1.01"
        )
    )
    c = from_verl(node)
    assert c.is_level == "token" and c.rs == ("seq_mean_k1",)
    assert from_verl(dict(RolloutCorrectionConfig.decoupled_token_icepop())).is_mode == "mask"


# ---- install() -----------------------------------------------------------------------------------------
@pytest.fixture
def restore_verl():
    """Undo install(): verl's registry and every function-valued name of the imported verl modules."""
    import sys

    registry = dict(V.POLICY_LOSS_REGISTRY)
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("verl") and m is not None]
    saved = [(m, dict(vars(m))) for m in modules]
    yield
    V.POLICY_LOSS_REGISTRY.clear()
    V.POLICY_LOSS_REGISTRY.update(registry)
    for module, names in saved:
        for n, f in names.items():
            if callable(f) and getattr(module, n, None) is not f:
                setattr(module, n, f)


def test_install_registers_rollcorr_in_verl(restore_verl):
    names = R.install()
    assert "rollcorr_ppo_clip" in names and "rollcorr_cispo" in names and "vanilla" in names
    old, new, adv, mask, _ = _loss_batch(9)
    loss, metrics = V.get_policy_loss_fn("rollcorr_gmpo")(old, new, adv, mask, "token-mean", _actor())
    assert torch.isfinite(loss) and "actor/pg_clipfrac" in metrics
    # verl's own code path now runs rollcorr's helper: positive log-probs raise (rollcorr's default) ...
    with pytest.raises(ValueError, match="positive"):
        H.compute_rollout_correction_and_rejection_mask(old + 5, old, mask, rollout_is="token")
    # ... and with strict_verl=True they pass as in verl
    R.install(strict_verl=True)
    proto, _, _ = H.compute_rollout_correction_and_rejection_mask(old + 5, old, mask, rollout_is="token")
    assert proto.batch["rollout_is_weights"][mask.bool()].eq(2.0).all()


# ---- verl's own rollout-correction tests, against the drop-in in strict mode -----------------------------
# Equivalents of tests/trainer/ppo/test_rollout_corr.py and test_rollout_corr_integration.py in the verl
# repository (not shipped in the wheel). Their inputs come from torch.randn, i.e. positive "log-probs",
# which rollcorr rejects by default: strict_verl=True accepts them.
def strict(**kwargs):
    return R.compute_rollout_correction_and_rejection_mask(**kwargs, strict_verl=True)


@pytest.fixture
def randn_batch():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 10, generator=g)
    return old, old + 0.1 * torch.randn(4, 10, generator=g), torch.ones(4, 10)


def test_default_mode_rejects_what_verl_tests_feed(randn_batch):
    old, roll, mask = randn_batch
    with pytest.raises(ValueError, match="positive"):
        R.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is="token")


def test_verl_basic_rollout_correction(randn_batch):  # test_basic_rollout_correction
    old, roll, mask = randn_batch
    w, _, m = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
    )
    assert w.batch["rollout_is_weights"].shape == old.shape and w.batch["rollout_is_weights"].max() <= 2.0
    assert "rollout_corr/rollout_is_min" in m
    w, _, _ = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_is="sequence",
        rollout_is_threshold=5.0,
    )
    for row in w.batch["rollout_is_weights"]:
        assert torch.allclose(row, row[0])
    _, _, m = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.5_1.5",
    )
    assert "rollout_corr/rollout_rs_masked_fraction" in m
    w, m2, m = strict(old_log_prob=old, rollout_log_prob=roll, response_mask=mask)
    assert w is None and torch.equal(m2, mask) and "rollout_corr/kl" in m


@pytest.mark.parametrize(
    ("option", "threshold"),
    [("token_k1", "0.5_1.5"), ("token_k2", 2.0), ("token_k3", 2.0), ("seq_sum_k1", "0.6_1.4"), ("seq_sum_k2", 2.5),
     ("seq_sum_k3", 2.5), ("seq_mean_k1", "0.5_1.5"), ("seq_mean_k2", 2.0), ("seq_mean_k3", 2.0),
     ("seq_max_k2", 2.0), ("seq_max_k3", 2.0)],
)
def test_verl_each_supported_rollout_rs_option(option, threshold, randn_batch):
    assert option in H.SUPPORTED_ROLLOUT_RS_OPTIONS
    old, roll, mask = randn_batch
    _, m2, m = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_rs=option,
        rollout_rs_threshold=threshold,
    )
    assert f"rollout_corr/rollout_rs_{option}_mean" in m and m2.shape == mask.shape
    _, m2_v, m_v = H.compute_rollout_correction_and_rejection_mask(
        old, roll, mask, rollout_rs=option, rollout_rs_threshold=threshold
    )
    assert torch.equal(m2, m2_v)
    _assert_metrics(m, m_v, old.dtype, old.numel())


def test_verl_rollout_rs_multiple_options(randn_batch):  # test_rollout_rs_multiple_options
    old, roll, mask = randn_batch
    _, _, m = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_rs="token_k1,seq_max_k3",
        rollout_rs_threshold="0.4_1.8,3.0",
    )
    assert "rollout_corr/rollout_rs_token_k1_mean" in m and "rollout_corr/rollout_rs_seq_max_k3_mean" in m


def test_verl_metrics_completeness_and_offpolicy(
    randn_batch,
):  # test_metrics_completeness, test_offpolicy_metrics
    old, roll, mask = randn_batch
    _, _, m = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_is="token",
        rollout_is_threshold=2.5,
    )
    for key in ("mean", "max", "min", "std", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low"):
        assert f"rollout_corr/rollout_is_{key}" in m
    off = R.compute_offpolicy_metrics(old - 2.0, roll - 1.5, mask, strict_verl=True)
    assert set(off) == set(H.compute_offpolicy_metrics(old - 2.0, roll - 1.5, mask))
    only = R.compute_offpolicy_metrics(old - 2.0, None, mask, strict_verl=True)
    assert "training_ppl" in only and "rollout_ppl" not in only


def test_verl_mask_mode():  # test_mask_mode
    old = torch.full((2, 5), -2.0)
    roll = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    w, m2, m = strict(old_log_prob=old, rollout_log_prob=roll, response_mask=torch.ones(2, 5), rollout_is="token",
                      rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    w = w.batch["rollout_is_weights"]
    assert w[0, 0] == pytest.approx(math.exp(-1), abs=1e-6) and w[1, 0] == pytest.approx(
        math.exp(0.5), abs=1e-6
    )
    assert (m2[0] == 0).all() and (m2[1] == 1).all()
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)


def test_verl_exact_icepop():  # test_exact_icepop_zeroes_weights_without_changing_mask (+ integration twin)
    raw = torch.tensor([[0.4, 0.8, 6.0]])
    w, m2, m = strict(old_log_prob=torch.zeros_like(raw), rollout_log_prob=-torch.log(raw), response_mask=torch.ones_like(raw),
                      rollout_is="token", rollout_is_threshold="0.5_5.0")
    torch.testing.assert_close(w.batch["rollout_is_weights"], torch.tensor([[0.0, 0.8, 0.0]]))
    assert torch.equal(m2, torch.ones_like(raw))
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 3, abs=1e-6)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(0.3771236, abs=1e-6)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1 / 3, abs=1e-6)
    old = torch.full((1, 3), -1.0)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    w, _, _ = strict(old_log_prob=old, rollout_log_prob=torch.tensor([[-0.5, -3.5, -0.8]]), response_mask=torch.ones(1, 3),
                     rollout_is="token", rollout_is_threshold="0.5_5.0")
    w = w.batch["rollout_is_weights"]
    loss, _ = R.compute_policy_loss_vanilla(
        old, old.clone(), adv, torch.ones(1, 3), "token-mean", _actor(), w, strict_verl=True
    )
    torch.testing.assert_close(loss, torch.mean(w * -adv))


def test_verl_bool_threshold_is_rejected():  # test_bool_rollout_is_threshold_is_rejected
    with pytest.raises(TypeError, match="not a boolean"):
        strict(old_log_prob=torch.zeros(1, 2), rollout_log_prob=torch.zeros(1, 2), response_mask=torch.ones(1, 2),
               rollout_is="token", rollout_is_threshold=True)


def test_verl_integration_policy_loss_with_weights():  # TestRolloutISIntegration (policy loss / metrics-only)
    g = torch.Generator().manual_seed(1)
    old, new, roll, adv = (torch.randn(4, 16, generator=g) for _ in range(4))
    mask = torch.ones(4, 16)
    w, _, m = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
    )
    assert "rollout_corr/rollout_is_mean" in m
    w = w.batch["rollout_is_weights"]
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, clip_ratio=0.2)
    with_w, _ = R.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config, w, strict_verl=True)
    without, _ = R.compute_policy_loss_vanilla(
        old, new, adv, mask, "token-mean", config, None, strict_verl=True
    )
    assert with_w.ndim == 0 and torch.isfinite(with_w) and not torch.allclose(with_w, without)
    expected, _ = V.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config, w)
    torch.testing.assert_close(with_w, expected)
    for level in ("token", "sequence"):
        assert "rollout_corr/rollout_is_mean" in strict(old_log_prob=old, rollout_log_prob=roll, response_mask=mask,
                                                        rollout_is=level, rollout_is_threshold=2.0)[2]
    _, _, m = strict(
        old_log_prob=old,
        rollout_log_prob=roll,
        response_mask=mask,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
    )
    assert "rollout_corr/rollout_rs_seq_mean_k1_mean" in m
    _, _, m = strict(old_log_prob=old, rollout_log_prob=roll, response_mask=mask, rollout_is="token", rollout_is_threshold=2.0,
                     rollout_rs="token_k1", rollout_rs_threshold=1.3)
    assert "rollout_corr/rollout_rs_token_k1_mean" in m


def test_strict_mode_all_rejected_token_mean_is_nan_like_verl():
    old, new, adv, _, _ = _loss_batch(2)
    mask = torch.zeros(4, 6)
    loss_v, _ = V.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", _actor())
    loss_strict, _ = R.compute_policy_loss_vanilla(
        old, new, adv, mask, "token-mean", _actor(), strict_verl=True
    )
    loss_default, _ = R.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", _actor())
    assert math.isnan(loss_v) and math.isnan(loss_strict) and loss_default == 0.0


def test_strict_mode_gspo_ppo_kl_unclamped():
    old, new, adv, mask, _ = _loss_batch(4)
    new = new.clone()
    new[0, 0] = old[0, 0] + 40.0  # beyond rollcorr's ±20 log-ratio clamp (a log-prob > 0: strict input)
    config = _actor()
    _, m_v = V.get_policy_loss_fn("gspo")(old, new, adv, mask, "token-mean", config)
    _, m_strict = R.compute_policy_loss_gspo(old, new, adv, mask, "token-mean", config, strict_verl=True)
    _, m_default = R.compute_policy_loss_gspo(old, new, adv, mask, "token-mean", config)
    assert m_strict["actor/ppo_kl"] == pytest.approx(m_v["actor/ppo_kl"], rel=1e-9)
    assert m_default["actor/ppo_kl"] != pytest.approx(m_v["actor/ppo_kl"], rel=1e-3)


def test_config_objects_are_not_mutated():
    config = _actor(dp_size=2, batch_num_tokens=40, global_batch_size=10)
    before = copy.deepcopy(config.global_batch_info)
    old, new, adv, mask, _ = _loss_batch(1)
    R.compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", config)
    assert config.global_batch_info == before


# ---- docs/verl.md: every snippet runs -------------------------------------------------------------------
DOC = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "verl.md"


def _blocks(lang: str) -> list[str]:
    import re

    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def test_docs_verl_snippets_run(restore_verl, tmp_path):
    plugin, config_example, hook = _blocks("python")
    scope: dict = {"print": lambda *a, **k: None}
    exec(plugin, scope)  # install(): verl's registry now names rollcorr's losses
    setup, loss_mode = _blocks("bash")
    key, value = loss_mode.strip().split("=")
    assert key == "actor_rollout_ref.actor.policy_loss.loss_mode" and value in V.POLICY_LOSS_REGISTRY
    assert setup.strip() == "ROLLCORR_OPTIONAL=verl bash scripts/setup.sh"
    script = (DOC.parents[1] / "scripts" / "setup.sh").read_text()
    assert '"${extra}" = verl' in script and "--no-deps verl==0.9.1" in script
    exec(config_example, scope)
    assert scope["weights"].batch["rollout_is_weights"].shape == (4, 8)
    exec(hook, scope)
    batch = _proto(5)
    batch.batch["responses"] = torch.zeros_like(batch.batch["response_mask"], dtype=torch.long)
    from rollcorr.models.builtin import load_builtin

    _, tokenizer = load_builtin()
    correction = from_verl({"rollout_is": "token", "rollout_is_threshold": 2.0})
    scope["dump_rollouts"](
        batch, tmp_path / "rollouts.jsonl", step=3, tokenizer=tokenizer, correction=correction
    )
    from rollcorr.cli import main
    from rollcorr.dumps import read_dump

    dump = read_dump(tmp_path / "rollouts.jsonl")
    assert dump.token_text is not None and type(correction).from_dict(dump.correction) == correction
    assert main(["analyze", str(tmp_path / "rollouts.jsonl")]) == 0


# ---- edge cases a verl user hits (against verl 0.9.1) ----------------------------------------------------
def _verl_and_rollcorr(mode: str, *args, strict_verl: bool = True, **kwargs):
    """(verl's result or exception, rollcorr's result or exception) of ``compute_policy_loss_<mode>``."""
    out = []
    for fn in (getattr(V, f"compute_policy_loss_{mode}"), getattr(R, f"compute_policy_loss_{mode}")):
        extra = {"strict_verl": strict_verl} if fn.__module__.startswith("rollcorr") else {}
        try:
            out.append(fn(*args, **kwargs, **extra))
        except Exception as error:  # noqa: BLE001 - compared below
            out.append(error)
    return out


def test_dro_without_dro_beta_raises_like_verl():
    """verl's PolicyLossConfig leaves dro_beta None; verl's dro raises, rollcorr used 0.1."""
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    assert config.policy_loss.dro_beta is None
    old, new, adv, mask, _ = _loss_batch(0)
    for strict_verl in (False, True):
        v, r = _verl_and_rollcorr("dro", old, new, adv, mask, "token-mean", config, strict_verl=strict_verl)
        assert isinstance(v, ValueError) and "dro_beta" in str(v)
        assert isinstance(r, ValueError) and "dro_beta" in str(r)


def test_bypass_mode_threshold_none_turns_is_off_like_verl():
    """rollout_is_threshold=None in bypass mode: verl computes no IS weights (rollcorr read it as 2.0)."""
    corr = {"rollout_is": "token", "rollout_is_threshold": None, "loss_type": "reinforce"}
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=corr),
    )
    old, new, adv, mask, _ = _loss_batch(3)
    new = old + 0.5  # ratios e^0.5 ≈ 1.65: inside the [0, 2] truncation, so weights would change the loss
    l_v, m_v = V.compute_policy_loss_bypass_mode(old, new.clamp(max=0), adv, mask, "token-mean", config)
    l_r, m_r = R.compute_policy_loss_bypass_mode(old, new.clamp(max=0), adv, mask, "token-mean", config)
    torch.testing.assert_close(l_r, l_v, rtol=1e-12, atol=1e-15)
    assert not any(k.startswith("rollout_corr/rollout_is_") for k in m_r)
    assert set(m_r) == set(m_v)


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_cov_losses_strict_mode_leave_the_log_ratio_unclamped(mode):
    old, new, adv, mask, _ = _loss_batch(4)
    new = new.clone()
    new[0, 1] = old[0, 1] + 25.0  # beyond rollcorr's ±20 clamp (a positive log-prob: strict input)
    config = _actor()
    (l_v, m_v), (l_s, m_s) = _verl_and_rollcorr(mode, old, new, adv, mask, "token-mean", config)
    torch.testing.assert_close(l_s, l_v, rtol=1e-12, atol=0)
    assert m_s == pytest.approx(m_v, rel=1e-9)
    l_d, m_d = R.get_policy_loss_fn(mode)(
        old, new, adv, mask, "token-mean", config
    )  # default: clamped at ±20
    # kl_cov's r enters the loss; clip_cov clips it for A > 0, but its ppo_kl metric still sees the clamp
    assert not torch.isclose(l_d, l_v, rtol=1e-3) or m_d["actor/ppo_kl"] != pytest.approx(m_v["actor/ppo_kl"])


def test_clip_cov_covariance_carries_verls_epsilon():
    """Two tokens whose covariance sits 2e-8 above clip_cov_lb = 1 without verl's +1e-8 in the means and
    3e-8 below it with: verl leaves token 0 in, rollcorr zeroed it."""
    old = torch.tensor([[-9.0 + 2e-8, -11.0 - 2e-8]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    config = _actor()
    (l_v, m_v), (l_r, m_r) = _verl_and_rollcorr("clip_cov", old, old.clone(), adv, mask, "token-mean", config,
                                                strict_verl=False)
    torch.testing.assert_close(l_r, l_v, rtol=1e-12, atol=0)
    assert m_r["actor/pg_clipfrac"] == pytest.approx(m_v["actor/pg_clipfrac"]) == 0.5


def test_gspo_sapo_and_reinforce_default_aggregation_is_verls():
    """Without loss_agg_mode, verl's gspo / sapo aggregate seq-mean-token-mean and reinforce
    seq-mean-token-sum; rollcorr's drop-ins aggregated token-mean."""
    old, new, adv, mask, _ = _loss_batch(6)
    config = _actor()
    for mode in ("gspo", "sapo"):
        (l_v, _), (l_r, _) = _verl_and_rollcorr(mode, old, new, adv, mask, config=config)
        torch.testing.assert_close(l_r, l_v, rtol=1e-12, atol=1e-15)
    (l_v, m_v), (l_r, m_r) = _verl_and_rollcorr(
        "reinforce", rollout_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, config=config
    )
    torch.testing.assert_close(l_r, l_v, rtol=1e-12, atol=1e-15)
    assert m_r == pytest.approx(m_v, rel=1e-9)


def test_kl_penalty_takes_verls_keyword_names():
    """verl/workers/utils/losses.py calls kl_penalty(logprob=..., ref_logprob=..., kl_penalty=...)."""
    g = torch.Generator().manual_seed(1)
    ref = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    lp = ref + 0.1 * torch.randn(2, 4, generator=g, dtype=torch.float64)
    for mode in ("k1", "low_var_kl"):
        expected = V.kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=mode)
        torch.testing.assert_close(R.kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=mode), expected)


def test_offpolicy_metrics_accept_positive_log_probs_after_strict_install(restore_verl, randn_batch):
    """verl's test_offpolicy_metrics feeds torch.randn "log-probs"; after install(strict_verl=True) verl's
    own compute_offpolicy_metrics and compute_rollout_corr_metrics_from_logprobs must accept them."""
    old, roll, mask = randn_batch
    expected_off = H.compute_offpolicy_metrics(old, roll, mask)
    expected_actor = H.compute_rollout_corr_metrics_from_logprobs(old, roll, mask)
    R.install(strict_verl=True)
    _assert_metrics(H.compute_offpolicy_metrics(old, roll, mask), expected_off, old.dtype, old.numel())
    _assert_metrics(H.compute_rollout_corr_metrics_from_logprobs(old, roll, mask), expected_actor, old.dtype,
                    old.numel())
    R.install()  # default: positive log-probs raise, also through the actor-side entry point
    with pytest.raises(ValueError, match="positive"):
        H.compute_rollout_corr_metrics_from_logprobs(old, roll, mask)


def test_install_reaches_names_verl_modules_imported_before_it(restore_verl):
    """workers/utils/losses.py (and the trainers) import agg_loss & co. by name at import time."""
    worker_losses = pytest.importorskip(
        "verl.workers.utils.losses", reason="needs verl's worker deps (datasets)"
    )

    assert worker_losses.agg_loss is V.agg_loss  # verl's, bound before install()
    R.install()
    assert worker_losses.agg_loss is R.agg_loss
    R.install(strict_verl=True)  # a second install rebinds what the first one bound
    assert worker_losses.agg_loss is R.agg_loss and V.agg_loss is R.agg_loss


@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_token_rejected_is_nan_in_strict_mode_for_every_mean(agg):
    """docs/verl.md: an all-masked micro-batch gives NaN in verl for token-mean and the seq-mean modes."""
    old, new, adv, _, _ = _loss_batch(2)
    mask = torch.zeros(4, 6)
    loss_v, _ = V.compute_policy_loss_vanilla(old, new, adv, mask, agg, _actor())
    loss_s, _ = R.compute_policy_loss_vanilla(old, new, adv, mask, agg, _actor(), strict_verl=True)
    loss_d, _ = R.compute_policy_loss_vanilla(old, new, adv, mask, agg, _actor())
    assert loss_d == 0.0
    if agg == "token-sum":  # a sum of nothing is 0 everywhere
        assert loss_v == loss_s == 0.0
    else:
        assert math.isnan(loss_v) and math.isnan(loss_s)


def test_single_k1_threshold_below_one_raises_in_verl_and_rollcorr():
    """rollout_rs_threshold=0.5 for a *_k1 option: verl 0.9.1 raises (lower 2 > upper 0.5), as from_verl does."""
    old, roll, mask = _batch(1)
    kwargs = {"rollout_rs": "token_k1", "rollout_rs_threshold": 0.5}
    with pytest.raises(ValueError, match="lower <= upper"):
        H.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)
    with pytest.raises(ValueError):
        R.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)


def test_list_input_gets_a_clear_type_error():
    rows = [[-0.5, -1.0], [-0.2, -0.3]]
    with pytest.raises(AttributeError):  # verl: 'list' object has no attribute 'any'
        H.compute_rollout_correction_and_rejection_mask(rows, rows, [[1, 1], [1, 1]], rollout_is="token")
    with pytest.raises(TypeError, match="old_log_prob must be a torch.Tensor"):
        R.compute_rollout_correction_and_rejection_mask(rows, rows, [[1, 1], [1, 1]], rollout_is="token")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_statistics_in_float32_where_verl_rounds(dtype):
    """docs/verl.md: from bf16 / fp16 log-probs rollcorr computes its statistics in float32, verl in the inputs'
    dtype. The truth is the float64 k3 of the rounded inputs; rollcorr is within float32 rounding of it (ℓ and
    exp(ℓ) − 1 − ℓ per token, then a mean of n terms: metric_floor), verl is not closer."""
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(16, 256, generator=g, dtype=torch.float64) * 2 - 0.5
    roll = old + 0.1 * torch.randn(16, 256, generator=g, dtype=torch.float64)
    old, roll, mask = old.to(dtype), roll.to(dtype), torch.ones(16, 256)
    kwargs = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None)
    ell = old.double() - roll.double()
    truth = (torch.exp(ell) - 1 - ell).mean().item()
    ours = R.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)[2]["rollout_corr/k3_kl"]
    verls = H.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)[2]["rollout_corr/k3_kl"]
    assert abs(ours - truth) <= 2 * metric_floor(truth, mask.numel()), (ours, truth)
    assert abs(ours - truth) <= abs(verls - truth)


def test_an_inf_threshold_truncates_nothing_as_in_verl():
    """rollout_is_threshold=inf (verl: no truncation) is accepted and gives verl's untruncated weights."""
    old, roll, mask = _batch(11)
    kwargs = dict(rollout_is="token", rollout_is_threshold=math.inf, rollout_rs=None, rollout_rs_threshold=None)
    w_r = R.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)[0].batch["rollout_is_weights"]
    w_v = H.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)[0].batch["rollout_is_weights"]
    torch.testing.assert_close(w_r, w_v, rtol=2e-7 if w_r.dtype == torch.float32 else 1e-12, atol=0)
    assert from_verl({"rollout_is": "token", "rollout_is_threshold": math.inf}).is_upper is None
