"""The aggregation modes and loss denominators: names the loss config, the correction config and the trainer
share. A leaf module (nothing from rollcorr is imported).

The losses themselves, their defaults and ``LossConfig`` live in the loss catalogue
(``rollcorr.losses.registry``): each loss declares itself there once.
"""

from __future__ import annotations

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
# Loss denominator after rejection: kept tokens, the pre-rejection counts, or every sequence of the batch
# (TRM).
DENOMINATORS = ("kept", "original", "batch")
