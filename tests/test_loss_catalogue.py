"""The loss catalogue (rollcorr.losses.registry): one declaration per loss, read by policy_loss, LossConfig,
the trainer's validation and the verl drop-in. A loss registered from outside the package, in every consumer:
tests/test_recipes.py."""

from __future__ import annotations

import inspect

import pytest

from rollcorr.losses import LOSSES, LossConfig, LossSpec, loss_spec, register_loss
from test_recipes import toy_loss  # tests/ is on sys.path (pytest rootdir)


def test_catalogue_refuses_duplicates_and_unknown_options():
    with pytest.raises(ValueError, match="already registered"):
        register_loss(LossSpec("ppo_clip", toy_loss))
    with pytest.raises(ValueError, match="not LossConfig fields"):
        LossSpec("toy_bad", toy_loss, options={"alpha": 1.0})
    with pytest.raises(ValueError, match="unknown aggregation"):
        LossSpec("toy_bad", toy_loss, agg="mean")
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        LossConfig(name="nope")


def test_one_default_per_option():
    """A loss's own options are declared by its spec only: LossConfig and the trainer read them there."""
    from rollcorr.train.config import AlgorithmConfig, loss_arg_readers

    assert loss_spec("oapl").options["oapl_beta"] == 0.3  # the shipped default (docs/results.md, study 4)
    assert LossConfig(name="oapl").oapl_beta == AlgorithmConfig().oapl_beta == 0.3
    assert LossConfig(name="tis").tis_cap == 2.0 and LossConfig(name="ppo_clip").tis_cap is None
    readers = loss_arg_readers()
    for key, names in readers.items():
        assert all(key in loss_spec(n).options for n in names)
    assert readers["dppo_kl_coef"] == ("dppo_tv", "dppo_kl") and readers["dro_beta"] == ("dro",)


def test_policy_loss_dispatches_through_the_table():
    """No name comparison left in policy_loss: what a loss needs comes from its spec."""
    import rollcorr.losses.dispatch as dispatch

    source = inspect.getsource(dispatch)
    assert "name ==" not in source and "name in (" not in source
    assert all(isinstance(spec, LossSpec) for spec in LOSSES.values())


def test_verl_drop_in_reads_the_catalogue():
    from rollcorr.compat import verl
    from rollcorr.compat.verl_losses import LOSS_MODES

    assert set(LOSS_MODES) == {s.verl_name for s in LOSSES.values() if s.verl_name}
    assert "vanilla" in LOSS_MODES and "geo_mean" in LOSS_MODES
    for name in verl.extra_losses():
        assert f"rollcorr_{name}" in verl.POLICY_LOSS_REGISTRY
    assert not {"tis", "oapl"} & set(verl.extra_losses())
