"""verl's ``compute_rollout_correction_and_rejection_mask`` with verl's signature and verl's numbers.

Backed by ``rollcorr.correction.compute_correction`` with ``verl_compat=True``: K1 windows applied to
−log ρ as verl's code does, all rows (even all-padding ones) in the per-sequence metrics, unclamped
``k3_kl``, masked means with verl's +1e-8. Reproduces every weight, mask and metric of the "correction"
cases in tests/data/verl_vectors.json (tests/test_verl_parity_correction.py).

Where verl would silently compute nonsense this raises instead: NaN/inf or positive log-probs on valid
tokens, and a single K1 threshold below 1 (verl turns C = 0.5 into the empty window [2, 0.5]).
``rollout_is`` set with ``rollout_is_threshold=None`` is honoured like verl (no weights).
"""

from __future__ import annotations

from torch import Tensor

from rollcorr.config.dialects import from_verl
from rollcorr.correction.api import PREFIX, compute_correction
from rollcorr.correction.metrics import metrics_to_floats

# Keys rollcorr adds beyond verl's; the drop-in returns exactly verl's metric set.
_VERL_OFFPOLICY = (
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
    return name.startswith(("rollout_is_", "rollout_rs_")) or name in _VERL_OFFPOLICY


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """(IS weights (B, T) or None, response_mask after rejection, ``rollout_corr/*`` metrics as floats).

    verl returns the weights wrapped in a ``DataProto``; this returns the tensor itself."""
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
    result = compute_correction(old_log_prob, rollout_log_prob, response_mask, config)
    metrics = {k: v for k, v in result.metrics.items() if _is_verl_key(k)}
    return result.weights, result.mask, metrics_to_floats(metrics)
