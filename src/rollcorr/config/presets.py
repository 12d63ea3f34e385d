"""Named recipes: every verl preset (same names, same defaults as verl's
``RolloutCorrectionConfig`` classmethods, docs/spec.md §9) and the other frameworks' ones.

``preset("decoupled_token_is", threshold=3.0)`` builds a ``CorrectionConfig``; the keyword arguments are those
of the recipe (``threshold``, ``threshold_lower``, ``is_threshold``, ``rs_threshold``, …). verl's K1 windows
such as ``"0.999_1.001"`` are read with their documented meaning (a window on ρ), see docs/rejection.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.dialects import from_nemo_rl, from_openrlhf, from_skyrl, from_trl, from_verl

GEO = "0.999_1.001"  # verl's Geo-RS default window on the geometric-mean ratio


def _verl(is_level=None, is_threshold=2.0, rs=None, rs_threshold=None, bypass=False, loss_type="ppo_clip"):
    """A verl preset: verl's own keys, read by the one verl mapping (``dialects.from_verl``). A number as IS
    threshold means TIS (truncate); a (lo, hi) pair is verl's "lo_hi" string, IcePop (mask)."""
    if isinstance(is_threshold, tuple):
        is_threshold = f"{is_threshold[0]}_{is_threshold[1]}"
    return from_verl({"rollout_is": is_level, "rollout_is_threshold": is_threshold, "rollout_rs": rs,
                      "rollout_rs_threshold": rs_threshold, "bypass_mode": bypass, "loss_type": loss_type})


# ---- verl (RolloutCorrectionConfig classmethods) ------------------------------------------------
def decoupled_token_is(threshold: float = 2.0) -> CorrectionConfig:
    return _verl("token", threshold)


def decoupled_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> CorrectionConfig:
    return _verl("token", (threshold_lower, threshold))


def decoupled_seq_is(threshold: float = 2.0) -> CorrectionConfig:
    return _verl("sequence", threshold)


def decoupled_seq_is_rs(is_threshold: float = 2.0, rs_threshold: Any = "0.5_2.0") -> CorrectionConfig:
    return _verl("sequence", is_threshold, "seq_sum_k1", rs_threshold)


def decoupled_geo_rs(rs_threshold: Any = GEO) -> CorrectionConfig:
    return _verl(None, 2.0, "seq_mean_k1", rs_threshold)


def decoupled_geo_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: Any = GEO) -> CorrectionConfig:
    return _verl("sequence", is_threshold, "seq_mean_k1", rs_threshold)


def decoupled_geo_rs_token_tis(is_threshold: float = 2.0, rs_threshold: Any = GEO) -> CorrectionConfig:
    return _verl("token", is_threshold, "seq_mean_k1", rs_threshold)


def decoupled_k3_rs(rs_threshold: float = 0.01) -> CorrectionConfig:
    return _verl(None, 2.0, "seq_mean_k3", rs_threshold)


def decoupled_k3_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: float = 0.01) -> CorrectionConfig:
    return _verl("sequence", is_threshold, "seq_mean_k3", rs_threshold)


def decoupled_k3_rs_token_tis(is_threshold: float = 2.0, rs_threshold: float = 0.01) -> CorrectionConfig:
    return _verl("token", is_threshold, "seq_mean_k3", rs_threshold)


def bypass_ppo_clip() -> CorrectionConfig:
    return _verl(None, bypass=True)


def bypass_ppo_clip_geo_rs(rs_threshold: Any = GEO) -> CorrectionConfig:
    return _verl(None, 2.0, "seq_mean_k1", rs_threshold, bypass=True)


def bypass_ppo_clip_k3_rs(rs_threshold: float = 0.01) -> CorrectionConfig:
    return _verl(None, 2.0, "seq_mean_k3", rs_threshold, bypass=True)


def bypass_pg_is(threshold: float = 2.0) -> CorrectionConfig:
    return _verl("sequence", threshold, bypass=True, loss_type="reinforce")


def bypass_pg_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> CorrectionConfig:
    return _verl("token", (threshold_lower, threshold), bypass=True, loss_type="reinforce")


def bypass_pg_geo_rs(rs_threshold: Any = GEO) -> CorrectionConfig:
    return _verl(None, 2.0, "seq_mean_k1", rs_threshold, bypass=True, loss_type="reinforce")


def bypass_pg_geo_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: Any = GEO) -> CorrectionConfig:
    return _verl("sequence", is_threshold, "seq_mean_k1", rs_threshold, bypass=True, loss_type="reinforce")


def bypass_pg_geo_rs_token_tis(is_threshold: float = 2.0, rs_threshold: Any = GEO) -> CorrectionConfig:
    return _verl("token", is_threshold, "seq_mean_k1", rs_threshold, bypass=True, loss_type="reinforce")


def disabled() -> CorrectionConfig:
    return CorrectionConfig()


# ---- papers -------------------------------------------------------------------------------------
def tis(threshold: float = 2.0) -> CorrectionConfig:
    """Token TIS (Yao et al.): w_t = min(ρ_t, C)."""
    return CorrectionConfig(is_level="token", is_upper=threshold)


def icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> CorrectionConfig:
    """IcePop: w_t = ρ_t·1[α ≤ ρ_t ≤ β], α = 0.5, β = 5 (Ring-1T)."""
    return CorrectionConfig(is_level="token", is_mode="mask", is_lower=threshold_lower, is_upper=threshold)


def seq_mis(threshold: float = 2.0) -> CorrectionConfig:
    """Seq-MIS (Liu et al.): w = ρ(y)·1[ρ(y) ≤ C] on the whole sequence."""
    return CorrectionConfig(is_level="sequence", is_mode="mask", is_upper=threshold)


def geo_is(threshold: float = 1.01) -> CorrectionConfig:
    """Geometric (length-normalised) truncated IS weights: w = min(exp(mean_t ℓ_t), C)."""
    return CorrectionConfig(is_level="geometric", is_upper=threshold)


def trm_max_k2_mean_k3(max_k2: float = 0.05, mean_k3: float = 0.001) -> CorrectionConfig:
    """Trust-region masking (Li et al., combined criterion), loss normalised by the whole batch N."""
    return CorrectionConfig(trm_max_k2=max_k2, trm_mean_k3=mean_k3, denominator="batch")


def opsm(delta: float = 1e-4) -> CorrectionConfig:
    """DeepSeek-V3.2 off-policy sequence masking (slime default δ = 1e-4)."""
    return CorrectionConfig(opsm_delta=delta)


# ---- other frameworks: their own keys, read by their mapping in dialects.py ---------------------
def _nemo_rl(kind: str, ratio: float, ratio_min: float | None) -> CorrectionConfig:
    return from_nemo_rl({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": kind,
                         "truncated_importance_sampling_ratio": ratio,
                         "truncated_importance_sampling_ratio_min": ratio_min})


def _openrlhf(kind: str, low: float, high: float) -> CorrectionConfig:
    return from_openrlhf({"is_correction_enable": True, "is_correction_threshold": [low, high],
                          "is_correction_type": kind})


def trl_sequence_mask(clip_max: float = 3.0) -> CorrectionConfig:
    """TRL default ``vllm_importance_sampling_mode="sequence_mask"``, clip_max 3.0 (zero weight outside)."""
    return from_trl({"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": clip_max})


def trl_token_truncate(clip_max: float = 3.0) -> CorrectionConfig:
    return from_trl({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": clip_max})


def nemo_rl_tis(ratio: float = 2.0) -> CorrectionConfig:
    return _nemo_rl("tis", ratio, None)


def nemo_rl_icepop(ratio: float = 5.0, ratio_min: float = 0.5) -> CorrectionConfig:
    return _nemo_rl("icepop", ratio, ratio_min)


def nemo_rl_seq_mask_tis(ratio: float = 1.002, ratio_min: float = 0.999) -> CorrectionConfig:
    """NeMo-RL / OpenRLHF seq-mask-tis: untruncated token ρ, whole sequence zeroed unless the geometric
    mean ratio is in [min, max]; zeroed tokens stay in the denominator."""
    return _nemo_rl("seq-mask-tis", ratio, ratio_min)


def skyrl_geo_mask(low: float = 0.99, high: float = 1.01) -> CorrectionConfig:
    """SkyRL ``sequence_mask_metric="geometric"`` (the docs' first recommendation)."""
    return from_skyrl({"sequence_mask_metric": "geometric", "geo_mask_low": low, "geo_mask_high": high})


def skyrl_token_tis(clip_high: float = 2.0) -> CorrectionConfig:
    return from_skyrl({"tis_ratio_type": "token", "token_tis_ratio_clip_high": clip_high})


def skyrl_outlier(low: float = 1e-4, high: float = 100.0) -> CorrectionConfig:
    """SkyRL outlier sequences: drop the sequence if any token ratio is outside [low, high]."""
    return from_skyrl({"outlier_token_is_threshold_low": low, "outlier_token_is_threshold_high": high})


def slime_tis(clip: float = 2.0) -> CorrectionConfig:
    """slime ``--use-tis --tis-clip 2.0`` (tis-clip-low 0); the denominator stays the original count."""
    return CorrectionConfig(is_level="token", is_upper=clip, denominator="original")


def slime_veto(clip: float = 2.0, veto: float = 1e-4) -> CorrectionConfig:
    """slime MIS helper: token TIS plus the catastrophic-token veto (ρ_t < 1e-4 drops the sequence)."""
    return CorrectionConfig(is_level="token", is_upper=clip, veto_threshold=veto, denominator="original")


def slime_opsm(delta: float = 1e-4) -> CorrectionConfig:
    return CorrectionConfig(opsm_delta=delta, denominator="original")


def areal_decoupled_cap(cap: float = 5.0) -> CorrectionConfig:
    """AReaL's old default (token_mask, cap 5): w_t = 0 where ρ_t > cap, token kept in the denominator."""
    return CorrectionConfig(is_level="token", is_mode="mask", is_upper=cap, denominator="original")


def openrlhf_tis(low: float = 0.5, high: float = 5.0) -> CorrectionConfig:
    """OpenRLHF ``is_correction_type=tis``: w = clamp(ρ, low, high) (note the lower clamp)."""
    return _openrlhf("tis", low, high)


def openrlhf_icepop(low: float = 0.5, high: float = 5.0) -> CorrectionConfig:
    return _openrlhf("icepop", low, high)


def openrlhf_seq_mask_tis(low: float = 0.5, high: float = 5.0) -> CorrectionConfig:
    return nemo_rl_seq_mask_tis(ratio=high, ratio_min=low)


def prime_rl_masked_is(token_low: float = 0.125, token_high: float = 8.0, geo_low: float = 0.1,
                       geo_high: float = 10.0) -> CorrectionConfig:
    """prime-rl's former default: token mask [1/8, 8] and geometric sequence mask [0.1, 10]."""
    return CorrectionConfig(
        rs=("token_k1", "seq_mean_k1"),
        rs_thresholds=((token_low, token_high), (geo_low, geo_high)),
        denominator="original",
    )


PRESETS: dict[str, Callable[..., CorrectionConfig]] = {
    f.__name__: f
    for f in (
        decoupled_token_is,
        decoupled_token_icepop,
        decoupled_seq_is,
        decoupled_seq_is_rs,
        decoupled_geo_rs,
        decoupled_geo_rs_seq_tis,
        decoupled_geo_rs_token_tis,
        decoupled_k3_rs,
        decoupled_k3_rs_seq_tis,
        decoupled_k3_rs_token_tis,
        bypass_ppo_clip,
        bypass_ppo_clip_geo_rs,
        bypass_ppo_clip_k3_rs,
        bypass_pg_is,
        bypass_pg_token_icepop,
        bypass_pg_geo_rs,
        bypass_pg_geo_rs_seq_tis,
        bypass_pg_geo_rs_token_tis,
        disabled,
        tis,
        icepop,
        seq_mis,
        geo_is,
        trm_max_k2_mean_k3,
        opsm,
        trl_sequence_mask,
        trl_token_truncate,
        nemo_rl_tis,
        nemo_rl_icepop,
        nemo_rl_seq_mask_tis,
        skyrl_geo_mask,
        skyrl_token_tis,
        skyrl_outlier,
        slime_tis,
        slime_veto,
        slime_opsm,
        areal_decoupled_cap,
        openrlhf_tis,
        openrlhf_icepop,
        openrlhf_seq_mask_tis,
        prime_rl_masked_is,
    )
}


def preset(name: str, **kwargs: Any) -> CorrectionConfig:
    """Build the named recipe; ``kwargs`` override its parameters (see each function's signature)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    factory = PRESETS[name]
    params = inspect.signature(factory).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"preset {name!r} has no parameter(s) {unknown}; it takes {list(params)}")
    return factory(**kwargs)


class PresetError(ValueError):
    """A bad correction spec; ``key`` is the spec key at fault ("preset" or a CorrectionConfig field)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


def resolve(spec: Mapping[str, Any]) -> CorrectionConfig:
    """The one resolver of a correction spec ``{"preset": name, <CorrectionConfig field>: value, ...}``: the
    preset's config with the given fields replaced; without ``"preset"``, the fields alone (CorrectionConfig's
    defaults for the rest). Used by ``rollcorr train`` (``algorithm.correction``) and ``rollcorr analyze``.
    Raises ``PresetError`` naming the key at fault."""
    if not isinstance(spec, Mapping):
        raise PresetError("", f"expected a mapping such as {{preset: decoupled_token_is}}, got {spec!r}")
    fields = dict(spec)
    name = fields.pop("preset", None)
    known = {f.name for f in dataclasses.fields(CorrectionConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise PresetError(unknown[0], f"unknown correction field; known: {sorted(known)}")
    if name is not None and name not in PRESETS:
        raise PresetError("preset", f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    try:
        if name is None:
            return CorrectionConfig(**fields)
        return dataclasses.replace(PRESETS[name](), **fields)
    except (TypeError, ValueError) as err:
        message = str(err)
        for field in sorted(known, key=len, reverse=True):  # "loss_type='reinforce' ..." names its field
            if message.startswith(f"{field}="):
                raise PresetError(field, message[len(field) + 1 :].lstrip()) from None
        raise PresetError("", message) from None
