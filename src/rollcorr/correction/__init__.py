"""The correction library (layer 1): log-ratios, IS weights, rejection masks and diagnostics."""

from rollcorr.correction.api import AllRejectedWarning, CorrectionResult, compute_correction
from rollcorr.correction.metrics import metrics_to_floats, mismatch_stats

__all__ = [
    "AllRejectedWarning",
    "CorrectionResult",
    "compute_correction",
    "metrics_to_floats",
    "mismatch_stats",
]
