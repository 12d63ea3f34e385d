"""Configuration: the correction config, named presets, the peers' dialects and the loss config (layer 2)."""

from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.dialects import from_nemo_rl, from_openrlhf, from_skyrl, from_trl, from_verl
from rollcorr.config.loss import AGG_MODES, LOSS_NAMES, LossConfig
from rollcorr.config.presets import PRESETS, preset

__all__ = [
    "AGG_MODES",
    "LOSS_NAMES",
    "PRESETS",
    "CorrectionConfig",
    "LossConfig",
    "from_nemo_rl",
    "from_openrlhf",
    "from_skyrl",
    "from_trl",
    "from_verl",
    "preset",
]
