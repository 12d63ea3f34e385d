"""Peers' configuration keys → CorrectionConfig: one test per key, unknown keys raise."""

import pytest

from rollcorr.config import from_nemo_rl, from_openrlhf, from_skyrl, from_trl, from_verl
from rollcorr.correction.rejection import rejects


# ---- verl -----------------------------------------------------------------------------------------
def test_verl_missing_keys_take_the_dataclass_defaults():
    c = from_verl({})  # verl's RolloutCorrectionConfig(): rollout_is="sequence", threshold 2.0
    assert c.is_level == "sequence" and c.is_upper == 2.0 and c.rs == () and c.mode == "decoupled"
    assert not c.verl_compat
    assert from_verl({"rollout_is": None}).is_level is None  # verl's YAML default


def test_verl_target_key_and_objects():
    from dataclasses import dataclass

    target = {"_target_": "verl.trainer.config.RolloutCorrectionConfig", "rollout_is": "token"}
    assert from_verl(target).is_level == "token"
    with pytest.raises(ValueError, match="_target_"):
        from_verl({"_target_": "verl.workers.config.ActorConfig"})

    @dataclass
    class RolloutCorrectionConfig:  # the shape of verl's dataclass, for machines without verl
        _target_: str = "verl.trainer.config.RolloutCorrectionConfig"
        rollout_is: str | None = "sequence"
        rollout_rs: str | None = "seq_mean_k3"
        rollout_rs_threshold: float | None = 0.01

    c = from_verl(RolloutCorrectionConfig())
    assert c.is_level == "sequence" and c.rs == ("seq_mean_k3",)


def test_verl_rollout_is():
    assert from_verl({"rollout_is": "token"}).is_level == "token"
    assert from_verl({"rollout_is": "sequence"}).is_level == "sequence"
    with pytest.raises(ValueError, match="rollout_is"):
        from_verl({"rollout_is": "geometric"})


def test_verl_rollout_is_threshold():
    c = from_verl({"rollout_is": "token", "rollout_is_threshold": 3.0})
    assert (c.is_mode, c.is_upper, c.is_lower) == ("truncate", 3.0, None)
    c = from_verl({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"})  # IcePop
    assert (c.is_mode, c.is_upper, c.is_lower) == ("mask", 5.0, 0.5)
    assert from_verl({"rollout_is": "token", "rollout_is_threshold": "1.5"}).is_upper == 1.5
    with pytest.raises(ValueError, match="bool"):
        from_verl({"rollout_is": "token", "rollout_is_threshold": True})
    with pytest.raises(ValueError, match="silently"):
        from_verl({"rollout_is": "token", "rollout_is_threshold": None})
    with pytest.raises(ValueError, match="is_lower"):
        from_verl({"rollout_is": "token", "rollout_is_threshold": "5.0_0.5"})


def test_verl_rollout_is_batch_normalize():
    assert from_verl({"rollout_is": "token", "rollout_is_batch_normalize": True}).batch_normalize
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        from_verl({"rollout_is_batch_normalize": "yes"})


def test_verl_rollout_rs_and_threshold():
    c = from_verl({"rollout_rs": "token_k1,seq_max_k3,token_k1", "rollout_rs_threshold": "0.4_1.8,3.0"})
    assert c.rs == ("token_k1", "seq_max_k3") and c.rs_thresholds == ((0.4, 1.8), 3.0)
    assert from_verl({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}).rs_thresholds == (0.01,)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        from_verl({"rollout_rs": "token_k1"})
    with pytest.raises(ValueError, match="rs option"):
        from_verl({"rollout_rs": "geometric", "rollout_rs_threshold": 2.0})


def test_verl_bypass_mode_and_loss_type():
    c = from_verl({"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence"})
    assert (c.mode, c.loss_type, c.denominator, c.batch_norm_scope) == (
        "bypass",
        "reinforce",
        "original",
        "micro_batch",
    )
    with pytest.raises(ValueError, match="loss_type"):
        from_verl({"loss_type": "gspo"})


def test_verl_exact_and_unknown_keys():
    assert from_verl({}, exact=True).verl_compat
    with pytest.raises(ValueError, match="rollout_token_veto_threshold"):
        from_verl({"rollout_token_veto_threshold": 1e-4})  # removed verl key (issue #4912)


# ---- TRL ------------------------------------------------------------------------------------------
def test_trl_defaults_are_sequence_mask_3():
    c = from_trl({})
    assert (c.is_level, c.is_mode, c.is_upper, c.is_lower, c.denominator) == (
        "sequence",
        "mask",
        3.0,
        None,
        "original",
    )


def test_trl_correction_flag():
    assert from_trl({"vllm_importance_sampling_correction": False}).is_level is None


@pytest.mark.parametrize(
    "mode, level, is_mode",
    [("token_truncate", "token", "truncate"), ("token_mask", "token", "mask"),
     ("sequence_truncate", "sequence", "truncate"), ("sequence_mask", "sequence", "mask")],
)
def test_trl_mode(mode, level, is_mode):
    c = from_trl({"vllm_importance_sampling_mode": mode})
    assert (c.is_level, c.is_mode) == (level, is_mode)


def test_trl_clip_max_clip_min_and_deprecated_cap():
    c = from_trl({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 5.0,
                  "vllm_importance_sampling_clip_min": 0.2})
    assert (c.is_upper, c.is_lower) == (5.0, 0.2)
    assert from_trl({"vllm_importance_sampling_cap": 4.0}).is_upper == 4.0
    with pytest.raises(ValueError, match="not both"):
        from_trl({"vllm_importance_sampling_cap": 4.0, "vllm_importance_sampling_clip_max": 4.0})
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        from_trl({"vllm_importance_sampling_mode": "geometric_mask"})


def test_trl_off_policy_mask_threshold_is_opsm():
    assert from_trl({"off_policy_mask_threshold": 0.5}).opsm_delta == 0.5


def test_trl_unknown_key():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        from_trl({"importance_sampling_level": "sequence"})


# ---- NeMo-RL --------------------------------------------------------------------------------------
def test_nemo_use_importance_sampling_correction():
    assert from_nemo_rl({}).is_level is None
    c = from_nemo_rl({"use_importance_sampling_correction": True})
    assert c.is_level == "token" and c.is_upper is None  # plain π_prev/π_gen weights


def test_nemo_tis_with_ratio_and_ratio_min():
    c = from_nemo_rl({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
                      "truncated_importance_sampling_ratio": 2.0, "truncated_importance_sampling_ratio_min": 0.1})
    assert (c.is_mode, c.is_upper, c.is_lower, c.denominator) == ("truncate", 2.0, 0.1, "original")


def test_nemo_icepop():
    c = from_nemo_rl({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
                      "truncated_importance_sampling_ratio": 5.0, "truncated_importance_sampling_ratio_min": 0.5})
    assert (c.is_mode, c.is_upper, c.is_lower) == ("mask", 5.0, 0.5)
    with pytest.raises(ValueError, match="ratio_min"):
        from_nemo_rl({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
                      "truncated_importance_sampling_ratio": 5.0})


def test_nemo_seq_mask_tis():
    c = from_nemo_rl({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
                      "truncated_importance_sampling_ratio": 1.002, "truncated_importance_sampling_ratio_min": 0.999})
    assert c.is_level == "token" and c.is_upper is None
    assert c.rs == ("seq_mean_k1",) and c.rs_thresholds == ((0.999, 1.002),)


def test_nemo_type_needs_correction_and_ratio():
    with pytest.raises(ValueError, match="use_importance_sampling_correction"):
        from_nemo_rl(
            {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}
        )
    with pytest.raises(ValueError, match="truncated_importance_sampling_ratio"):
        from_nemo_rl(
            {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"}
        )
    with pytest.raises(ValueError, match="truncated_importance_sampling_type"):
        from_nemo_rl({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "mis",
                      "truncated_importance_sampling_ratio": 2.0})


def test_nemo_sequence_level_importance_ratios():
    c = from_nemo_rl({"use_importance_sampling_correction": True, "sequence_level_importance_ratios": True})
    assert c.is_level == "sequence"
    with pytest.raises(ValueError, match="incompatible"):
        from_nemo_rl({"use_importance_sampling_correction": True, "sequence_level_importance_ratios": True,
                      "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1.1,
                      "truncated_importance_sampling_ratio_min": 0.9})


def test_nemo_loss_keys_accepted_unknown_rejected():
    assert from_nemo_rl({"ratio_clip_min": 0.2, "ratio_clip_c": 3.0, "use_cispo": False}).is_level is None
    with pytest.raises(ValueError, match="seq_logprob_error_threshold"):
        from_nemo_rl({"seq_logprob_error_threshold": 2.0})


# ---- SkyRL ----------------------------------------------------------------------------------------
def test_skyrl_tis_ratio_type_and_clips():
    assert from_skyrl({}).is_level is None and not rejects(from_skyrl({}))
    c = from_skyrl({"tis_ratio_type": "token"})
    assert (c.is_level, c.is_upper) == ("token", 2.0)
    assert from_skyrl({"tis_ratio_type": "token", "token_tis_ratio_clip_high": 3.0}).is_upper == 3.0
    c = from_skyrl({"tis_ratio_type": "sequence"})
    assert (c.is_level, c.is_upper) == ("sequence", 5.0)
    assert from_skyrl({"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 8.0}).is_upper == 8.0
    with pytest.raises(ValueError, match="tis_ratio_type"):
        from_skyrl({"tis_ratio_type": "geometric"})


def test_skyrl_sequence_mask_metric_geometric_and_product():
    c = from_skyrl({"sequence_mask_metric": "geometric"})
    assert c.rs == ("seq_mean_k1",) and c.rs_thresholds == ((0.99, 1.01),)
    c = from_skyrl({"sequence_mask_metric": "geometric", "geo_mask_low": 0.98, "geo_mask_high": 1.02})
    assert c.rs_thresholds == ((0.98, 1.02),)
    c = from_skyrl({"sequence_mask_metric": "product"})
    assert c.rs == ("seq_sum_k1",) and c.rs_thresholds == ((0.5, 2.0),)
    c = from_skyrl({"sequence_mask_metric": "product", "product_mask_low": 0.25, "product_mask_high": 4.0})
    assert c.rs_thresholds == ((0.25, 4.0),)
    with pytest.raises(ValueError, match="sequence_mask_metric"):
        from_skyrl({"sequence_mask_metric": "max"})


def test_skyrl_outlier_thresholds_are_veto():
    c = from_skyrl({"outlier_token_is_threshold_low": 1e-4, "outlier_token_is_threshold_high": 100.0})
    assert (c.veto_threshold, c.veto_upper) == (1e-4, 100.0)


def test_skyrl_token_mask_thresholds_are_token_k1_windows():
    c = from_skyrl({"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0,
                    "sequence_mask_metric": "geometric"})
    assert c.rs == ("token_k1", "seq_mean_k1") and c.rs_thresholds[0] == (0.5, 2.0)
    with pytest.raises(ValueError, match="together"):
        from_skyrl({"token_mask_is_threshold_low": 0.5})


def test_skyrl_unknown_key():
    with pytest.raises(ValueError, match="use_tis"):
        from_skyrl({"use_tis": True})


# ---- OpenRLHF -------------------------------------------------------------------------------------
def test_openrlhf_disabled_by_default():
    assert from_openrlhf({}).is_level is None


def test_openrlhf_enable_threshold_type_tis():
    c = from_openrlhf({"is_correction_enable": True})
    assert (c.is_level, c.is_mode, c.is_lower, c.is_upper, c.denominator) == (
        "token",
        "truncate",
        0.5,
        5.0,
        "original",
    )
    c = from_openrlhf(
        {"algo.advantage.is_correction_enable": True, "algo.advantage.is_correction_threshold": [0.8, 2.0]}
    )
    assert (c.is_lower, c.is_upper) == (0.8, 2.0)
    with pytest.raises(ValueError, match="is_correction_threshold"):
        from_openrlhf({"is_correction_enable": True, "is_correction_threshold": 5.0})


def test_openrlhf_type_icepop_and_seq_mask_tis():
    c = from_openrlhf({"is_correction_enable": True, "is_correction_type": "icepop"})
    assert c.is_mode == "mask"
    c = from_openrlhf({"is_correction_enable": True, "is_correction_type": "seq-mask-tis"})
    assert c.rs == ("seq_mean_k1",) and c.rs_thresholds == ((0.5, 5.0),) and c.is_upper is None
    with pytest.raises(ValueError, match="is_correction_type"):
        from_openrlhf({"is_correction_enable": True, "is_correction_type": "mis"})


def test_openrlhf_unknown_key():
    with pytest.raises(ValueError, match="is_correction_cap"):
        from_openrlhf({"is_correction_cap": 5.0})
