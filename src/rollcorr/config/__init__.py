"""Configuration: the correction config, named presets and the peers' dialects (layer 2)."""

from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.dialects import from_nemo_rl, from_openrlhf, from_skyrl, from_trl, from_verl
from rollcorr.config.presets import PRESETS, preset

__all__ = [
    "PRESETS",
    "CorrectionConfig",
    "from_nemo_rl",
    "from_openrlhf",
    "from_skyrl",
    "from_trl",
    "from_verl",
    "preset",
]
