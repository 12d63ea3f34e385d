"""Environments: the model's turns and what answers them, one turn or many (docs/multi-turn.md).

``Environment`` / ``Episode`` / ``Turn`` (the protocol), ``SingleTurn`` (a task as a one-turn environment),
``register_env`` / ``make_env`` (the registry the config names), ``Renderer`` (messages → appended token ids),
``Episodes`` / ``play`` (a sampler and an environment, turn by turn, into one ``Rollout``),
``parse_tool_calls`` / ``register_tool_parser`` (a turn's text → its tool calls, by a named parser).
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
from rollcorr.envs.tool_calls import (
    TOOL_PARSERS,
    ParsedTurn,
    parse_tool_calls,
    register_tool_parser,
    tool_parser,
)

__all__ = ["ENVIRONMENTS", "Environment", "as_environment", "Episode", "Episodes", "Limits", "ParsedTurn", "Renderer",
           "SingleTurn", "TOOL_PARSERS", "Turn", "episode_metrics", "make_env", "parse_tool_calls", "play",
           "register_env", "register_tool_parser", "tool_parser"]
