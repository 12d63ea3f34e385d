"""Configuration: the correction config, named presets, the peers' dialects, the loss aggregation modes
(layer 2; ``LossConfig`` lives with the loss catalogue, ``rollcorr.losses``)."""

from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.dialects import from_nemo_rl, from_openrlhf, from_skyrl, from_trl, from_verl
from rollcorr.config.loss import AGG_MODES, DENOMINATORS
from rollcorr.config.presets import PRESETS, preset

__all__ = [
    "AGG_MODES",
    "DENOMINATORS",
    "PRESETS",
    "CorrectionConfig",
    "from_nemo_rl",
    "from_openrlhf",
    "from_skyrl",
    "from_trl",
    "from_verl",
    "preset",
]
