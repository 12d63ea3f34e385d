"""Environments: the model's turns and what answers them, one turn or many (docs/multi-turn.md).

``Environment`` / ``Episode`` / ``Turn`` (the protocol), ``SingleTurn`` (a task as a one-turn environment),
``register_env`` / ``make_env`` (the registry the config names), ``Renderer`` (messages → appended token ids),
``Episodes`` / ``play`` (a sampler and an environment, turn by turn, into one ``Rollout``).
"""

from __future__ import annotations

from rollcorr.envs import calculator, checkpoints, skyrl, verifiers  # noqa: F401  (register the built-ins, the adapters)
from rollcorr.envs.base import (
    ENVIRONMENTS,
    Environment,
    Episode,
    SingleTurn,
    Turn,
    as_environment,
    make_env,
    register_env,
)
from rollcorr.envs.episodes import Episodes, Limits, episode_metrics, play
from rollcorr.envs.render import Renderer

__all__ = ["ENVIRONMENTS", "Environment", "as_environment", "Episode", "Episodes", "Limits", "Renderer", "SingleTurn", "Turn",
           "episode_metrics", "make_env", "play", "register_env"]
