"""CorrectionConfig validation, plain-data / YAML round trip, presets."""

import math

import pytest
import yaml

from rollcorr.config import PRESETS, CorrectionConfig, preset
from rollcorr.config.correction import RS_OPTIONS
from rollcorr.correction.rejection import rejects


def test_defaults_do_nothing_but_measure():
    c = CorrectionConfig()
    assert c.mode == "decoupled" and c.is_level is None and c.rs == () and not rejects(c)
    assert not c.applies_weights


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"mode": "sync"}, "mode"),
        ({"loss_type": "gspo"}, "loss_type"),
        ({"is_level": "tokens"}, "is_level"),
        ({"is_mode": "clip"}, "is_mode"),
        ({"batch_norm_scope": "epoch"}, "batch_norm_scope"),
        ({"denominator": "tokens"}, "denominator"),
        ({"sampler_distribution": "raw"}, "sampler_distribution"),
        ({"is_upper": -1.0}, "is_upper"),
        ({"is_upper": 0.0}, "is_upper"),
        ({"is_upper": True}, "is_upper"),
        ({"is_upper": math.nan}, "is_upper"),
        ({"is_upper": "2.0"}, "is_upper"),
        ({"is_lower": 3.0, "is_upper": 2.0}, "is_lower"),
        ({"is_lower": -0.1}, "is_lower"),
        ({"is_mode": "mask", "is_upper": None, "is_lower": None}, "is_mode"),
        ({"batch_normalize": True}, "batch_normalize"),
        ({"batch_normalize": 1, "is_level": "token"}, "batch_normalize"),
        ({"verl_compat": "yes"}, "verl_compat"),
        ({"rs": ("token_k4",), "rs_thresholds": (2.0,)}, "rs option"),
        ({"rs": ("seq_max_k1",), "rs_thresholds": (2.0,)}, "rs option"),
        ({"rs": ("token_k1",)}, "rs_thresholds"),
        ({"rs": (), "rs_thresholds": (2.0,)}, "rs_thresholds"),
        ({"rs": ("token_k1", "token_k2", "token_k3"), "rs_thresholds": (2.0, 0.1)}, "rs_thresholds"),
        ({"rs": ("token_k1", "token_k1"), "rs_thresholds": (2.0,)}, "twice"),
        ({"rs": ("token_k2",), "rs_thresholds": ("0.5_2.0",)}, "lo_hi"),
        ({"rs": ("seq_mean_k3",), "rs_thresholds": ((0.1, 0.2),)}, "lo_hi"),
        ({"rs": ("token_k1",), "rs_thresholds": ((2.0, 0.5),)}, "lower bound"),
        ({"rs": ("token_k1",), "rs_thresholds": ("2.0_0.5",)}, "lower bound"),
        ({"rs": ("token_k1",), "rs_thresholds": (0.5,)}, ">= 1"),
        ({"rs": ("token_k2",), "rs_thresholds": (-0.1,)}, "rs_thresholds for token_k2"),
        ({"rs": ("token_k2",), "rs_thresholds": (True,)}, "rs_thresholds"),
        ({"rs": ("token_k2",), "rs_thresholds": ("abc",)}, "not a number"),
        ({"rs": ("token_k1",), "rs_thresholds": ((0.5, 1.0, 2.0),)}, "window"),
        ({"veto_threshold": 2.0}, "veto_threshold"),
        ({"veto_threshold": 0.0}, "veto_threshold"),
        ({"veto_upper": 0.5}, "veto_upper"),
        ({"trm_max_k2": -1.0}, "trm_max_k2"),
        ({"trm_mean_k3": True}, "trm_mean_k3"),
        ({"opsm_delta": -1e-4}, "opsm_delta"),
        ({"safety_bound": 1000.0}, "safety_bound"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CorrectionConfig(**kwargs)


def test_rs_accepts_verl_strings_and_canonicalises():
    c = CorrectionConfig(rs="token_k1, seq_max_k3", rs_thresholds="0.4_1.8,3.0")
    assert c.rs == ("token_k1", "seq_max_k3")
    assert c.rs_thresholds == ((0.4, 1.8), 3.0)
    one = CorrectionConfig(rs=("token_k1", "seq_mean_k1"), rs_thresholds=2.0)  # broadcast, C -> [1/C, C]
    assert one.rs_thresholds == ((0.5, 2.0), (0.5, 2.0))
    assert CorrectionConfig(rs=["seq_sum_k2"], rs_thresholds=["0.6"]).rs_thresholds == (0.6,)


def test_every_rs_option_accepted():
    for option in RS_OPTIONS:
        c = CorrectionConfig(rs=(option,), rs_thresholds=(2.0,))
        assert rejects(c)
        assert (c.rs_thresholds[0] == (0.5, 2.0)) == option.endswith("k1")


def test_to_dict_is_plain_data_and_round_trips_yaml():
    c = CorrectionConfig(
        is_level="geometric",
        is_mode="mask",
        is_lower=0.9,
        is_upper=1.1,
        batch_normalize=True,
        batch_norm_scope="micro_batch",
        rs=("token_k1", "seq_max_k2"),
        rs_thresholds=((0.5, 3.0), 0.2),
        veto_threshold=1e-4,
        trm_max_k2=0.05,
        trm_mean_k3=1e-3,
        opsm_delta=1e-4,
        denominator="batch",
    )
    d = c.to_dict()
    text = yaml.safe_dump(d)
    assert "!!python" not in text  # plain data only
    assert CorrectionConfig.from_dict(yaml.safe_load(text)) == c
    assert CorrectionConfig.from_yaml(c.to_yaml()) == c


def test_from_dict_rejects_unknown_keys_and_non_mappings():
    with pytest.raises(ValueError, match="unknown CorrectionConfig keys"):
        CorrectionConfig.from_dict({"rollout_is": "token"})
    with pytest.raises(ValueError, match="mapping"):
        CorrectionConfig.from_dict([("mode", "bypass")])


def test_replace_revalidates():
    c = preset("tis")
    assert c.replace(is_upper=4.0).is_upper == 4.0
    with pytest.raises(ValueError, match="is_lower"):
        c.replace(is_lower=5.0)


def test_frozen():
    with pytest.raises(AttributeError):
        CorrectionConfig().mode = "bypass"  # type: ignore[misc]


# ---- presets -------------------------------------------------------------------------------------
VERL_PRESETS = {
    # name: (is_level, is_mode, upper, lower, rs, rs_threshold, bypass, loss_type)
    "decoupled_token_is": ("token", "truncate", 2.0, None, (), (), False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "mask", 5.0, 0.5, (), (), False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", "truncate", 2.0, None, (), (), False, "ppo_clip"),
    "decoupled_seq_is_rs": (
        "sequence",
        "truncate",
        2.0,
        None,
        ("seq_sum_k1",),
        ((0.5, 2.0),),
        False,
        "ppo_clip",
    ),
    "decoupled_geo_rs": (None, "truncate", 2.0, None, ("seq_mean_k1",), ((0.999, 1.001),), False, "ppo_clip"),
    "decoupled_geo_rs_seq_tis": (
        "sequence",
        "truncate",
        2.0,
        None,
        ("seq_mean_k1",),
        ((0.999, 1.001),),
        False,
        "ppo_clip",
    ),
    "decoupled_geo_rs_token_tis": (
        "token",
        "truncate",
        2.0,
        None,
        ("seq_mean_k1",),
        ((0.999, 1.001),),
        False,
        "ppo_clip",
    ),
    "decoupled_k3_rs": (None, "truncate", 2.0, None, ("seq_mean_k3",), (0.01,), False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": (
        "sequence",
        "truncate",
        2.0,
        None,
        ("seq_mean_k3",),
        (0.01,),
        False,
        "ppo_clip",
    ),
    "decoupled_k3_rs_token_tis": (
        "token",
        "truncate",
        2.0,
        None,
        ("seq_mean_k3",),
        (0.01,),
        False,
        "ppo_clip",
    ),
    "bypass_ppo_clip": (None, "truncate", 2.0, None, (), (), True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (
        None,
        "truncate",
        2.0,
        None,
        ("seq_mean_k1",),
        ((0.999, 1.001),),
        True,
        "ppo_clip",
    ),
    "bypass_ppo_clip_k3_rs": (None, "truncate", 2.0, None, ("seq_mean_k3",), (0.01,), True, "ppo_clip"),
    "bypass_pg_is": ("sequence", "truncate", 2.0, None, (), (), True, "reinforce"),
    "bypass_pg_token_icepop": ("token", "mask", 5.0, 0.5, (), (), True, "reinforce"),
    "bypass_pg_geo_rs": (None, "truncate", 2.0, None, ("seq_mean_k1",), ((0.999, 1.001),), True, "reinforce"),
    "bypass_pg_geo_rs_seq_tis": (
        "sequence",
        "truncate",
        2.0,
        None,
        ("seq_mean_k1",),
        ((0.999, 1.001),),
        True,
        "reinforce",
    ),
    "bypass_pg_geo_rs_token_tis": (
        "token",
        "truncate",
        2.0,
        None,
        ("seq_mean_k1",),
        ((0.999, 1.001),),
        True,
        "reinforce",
    ),
    "disabled": (None, "truncate", 2.0, None, (), (), False, "ppo_clip"),
}


@pytest.mark.parametrize("name", sorted(VERL_PRESETS))
def test_verl_presets_have_verl_defaults(name):
    level, mode, upper, lower, rs, thr, bypass, loss_type = VERL_PRESETS[name]
    c = preset(name)
    assert (c.is_level, c.is_mode, c.is_upper, c.is_lower) == (level, mode, upper, lower)
    assert c.rs == rs and c.rs_thresholds == thr
    assert c.mode == ("bypass" if bypass else "decoupled") and c.loss_type == loss_type
    assert c.denominator == ("original" if bypass else "kept")


def test_preset_arguments_override():
    assert preset("decoupled_token_is", threshold=3.0).is_upper == 3.0
    c = preset("decoupled_token_icepop", threshold=4.0, threshold_lower=0.25)
    assert (c.is_lower, c.is_upper) == (0.25, 4.0)
    assert preset("decoupled_k3_rs", rs_threshold=0.02).rs_thresholds == (0.02,)
    assert preset("decoupled_geo_rs", rs_threshold="0.99_1.01").rs_thresholds == ((0.99, 1.01),)


def test_unknown_preset_and_parameter():
    with pytest.raises(ValueError, match="decoupled_token_is"):
        preset("decoupled_token_iss")
    with pytest.raises(ValueError, match="threshold"):
        preset("decoupled_token_is", treshold=3.0)


def test_peer_presets_mean_what_they_say():
    assert preset("icepop").is_mode == "mask" and preset("icepop").is_lower == 0.5
    seq_mis = preset("seq_mis")
    assert (seq_mis.is_level, seq_mis.is_mode, seq_mis.is_lower, seq_mis.is_upper) == (
        "sequence",
        "mask",
        None,
        2.0,
    )
    trl = preset("trl_sequence_mask")
    assert (trl.is_level, trl.is_mode, trl.is_upper, trl.denominator) == ("sequence", "mask", 3.0, "original")
    trm = preset("trm_max_k2_mean_k3")
    assert (trm.trm_max_k2, trm.trm_mean_k3, trm.denominator) == (0.05, 0.001, "batch")
    nemo = preset("nemo_rl_seq_mask_tis")
    assert nemo.is_upper is None and nemo.rs == ("seq_mean_k1",) and nemo.rs_thresholds == ((0.999, 1.002),)
    assert preset("slime_veto").veto_threshold == 1e-4
    assert preset("areal_decoupled_cap").is_mode == "mask" and preset("areal_decoupled_cap").is_upper == 5.0
    assert preset("openrlhf_tis").is_lower == 0.5
    assert preset("skyrl_outlier").veto_upper == 100.0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips(name):
    c = preset(name)
    assert CorrectionConfig.from_yaml(c.to_yaml()) == c
