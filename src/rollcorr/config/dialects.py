"""Peers' configuration keys translated into a ``CorrectionConfig``. Nothing else in rollcorr knows them.

Each ``from_<peer>(mapping)`` takes the peer's own keys with the peer's defaults for missing ones, and
raises ``ValueError`` on a key it does not know (a typo must not silently turn a correction off). Sources
and defaults: each peer's public config classes (docs/spec.md §10 links them); the mapping table is in
docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from rollcorr.config.correction import CorrectionConfig


def _check_keys(peer: str, data: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"from_{peer} needs a mapping of {peer} keys, got {type(data).__name__}")
    known = set(known)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {peer} key(s) {unknown}; known keys: {sorted(known)}")
    return dict(data)


def _flag(peer: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{peer} key {key} must be a bool, got {value!r}")
    return value


# ---- verl ---------------------------------------------------------------------------------------
VERL_KEYS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
)


def parse_verl_is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number or ``"C"`` → (C, None) TIS; ``"lo_hi"`` → (hi, lo) IcePop."""
    if isinstance(spec, bool):
        raise ValueError("verl rollout_is_threshold must be a number or a 'lo_hi' string, not a bool")
    if isinstance(spec, int | float):
        return float(spec), None
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"verl rollout_is_threshold must be a number or a non-empty string, got {spec!r}")
    text = spec.strip()
    try:
        if "_" in text:
            lo, hi = text.split("_", 1)
            return float(hi), float(lo)
        return float(text), None
    except ValueError:
        raise ValueError(f"verl rollout_is_threshold {spec!r} is not 'C' or 'lo_hi'") from None


VERL_TARGET = "verl.trainer.config.RolloutCorrectionConfig"


def verl_mapping(config: Any) -> dict[str, Any]:
    """A verl ``RolloutCorrectionConfig`` as a plain dict: the dataclass itself, an OmegaConf node or a dict
    (Hydra's ``_target_`` key is checked and dropped). Missing keys take the dataclass defaults, so a missing
    ``rollout_is`` is ``"sequence"`` as in verl's ``RolloutCorrectionConfig()`` (verl's YAML sets it null)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    elif isinstance(config, Mapping):
        data = dict(config.items())
    else:
        raise ValueError(f"from_verl needs a mapping of verl keys, got {type(config).__name__}")
    target = data.pop("_target_", None)
    if target and str(target).rsplit(".", 1)[-1] != "RolloutCorrectionConfig":
        raise ValueError(f"verl _target_ {target!r} is not a RolloutCorrectionConfig ({VERL_TARGET})")
    return {**VERL_DEFAULTS, **data}


# verl's RolloutCorrectionConfig dataclass defaults (verl 0.9.1, verl/trainer/config/algorithm.py).
VERL_DEFAULTS: dict[str, Any] = {
    "rollout_is": "sequence",
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
    "loss_type": "ppo_clip",
}


def from_verl(data: Any, *, exact: bool = False) -> CorrectionConfig:
    """``algorithm.rollout_correction``: verl's dataclass, an OmegaConf node or a dict (``_target_``
    allowed); missing keys take the dataclass defaults (``rollout_is="sequence"``, threshold 2.0, no RS).

    ``exact=True`` sets ``verl_compat`` (K1 windows applied to −log ρ as verl's code does, verl's biased
    per-sequence metrics). Where verl silently disables IS (``rollout_is`` set, threshold ``None``) this
    raises instead. Decoupled mode normalises over the whole batch and averages over kept tokens; bypass
    mode normalises per micro-batch and keeps the original token count (the bypass loss divides by the count
    taken before rejection: verl issue #4852, https://github.com/verl-project/verl/issues/4852).
    """
    d = _check_keys("verl", verl_mapping(data), VERL_KEYS)
    level = d.get("rollout_is")
    threshold = d.get("rollout_is_threshold", 2.0)
    bypass = _flag("verl", "bypass_mode", d.get("bypass_mode", False))
    is_mode, upper, lower = "truncate", 2.0, None
    if level is not None:
        if level not in ("token", "sequence"):
            raise ValueError(f"verl rollout_is={level!r}; verl allows 'token', 'sequence' or null")
        if threshold is None:
            raise ValueError(
                "verl rollout_is is set but rollout_is_threshold is null: verl would silently compute no "
                "weights; set a threshold or rollout_is: null"
            )
    if threshold is not None:
        upper, lower = parse_verl_is_threshold(threshold)
        is_mode = "mask" if lower is not None else "truncate"
    rs, rs_threshold = d.get("rollout_rs"), d.get("rollout_rs_threshold")
    if rs is not None and rs_threshold is None:
        raise ValueError("verl rollout_rs is set but rollout_rs_threshold is null (verl requires it)")
    if rs is not None:
        rs = [part.strip() for part in str(rs).split(",") if part.strip()]
        rs = list(dict.fromkeys(rs))  # verl drops duplicates, keeping order
        beyond = [o for o in rs if o.endswith("binary_kl")]
        if beyond:  # rollcorr options that verl's SUPPORTED_ROLLOUT_RS_OPTIONS lacks: verl raises on them
            raise ValueError(f"verl rollout_rs: {beyond} are not verl options (AReaL's binary_kl metric)")
        if isinstance(rs_threshold, bool):
            raise ValueError("verl rollout_rs_threshold must be a number or a string, not a bool")
        if isinstance(rs_threshold, int | float):
            rs_threshold = str(rs_threshold)
    return CorrectionConfig(
        mode="bypass" if bypass else "decoupled",
        loss_type=d.get("loss_type", "ppo_clip"),
        is_level=level,
        is_mode=is_mode,
        is_upper=upper,
        is_lower=lower,
        batch_normalize=_flag(
            "verl", "rollout_is_batch_normalize", d.get("rollout_is_batch_normalize", False)
        )
        and level is not None,
        batch_norm_scope="micro_batch" if bypass else "batch",
        rs=rs or (),
        rs_thresholds=rs_threshold if rs else (),
        denominator="original" if bypass else "kept",
        verl_compat=exact,
    )


# ---- TRL ----------------------------------------------------------------------------------------
TRL_KEYS = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
    "off_policy_mask_threshold",
)
TRL_MODES = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}


def from_trl(data: Mapping[str, Any]) -> CorrectionConfig:
    """``GRPOConfig`` vLLM IS keys (defaults: correction on, ``sequence_mask``, clip_max 3.0, clip_min None)
    plus ``off_policy_mask_threshold`` (OPSM). TRL zeroes weights but divides by all active tokens, so the
    denominator is ``original``. ``vllm_importance_sampling_cap`` is the deprecated name of clip_max."""
    d = _check_keys("trl", data, TRL_KEYS)
    if "vllm_importance_sampling_cap" in d:
        if "vllm_importance_sampling_clip_max" in d:
            raise ValueError("give vllm_importance_sampling_clip_max or the deprecated _cap, not both")
        d["vllm_importance_sampling_clip_max"] = d.pop("vllm_importance_sampling_cap")
    enabled = _flag(
        "trl", "vllm_importance_sampling_correction", d.get("vllm_importance_sampling_correction", True)
    )
    mode = d.get("vllm_importance_sampling_mode", "sequence_mask")
    if mode not in TRL_MODES:
        raise ValueError(f"trl vllm_importance_sampling_mode={mode!r}; allowed: {list(TRL_MODES)}")
    level, is_mode = TRL_MODES[mode]
    upper = d.get("vllm_importance_sampling_clip_max", 3.0)
    lower = d.get("vllm_importance_sampling_clip_min")
    if enabled and is_mode == "mask" and upper is None and lower is None:
        raise ValueError("trl mask mode with clip_max and clip_min both None masks nothing")
    return CorrectionConfig(
        is_level=level if enabled else None,
        is_mode=is_mode,
        is_upper=upper,
        is_lower=lower,
        opsm_delta=d.get("off_policy_mask_threshold"),
        denominator="original",
    )


# ---- NeMo-RL ------------------------------------------------------------------------------------
NEMO_RL_KEYS = (
    "use_importance_sampling_correction",
    "truncated_importance_sampling_type",
    "truncated_importance_sampling_ratio",
    "truncated_importance_sampling_ratio_min",
    "sequence_level_importance_ratios",
)
# ClippedPGLossConfig keys that belong to the loss, not the correction: accepted and left to rollcorr.losses.
NEMO_RL_LOSS_KEYS = (
    "disable_ppo_ratio",
    "token_level_loss",
    "ratio_clip_min",
    "ratio_clip_max",
    "ratio_clip_c",
    "reference_policy_kl_penalty",
    "reference_policy_kl_type",
    "kl_input_clamp_value",
    "kl_output_clamp_value",
    "use_kl_in_reward",
    "use_on_policy_kl_approximation",
    "force_on_policy_ratio",
    "use_cispo",
    "positive_example_nll_weight",
)


def from_nemo_rl(data: Mapping[str, Any]) -> CorrectionConfig:
    """``ClippedPGLossConfig``: the IS correction is π_prev/π_gen; ``tis`` clamps to [ratio_min or 0, ratio],
    ``icepop`` zeroes outside [ratio_min, ratio], ``seq-mask-tis`` zeroes whole sequences whose geometric
    mean ratio is outside [ratio_min, ratio] and keeps untruncated token weights. NeMo-RL keeps zeroed
    tokens in the denominator (``original``)."""
    d = _check_keys("nemo_rl", data, NEMO_RL_KEYS + NEMO_RL_LOSS_KEYS)
    enabled = _flag(
        "nemo_rl", "use_importance_sampling_correction", d.get("use_importance_sampling_correction", False)
    )
    kind = d.get("truncated_importance_sampling_type")
    upper = d.get("truncated_importance_sampling_ratio")
    lower = d.get("truncated_importance_sampling_ratio_min")
    seq_level = _flag(
        "nemo_rl", "sequence_level_importance_ratios", d.get("sequence_level_importance_ratios", False)
    )
    level = "sequence" if seq_level else "token"
    if kind is None:
        if upper is not None or lower is not None:
            raise ValueError("nemo_rl truncated_importance_sampling_ratio(_min) given without a _type")
        return CorrectionConfig(is_level=level if enabled else None, is_upper=None, denominator="original")
    if kind not in ("tis", "icepop", "seq-mask-tis"):
        raise ValueError(
            f"nemo_rl truncated_importance_sampling_type={kind!r}; allowed: ['tis', 'icepop', 'seq-mask-tis']"
        )
    if not enabled:
        raise ValueError(
            "nemo_rl truncated_importance_sampling_type needs use_importance_sampling_correction=True"
        )
    if upper is None:
        raise ValueError(
            f"nemo_rl truncated_importance_sampling_type={kind!r} needs truncated_importance_sampling_ratio"
        )
    if kind == "tis":
        return CorrectionConfig(
            is_level=level, is_upper=upper, is_lower=lower or None, denominator="original"
        )
    if lower is None:
        raise ValueError(f"nemo_rl {kind} needs truncated_importance_sampling_ratio_min")
    if kind == "icepop":
        return CorrectionConfig(
            is_level=level, is_mode="mask", is_upper=upper, is_lower=lower, denominator="original"
        )
    if seq_level:
        raise ValueError("nemo_rl seq-mask-tis is incompatible with sequence_level_importance_ratios=True")
    return CorrectionConfig(
        is_level="token",
        is_upper=None,
        rs=("seq_mean_k1",),
        rs_thresholds=((lower, upper),),
        denominator="original",
    )


# ---- SkyRL --------------------------------------------------------------------------------------
SKYRL_KEYS = (
    "tis_ratio_type",
    "token_tis_ratio_clip_high",
    "sequence_tis_ratio_clip_high",
    "sequence_mask_metric",
    "geo_mask_low",
    "geo_mask_high",
    "product_mask_low",
    "product_mask_high",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
)


def from_skyrl(data: Mapping[str, Any]) -> CorrectionConfig:
    """``trainer.algorithm.off_policy_correction``. Masks multiply SkyRL's ``loss_mask``, so they are
    rejections here (RS / veto), and the loss averages over kept tokens."""
    d = _check_keys("skyrl", data, SKYRL_KEYS)
    tis_type = d.get("tis_ratio_type")
    if tis_type not in (None, "token", "sequence"):
        raise ValueError(f"skyrl tis_ratio_type={tis_type!r}; allowed: [None, 'token', 'sequence']")
    upper = (
        d.get("token_tis_ratio_clip_high", 2.0)
        if tis_type == "token"
        else d.get("sequence_tis_ratio_clip_high", 5.0)
    )
    rs: list[str] = []
    thresholds: list[Any] = []
    metric = d.get("sequence_mask_metric")
    if metric == "geometric":
        rs.append("seq_mean_k1")
        thresholds.append((d.get("geo_mask_low", 0.99), d.get("geo_mask_high", 1.01)))
    elif metric == "product":
        rs.append("seq_sum_k1")
        thresholds.append((d.get("product_mask_low", 0.5), d.get("product_mask_high", 2.0)))
    elif metric is not None:
        raise ValueError(f"skyrl sequence_mask_metric={metric!r}; allowed: [None, 'geometric', 'product']")
    tok_lo, tok_hi = d.get("token_mask_is_threshold_low"), d.get("token_mask_is_threshold_high")
    if (tok_lo is None) != (tok_hi is None):
        raise ValueError("skyrl token_mask_is_threshold_low and _high must be given together")
    if tok_lo is not None:
        rs.insert(0, "token_k1")
        thresholds.insert(0, (tok_lo, tok_hi))
    return CorrectionConfig(
        is_level=tis_type,
        is_upper=upper if tis_type is not None else 2.0,
        rs=tuple(rs),
        rs_thresholds=tuple(thresholds),
        veto_threshold=d.get("outlier_token_is_threshold_low"),
        veto_upper=d.get("outlier_token_is_threshold_high"),
    )


# ---- OpenRLHF -----------------------------------------------------------------------------------
OPENRLHF_KEYS = ("is_correction_enable", "is_correction_threshold", "is_correction_type")
_OPENRLHF_PREFIX = "algo.advantage."


def from_openrlhf(data: Mapping[str, Any]) -> CorrectionConfig:
    """``--algo.advantage.is_correction_*`` (bare or prefixed keys; defaults off, [0.5, 5.0], ``tis``).
    ``tis`` clamps ρ to [low, high]; ``icepop`` zeroes outside; ``seq-mask-tis`` zeroes sequences whose
    geometric mean ratio is outside [low, high]. The denominator is the original token count."""
    if not isinstance(data, Mapping):
        raise ValueError(f"from_openrlhf needs a mapping, got {type(data).__name__}")
    bare = {k.removeprefix(_OPENRLHF_PREFIX) for k in data if k.startswith(_OPENRLHF_PREFIX)} & set(data)
    for key in sorted(bare):
        if data[key] != data[_OPENRLHF_PREFIX + key]:
            raise ValueError(f"openrlhf: {key}={data[key]!r} and {_OPENRLHF_PREFIX}{key}="
                             f"{data[_OPENRLHF_PREFIX + key]!r} disagree; give one of them")
    d = _check_keys("openrlhf", {k.removeprefix(_OPENRLHF_PREFIX): v for k, v in data.items()}, OPENRLHF_KEYS)
    enabled = _flag("openrlhf", "is_correction_enable", d.get("is_correction_enable", False))
    window = d.get("is_correction_threshold", (0.5, 5.0))
    if not isinstance(window, list | tuple) or len(window) != 2:
        raise ValueError(f"openrlhf is_correction_threshold must be [low, high], got {window!r}")
    low, high = window
    kind = d.get("is_correction_type", "tis")
    if kind not in ("tis", "icepop", "seq-mask-tis"):
        raise ValueError(f"openrlhf is_correction_type={kind!r}; allowed: ['tis', 'icepop', 'seq-mask-tis']")
    if not enabled:
        return CorrectionConfig(denominator="original")
    if kind == "tis":
        return CorrectionConfig(is_level="token", is_lower=low, is_upper=high, denominator="original")
    if kind == "icepop":
        return CorrectionConfig(
            is_level="token", is_mode="mask", is_lower=low, is_upper=high, denominator="original"
        )
    return CorrectionConfig(
        is_level="token",
        is_upper=None,
        rs=("seq_mean_k1",),
        rs_thresholds=((low, high),),
        denominator="original",
    )
