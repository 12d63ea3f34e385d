"""The loss names, their default ε / aggregation, and `LossConfig` — defined once in `rollcorr.config.loss`
(a leaf module the trainer's validation reads too); the losses import them from here."""

from __future__ import annotations

from rollcorr.config.loss import (
    AGG_MODES,
    DENOMINATORS,
    IS_LOSSES,
    LOSS_DEFAULTS,
    LOSS_NAMES,
    PER_SEQUENCE_LOSSES,
    REGRESSION_LOSSES,
    LossConfig,
)

__all__ = [
    "AGG_MODES",
    "DENOMINATORS",
    "IS_LOSSES",
    "LOSS_DEFAULTS",
    "LOSS_NAMES",
    "PER_SEQUENCE_LOSSES",
    "REGRESSION_LOSSES",
    "LossConfig",
]
