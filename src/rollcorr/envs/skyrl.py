"""``skyrl``: an environment of SkyRL-Gym (PyPI ``skyrl-gym``) played as a rollcorr environment.

    task.env: {name: skyrl, id: gsm8k_multi_turn, extras: {max_turns: 3}}

SkyRL-Gym's text environments (``skyrl_gym.envs.base_text_env.BaseTextEnv``) hold one trajectory each, built
per row of a data set — ``skyrl_gym.make(id, env_config=..., extras=...)``; ``init(prompt) -> (messages,
metadata)``; ``step(action) -> {observations, reward, done, metadata}`` — which is rollcorr's episode. The
adapter maps, per row:

    extras            the row's ``reward_spec`` and ``extra_info`` when it has them (SkyRL's data layout), else
                      {"reward_spec": {"method": "rule", "ground_truth": str(answer)}, "extra_info": {}};
                      then ``extras`` of the config on top (e.g. ``max_turns``, which SkyRL's envs read there)
    prompt            the row's prompt as messages (a text prompt is one user message) through ``init``
    step(text)        Turn(observation = its observations, a list of messages; reward; done)

Rewards: ``reward_range: [low, high]`` maps a library reward r in [low, high] to (r − low) / (high − low) in
[0, 1] (SkyRL's text2sql gives −1 for a malformed query: ``reward_range: [-1, 1]``); without it the reward is
taken as it is. Either way rollcorr checks each turn's reward in [0, 1] and stops the run with one line naming
the environment and the row when it is outside (``task.reward_clip=true`` clips it instead). SkyRL's
multi-turn GSM8K gives a format reward on a wrong turn and 1 on the right one, so a trajectory's sum can pass 1:
accuracy counts the trajectories whose sum reaches 1.

Tokens: SkyRL's observations are messages, rendered through the chat template and appended as ids
(``envs.render``); the learner scores the ids sampled. ``postprocessed_action`` (a step's rewrite of the
model's text) is not applied: the trajectory keeps the tokens the model sampled. For a model without a chat
template (the built-in ones), ``text: true`` hands the model the messages' contents as text (joined by
newlines). An episode is closed (``close()``) when its environment says done; one that a limit cuts is not.
``reset`` and ``step`` run through rollcorr's door for user code, as a reward does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollcorr.envs.base import Turn, register_env, reward_scale
from rollcorr.tasks.base import Task
from rollcorr.tasks.chat import Prompt, messages_of

MAX_TURNS = 16  # model turns an episode may take unless its environment ends it (task.env.max_turns: fewer)


def _skyrl_gym():
    try:
        import skyrl_gym
    except ImportError:
        raise ValueError("environment 'skyrl' needs the skyrl-gym package: pip install -e '.[skyrl]'") from None
    return skyrl_gym


class SkyRLEnv:
    """A SkyRL-Gym environment ``id`` over the task's rows (``sample`` / ``held_out``), one instance per episode."""

    def __init__(self, task: Task, id: str, config: Mapping[str, Any] | None = None,
                 extras: Mapping[str, Any] | None = None, reward_range: Sequence[float] | None = None,
                 text: bool = False) -> None:
        self.gym = _skyrl_gym()
        if not isinstance(id, str) or id not in self.gym.registry:
            raise ValueError(f"skyrl: no SkyRL-Gym environment {id!r}; registered: {sorted(self.gym.registry)}")
        for key, value in (("config", config), ("extras", extras)):
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"skyrl: {key} must be a mapping, got {value!r}")
        self.task, self.id, self.text = task, id, bool(text)
        self.config, self.extras = dict(config or {}), dict(extras or {})
        self.scale = reward_scale(reward_range, "skyrl")
        self.name, self.max_turns = f"skyrl:{id}", MAX_TURNS
        self.needs_chat = not self.text  # SkyRL's messages, unless handed over as text

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        return self.task.sample(n, seed, split)

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        return self.task.held_out(n, seed)

    def reset(self, item: dict[str, Any]) -> SkyRLEpisode:
        """The row's SkyRL environment, made and initialised (user code: called through rollcorr's door)."""
        from omegaconf import OmegaConf

        env = self.gym.make(self.id, env_config=OmegaConf.create(self.config), extras=self.row_extras(item))
        return SkyRLEpisode(self, env, messages_of(item["prompt"]))

    def row_extras(self, item: dict[str, Any]) -> dict[str, Any]:
        """What SkyRL's generator passes as ``extras`` for this row (the module docstring's rule)."""
        if "reward_spec" in item:
            extras = {"reward_spec": item["reward_spec"], "extra_info": item.get("extra_info") or {}}
        else:
            extras = {"reward_spec": {"method": "rule", "ground_truth": str(item["answer"])},
                      "extra_info": item.get("extra_info") or {}}
        return {**extras, **self.extras}

    def as_prompt(self, messages: list[dict[str, str]]) -> Prompt:
        """Messages as the run's model takes them: as they are, or (``text``) their contents as text."""
        return "\n".join(str(m["content"]) for m in messages) if self.text else messages


class SkyRLEpisode:
    """One row's SkyRL environment: ``prompt`` from its ``init``, ``step`` converting its output to a ``Turn``."""

    def __init__(self, adapter: SkyRLEnv, env: Any, prompt: list[dict[str, str]]) -> None:
        self.adapter, self.env = adapter, env
        first = env.init(prompt)
        if not (isinstance(first, tuple) and len(first) == 2 and _is_messages(first[0])):
            raise ValueError(f"{type(env).__name__}.init returned {first!r:.120}; expected (messages, metadata)")
        self.prompt = adapter.as_prompt(list(first[0]))

    def step(self, response_text: str) -> Turn:
        out = self.env.step(response_text)
        if not isinstance(out, Mapping) or not {"observations", "reward", "done"} <= set(out):
            raise ValueError(f"{type(self.env).__name__}.step returned {out!r:.120}; expected a mapping with "
                             "observations, reward and done")
        observations, done = out["observations"] or [], bool(out["done"])
        if not _is_messages(observations):
            raise ValueError(f"{type(self.env).__name__}.step's observations are {observations!r:.120}; expected a "
                             "list of {'role', 'content'} messages")
        if done:
            self.env.close()
        observation = None if done else self.adapter.as_prompt(list(observations))
        return Turn(observation=observation, reward=self.adapter.scale(out["reward"]), done=done)


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in value)


register_env("skyrl", SkyRLEnv)
