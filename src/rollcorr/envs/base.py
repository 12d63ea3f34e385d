"""Environments: what the model talks to, for one turn or many (docs/multi-turn.md).

An environment holds items, as a task does (``sample``, ``held_out``), and starts one *episode* per
trajectory; the episode owns that trajectory's state, so episodes run side by side safely:

    episode = env.reset(item)               # episode.prompt: the first messages (or text)
    turn = episode.step(response_text)      # Turn(observation, reward, done): the environment's reply

The trajectory's reward is the sum of its turns' rewards (one number in [0, 1] for the built-in ones, what
greedy accuracy reads). A task is the one-turn case — ``SingleTurn(task)``: its episode's first step is done
and scored by ``task.reward`` — so the trainer, the evaluation and the audit have one path, whatever the
number of turns.

Environments are named in the config (``task.env: {name: ..., <options>}``) and built by the factory
registered under that name (``register_env``): the built-ins register here and in their modules, a plugin
registers its own the same way.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rollcorr.tasks.base import Task, task_reward_range
from rollcorr.tasks.chat import Prompt


@dataclass(frozen=True)
class Turn:
    """The environment's reply to one model turn.

    observation   what it says next — messages ({"role", "content"}: a tool result, a user's reply), or text
                  for a model without a chat template; None when nothing is said (the episode ends)
    reward        this turn's reward; the trajectory's is the sum over its turns
    done          the episode ended (a final answer, a failure, the environment's own turn limit)
    parts         the reward's parts by name when a reward list made it (``tasks.reward_list``: each function's value,
                  NaN where it gave None), summed over turns into ``meta["reward_parts"]`` and logged one by one
    """

    observation: Prompt | None = None
    reward: float = 0.0
    done: bool = False
    parts: dict[str, float] | None = None


@runtime_checkable
class Episode(Protocol):
    """One trajectory's environment: ``prompt`` (the first messages or text) and ``step`` per model turn.
    Optional ``tools`` (default None): tool schemas in the OpenAI chat format, which the chat template
    describes in the prompt (``tasks.chat.template_ids``)."""

    prompt: Prompt

    def step(self, response_text: str) -> Turn: ...


@runtime_checkable
class Environment(Protocol):
    """Items (``sample`` / ``held_out``, as ``rollcorr.tasks.Task``) and an episode per trajectory (``reset``).
    ``max_turns``: the model turns an episode allows at most (the trainer also applies ``task.env.max_turns``).
    ``reward_range`` (optional, default (0, 1)): the bounds a turn's reward is checked against (a reward list's
    sum may pass 1: ``rollcorr.tasks.base.task_reward_range``).
    Optional ``needs_chat`` (default False): its prompts or observations are messages, so the trainer refuses a
    model without a chat template before the first step."""

    name: str
    max_turns: int

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]: ...

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]: ...

    def reset(self, item: dict[str, Any]) -> Episode: ...


class SingleTurn:
    """A task as an environment: one model turn, scored by ``task.reward``, then done. ``user_code_name``: how a
    failing step is named (the reward's name)."""

    max_turns = 1

    def __init__(self, task: Task) -> None:
        self.task = task
        self.name = task.name
        self.user_code_name = getattr(task, "reward_name", None) or f"the reward of task {task.name!r}"
        self.reward_range = task_reward_range(task)

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        return self.task.sample(n, seed, split)

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        return self.task.held_out(n, seed)

    def reset(self, item: dict[str, Any]) -> Episode:
        return _OneTurn(self.task, item)


def as_environment(env_or_task: Environment | Task) -> Environment:
    """An environment as it is; a task (no ``reset``) as its one-turn environment."""
    return env_or_task if hasattr(env_or_task, "reset") else SingleTurn(env_or_task)


class _OneTurn:
    def __init__(self, task: Task, item: dict[str, Any]) -> None:
        self.task, self.item, self.prompt = task, item, item["prompt"]

    def step(self, response_text: str) -> Turn:
        return answer_turn(self.task, self.item, response_text)


def answer_turn(task: Task, item: dict[str, Any], response_text: str) -> Turn:
    """The last turn of an episode whose answer ``task.reward`` scores (checked by the caller, ``Episodes``); a
    reward list (``task.reward_parts``) also gives each function's value."""
    if hasattr(task, "reward_parts"):  # a reward list: its sum and each function's value
        total, parts = task.reward_parts(item, response_text)
        return Turn(reward=total, done=True, parts=parts)
    return Turn(reward=task.reward(item, response_text), done=True)


def reward_scale(reward_range: Sequence[float] | None, who: str) -> Callable[[Any], Any]:
    """r ↦ (r − low) / (high − low): an adapter's ``reward_range`` [low, high] onto [0, 1]; the identity without
    one. A value that is not a number is passed on unchanged, for rollcorr's reward check to name. ``who``: the
    environment, for the message."""
    if reward_range is None:
        return lambda r: r
    ok = isinstance(reward_range, Sequence) and len(reward_range) == 2 and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in reward_range)
    if not ok or not reward_range[0] < reward_range[1]:
        raise ValueError(f"{who}: reward_range must be [low, high] with low < high, got {reward_range!r}")
    low, high = float(reward_range[0]), float(reward_range[1])
    return lambda r: (float(r) - low) / (high - low) if isinstance(r, numbers.Real) and not isinstance(r, bool) else r


# ---- the registry: name → factory(task, **options) -> Environment ------------------------------------------

EnvFactory = Callable[..., Environment]
ENVIRONMENTS: dict[str, EnvFactory] = {}


def register_env(name: str, factory: EnvFactory) -> EnvFactory:
    """Register an environment under ``name``: ``factory(task, **options)`` gets the run's task (the items:
    ``task.name``'s) and ``task.env``'s options, and returns an ``Environment``. A plugin calls this when it
    is imported. Returns the factory (usable as a decorator's body)."""
    if not name or not isinstance(name, str) or ":" in name:
        raise ValueError(f"an environment name is a non-empty string without ':', got {name!r}")
    ENVIRONMENTS[name] = factory
    return factory


def make_env(task: Task, env: dict[str, Any] | None) -> Environment:
    """The run's environment: ``SingleTurn(task)`` without ``env``, else the factory named by ``env["name"]``
    called with the task and the other options. ValueError naming an unknown environment or a bad option."""
    if not env:
        return SingleTurn(task)
    options = dict(env)
    name = options.pop("name", None)
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(ENVIRONMENTS)} (a plugin registers "
                         "its own with rollcorr.envs.register_env)")
    try:
        return ENVIRONMENTS[name](task, **options)
    except TypeError as err:  # an option the factory does not take
        raise ValueError(f"environment {name!r}: {err}") from None
