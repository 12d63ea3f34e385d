"""verl's rollout-correction helper (``verl.trainer.ppo.rollout_corr_helper``) with verl's signatures and
verl's numbers.

Backed by ``rollcorr.correction.compute_correction`` with ``verl_compat=True``: K1 windows applied to
−log ρ as verl's code does, all rows (even all-padding ones) in the per-sequence metrics, unclamped
``k3_kl``, masked means with verl's +1e-8 added in the dtype of verl's ``mask.sum()``. Checked against the
stored verl outputs (tests/test_verl_parity_correction.py) and the installed verl (tests/test_verl_live.py).

Where verl would silently compute nonsense this raises unless ``strict_verl=True``: positive log-probs on
valid tokens (verl's own tests draw log-probs from ``torch.randn``) and NaN/inf log-probs. A list where a
tensor belongs is a TypeError naming the argument (verl: AttributeError). ``rollout_is`` set with
``rollout_is_threshold=None`` is honoured like verl (no weights).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.dialects import from_verl
from rollcorr.correction.api import PREFIX, compute_correction
from rollcorr.correction.metrics import metrics_to_floats

# Off-policy keys verl reports; rollcorr's other diagnostics are left out so the drop-in returns verl's set.
VERL_OFFPOLICY = (
    "training_ppl",
    "training_log_ppl",
    "kl",
    "k3_kl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
)


def _is_verl_key(key: str) -> bool:
    name = key.removeprefix(PREFIX)
    return name.startswith(("rollout_is_", "rollout_rs_")) or name in VERL_OFFPOLICY


class WeightsProto:
    """What verl wraps its IS weights in when verl is not installed: ``.batch["rollout_is_weights"]``.
    With verl installed the functions return verl's own ``DataProto``."""

    def __init__(self, weights: Tensor) -> None:
        self.batch = {"rollout_is_weights": weights}


def _wrap(weights: Tensor | None) -> Any:
    if weights is None:
        return None
    try:
        from verl.protocol import DataProto
    except ImportError:
        return WeightsProto(weights)
    return DataProto.from_dict(tensors={"rollout_is_weights": weights})


def _require_tensors(**tensors: Any) -> None:
    """A clear TypeError for a list or array where verl expects a tensor (verl: AttributeError on ``.any``)."""
    for name, value in tensors.items():
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (B, T), got {type(value).__name__}; wrap it in torch.tensor(...)")


def _correct(old, rollout, mask, config: CorrectionConfig, strict_verl: bool):
    if not mask.bool().any():  # verl's message, before any work
        raise ValueError("response_mask must contain at least one valid token (1).")
    return compute_correction(old, rollout, mask, config, validate=not strict_verl)


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    *,
    strict_verl: bool = False,
    rules: Any = None,
) -> tuple[Any, Tensor, dict[str, float]]:
    """(IS weights wrapped as verl's ``DataProto`` {"rollout_is_weights": (B, T)} or None, response_mask
    after rejection (input dtype), ``rollout_corr/*`` metrics as floats). ``rules`` (rollcorr's own): rejection
    rules registered from outside, by name with their options (``CorrectionConfig.rules``), ANDed into the mask."""
    _require_tensors(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {old_log_prob.shape} does not match rollout_log_prob shape "
            f"{rollout_log_prob.shape}."
        )
    if isinstance(rollout_is_threshold, bool):  # verl's exception type
        raise TypeError("rollout_is_threshold must be a float or a string threshold specification, not a boolean.")
    if rollout_is is not None and rollout_is_threshold is None:
        rollout_is = None  # verl: IS silently disabled when the threshold is None
    config = from_verl(
        {
            "rollout_is": rollout_is,
            "rollout_is_threshold": rollout_is_threshold,
            "rollout_is_batch_normalize": rollout_is_batch_normalize,
            "rollout_rs": rollout_rs,
            "rollout_rs_threshold": rollout_rs_threshold,
        },
        exact=True,
    )
    if rules:
        config = config.replace(rules=rules)
    result = _correct(old_log_prob, rollout_log_prob, response_mask, config, strict_verl)
    metrics = {k: v for k, v in result.metrics.items() if _is_verl_key(k)}
    return _wrap(result.is_weights), result.kept_mask, metrics_to_floats(metrics)


def _unprefixed(metrics: dict[str, Tensor], start: tuple[str, ...]) -> dict[str, float]:
    out = {k.removeprefix(PREFIX): v for k, v in metrics.items()}
    return metrics_to_floats({k: v for k, v in out.items() if k.startswith(start)})


def compute_rollout_correction_weights(
    log_ratio: Tensor,
    response_mask: Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """verl's IS step alone, from ℓ = log π_old − log μ: ((B, T) weights, ``rollout_is_*`` metrics without
    prefix)."""
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {{'token', 'sequence'}}.")
    config = from_verl(
        {
            "rollout_is": rollout_is,
            "rollout_is_threshold": rollout_is_threshold,
            "rollout_is_batch_normalize": rollout_is_batch_normalize,
        },
        exact=True,
    )
    # ℓ is passed as "old" against a zero rollout, unchecked (ℓ may be positive)
    result = _correct(log_ratio, torch.zeros_like(log_ratio), response_mask, config, True)
    return result.is_weights, _unprefixed(result.metrics, ("rollout_is_",))


def compute_rollout_rejection_mask(
    log_ratio: Tensor,
    response_mask: Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """verl's rejection step alone, from ℓ: (response_mask after rejection, ``rollout_rs_*`` metrics
    without prefix)."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    config = from_verl(
        {"rollout_is": None, "rollout_rs": rollout_rs, "rollout_rs_threshold": rollout_rs_threshold},
        exact=True,
    )
    result = _correct(log_ratio, torch.zeros_like(log_ratio), response_mask, config, True)
    return result.kept_mask, _unprefixed(result.metrics, ("rollout_rs_",))


def compute_offpolicy_metrics(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor | None,
    response_mask: Tensor,
    *,
    strict_verl: bool = False,
) -> dict[str, float]:
    """verl's off-policy diagnostics (KL, k3 KL, PPLs, χ²) without prefix; only the training PPL when
    ``rollout_log_prob`` is None."""
    _require_tensors(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    config = from_verl({"rollout_is": None}, exact=True)
    rollout = old_log_prob if rollout_log_prob is None else rollout_log_prob
    result = _correct(old_log_prob, rollout, response_mask, config, strict_verl)
    keys = VERL_OFFPOLICY if rollout_log_prob is not None else VERL_OFFPOLICY[:2]
    metrics = {k.removeprefix(PREFIX): v for k, v in result.metrics.items()}
    return metrics_to_floats({k: metrics[k] for k in keys})


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    strict_verl: bool = False,
) -> dict[str, float]:
    """verl's actor-side diagnostics: ``compute_offpolicy_metrics`` of the current policy π_θ against μ,
    under the ``rollout_corr/`` prefix."""
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask, strict_verl=strict_verl)
    return {PREFIX + k: v for k, v in metrics.items()}
