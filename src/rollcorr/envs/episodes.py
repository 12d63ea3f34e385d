"""Playing episodes: a sampler's turns and an environment's replies, as one ``Rollout`` of trajectories.

``Episodes`` holds one batch's episodes (one per row) between sampler calls. After each call, every row whose
model turn has ended — the sampler finished it (EOS or the turn's token cap) and the episode is not over — is
stepped: the turn's text (its model tokens decoded) goes to ``episode.step``, and the reply's observation is
rendered (``envs.render``) and appended to the row as the environment's tokens (``Rollout.with_observations``),
which makes the row unfinished again, so the sampler's next call continues it with the weights it then holds.
A row is over when its episode says done, after ``max_turns`` model turns, or when the next turn could pass
``max_tokens`` response-side tokens (then it is *cut*: said in ``env/cut_share``). The trajectory's reward is
the sum of its turns' rewards.

    episodes = Episodes(env, items, renderer, limits)
    rollout = episodes.advance(sampler.generate(episodes.prompts(), params, meta=..., group_ids=...), version)
    while not finished(rollout): rollout = episodes.advance(sampler.generate(..., resume=rollout), version)
    rollout = episodes.rewarded(rollout)

``play`` is that loop, whole (greedy evaluation, the audit); the trainer's sample source runs it a sampler call
at a time, so a weight publish can land between two turns of one trajectory (partial rollouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollcorr.envs.base import Environment, Turn
from rollcorr.envs.render import Renderer
from rollcorr.rollout import Rollout
from rollcorr.tasks.base import checked_reward, excerpt
from rollcorr.tasks.chat import Prompt, messages_of
from rollcorr.user_code import UserCodeError, call_each


class Conversation(list):
    """A row's conversation as messages (a list), with the ``tools`` its prompt described (None: none)."""

    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Limits:
    """What bounds a trajectory, and the user code it calls (``task.env`` and ``task.reward_*``).

    max_turns    model turns at most (None: the environment's own ``max_turns``)
    max_tokens   response-side tokens at most, the model's and the environment's (None: no bound)
    timeout      seconds one call of user code may take — a reward, an environment's reset or step
    clip         a reward outside [0, 1] is clipped into it instead of stopping the run
    workers      episodes stepped side by side (threads): for an environment that waits (a tool, a service);
                 its episodes must then not share unguarded state
    """

    max_turns: int | None = None
    max_tokens: int | None = None
    timeout: float | None = None
    clip: bool = False
    workers: int = 1


class Episodes:
    """One batch's episodes, row by row (``items`` already repeated per response)."""

    def __init__(self, env: Environment, items: Sequence[dict[str, Any]], renderer: Renderer,
                 limits: Limits = Limits(), max_new_tokens: int = 0, rows: str = "the batch") -> None:
        """``max_new_tokens``: one model turn's cap (the sampler's); ``rows``: what the rows are, for messages."""
        self.env, self.renderer, self.limits, self.rows = env, renderer, limits, rows
        self.items = list(items)
        self.max_turns = min(env.max_turns, limits.max_turns) if limits.max_turns else env.max_turns
        self.max_new_tokens = max_new_tokens
        self.episodes = self._call(lambda item: env.reset(item), [(it,) for it in self.items], "reset")
        self.rewards: list[list[float]] = [[] for _ in self.items]
        self.parts: list[dict[str, float]] = [{} for _ in self.items]  # a reward list's parts, summed over turns
        self.said: list[list[Prompt]] = [[] for _ in self.items]  # each row's observations, in order
        self.over = [False] * len(self.items)
        self.cut = [False] * len(self.items)

    @property
    def multi_turn(self) -> bool:
        return self.max_turns > 1

    def prompts(self) -> list[str | list[int]]:
        """Each row's first input for the sampler (with the episode's ``tools``, when it has some)."""
        return [self.renderer.prompt(e.prompt, getattr(e, "tools", None)) for e in self.episodes]

    def advance(self, rollout: Rollout, version: int) -> Rollout:
        """Step the episode of every row whose model turn has just ended; append the replies' observations."""
        if self.multi_turn and rollout.turn is None:  # a trajectory from its first call: every token in turn 0
            rollout = rollout.replace(observation_mask=torch.zeros_like(rollout.response_mask, dtype=torch.bool),
                                      turn=torch.zeros_like(rollout.response_ids))
        observations: dict[int, list[int]] = {}
        turns = rollout.next_turn()
        ended = [i for i, m in enumerate(rollout.meta) if not self.over[i] and m.get("finished", True)]
        calls = [(self.episodes[i], self._turn_text(rollout, i, turns[i])) for i in ended]
        replies = self._call(lambda episode, text: episode.step(text), calls, "step", ended)
        for i, reply in zip(ended, replies):
            reply = self._checked(reply, i)
            self.rewards[i].append(reply.reward)
            for name, value in (reply.parts or {}).items():
                self.parts[i][name] = self.parts[i].get(name, 0.0) + value
            ids = self._next(rollout, i, turns[i] + 1, reply)
            if ids is None:
                self.over[i] = True
            else:
                observations[i] = ids
                self.said[i].append(reply.observation)
        return rollout.with_observations(observations, version) if observations else rollout

    def _what(self, row: int, call: str) -> str:
        """How a message names the user code of ``row`` (a task's reward, or the environment's reset / step)."""
        name = getattr(self.env, "user_code_name", None)
        name = f"{name}" if name and call == "step" else f"environment {self.env.name!r} ({call})"
        return f"{name} on row {row} of {self.rows} (prompt {excerpt(self.items[row].get('prompt'))})"

    def _call(self, fn, calls: list[tuple], call: str, rows: list[int] | None = None) -> list[Any]:
        """``fn`` over ``calls`` through the door for user code (``rollcorr.user_code``), bounded by the timeout."""
        rows = list(range(len(calls))) if rows is None else rows
        return call_each(fn, calls, lambda k: self._what(rows[k], call), self.limits.timeout, "task.reward_timeout",
                         self.limits.workers)

    def _checked(self, reply: Any, row: int) -> Turn:
        """A ``Turn`` whose reward is a number in [0, 1] (``checked_reward``), or ``UserCodeError`` naming it."""
        if not isinstance(reply, Turn):
            raise UserCodeError(f"{self._what(row, 'step')} returned {excerpt(reply)} ({type(reply).__name__}); "
                                "a step returns rollcorr.envs.Turn(observation, reward, done)")
        bounds = getattr(self.env, "reward_range", (0.0, 1.0))
        return Turn(reply.observation, checked_reward(reply.reward, self._what(row, "step"), self.limits.clip, bounds),
                    reply.done, reply.parts)

    def _next(self, rollout: Rollout, row: int, turns_done: int, reply: Turn) -> list[int] | None:
        """The observation ids to append, or None when the row is over (done, a limit: then maybe cut)."""
        if reply.done or reply.observation is None:
            return None
        if turns_done >= self.max_turns:
            self.cut[row] = True
            return None
        ids = rollout.response_ids[row][rollout.token_mask[row]]
        ended = bool(len(ids)) and int(ids[-1]) == self.renderer.end_of_turn
        obs = self.renderer.observation_ids(reply.observation, turn_ended=ended)
        if self.limits.max_tokens is not None and len(ids) + len(obs) + self.max_new_tokens > self.limits.max_tokens:
            self.cut[row] = True
            return None
        return obs

    def _turn_text(self, rollout: Rollout, row: int, turn: int, special: bool = False) -> str:
        """The text of ``turn``'s model tokens in ``row``, what the episode reads: special tokens removed (kept
        with ``special``)."""
        mask = rollout.response_mask[row].bool()
        if rollout.turn is not None:
            mask = mask & (rollout.turn[row] == turn)
        return self.renderer.tokenizer.decode(rollout.response_ids[row][mask].tolist(), skip_special_tokens=not special)

    def messages(self, rollout: Rollout, row: int) -> Conversation:
        """Row ``row``'s conversation as messages: the episode's prompt, then each model turn (its text, as the
        episode read it) and the observation that answered it (text: a user message, as the renderer takes it) —
        what a pipeline that keeps messages would template again (``Renderer.conversation_ids``). Without a chat
        template a turn keeps its special tokens (its end-of-turn token): no template would put them back.
        Its ``tools``: the episode's, which the template described in the prompt."""
        out = Conversation(messages_of(self.episodes[row].prompt))
        out.tools = getattr(self.episodes[row], "tools", None)
        for k in range(int(rollout.turns[row])):
            out.append({"role": "assistant", "content": self._turn_text(rollout, row, k, special=not self.renderer.chat)})
            if k < len(self.said[row]):
                out += messages_of(self.said[row][k])
        return out

    def play(self, sampler, params, group_ids: Sequence[int] | None = None) -> Rollout:
        """Every episode played to its end with ``sampler``'s current weights, rewarded."""
        rollout = sampler.generate(self.prompts(), params, meta=[dict(it) for it in self.items], group_ids=group_ids)
        rollout = self.advance(rollout, sampler.version)
        while not all(m.get("finished", True) for m in rollout.meta):
            rollout = self.advance(sampler.generate(None, params, resume=rollout), sampler.version)
        return self.rewarded(rollout)

    def rewarded(self, rollout: Rollout) -> Rollout:
        """The finished batch with its rewards (each row's sum over its turns) and each row's episode record in
        ``meta``: ``turn_rewards``, ``turns``, ``cut``."""
        meta = [dict(m) for m in rollout.meta]
        for i, m in enumerate(meta):
            m.update(turn_rewards=self.rewards[i], turns=len(self.rewards[i]), cut=self.cut[i])
            if self.parts[i]:
                m["reward_parts"] = dict(self.parts[i])
        rewards = torch.tensor([sum(r) for r in self.rewards], dtype=torch.float32)
        return rollout.replace(rewards=rewards, meta=meta)


def play(sampler, env: Environment, items: Sequence[dict[str, Any]], renderer: Renderer, params,
         group_ids: Sequence[int] | None = None, limits: Limits = Limits(), rows: str = "the batch") -> Rollout:
    """Every episode of ``items`` (one row each) played to its end with ``sampler``'s current weights."""
    return Episodes(env, items, renderer, limits, params.max_new_tokens, rows).play(sampler, params, group_ids)


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """``env/…`` metrics of a rewarded batch of trajectories: model turns (mean, max), the share of episodes a
    limit cut, the share of response-side tokens the environment wrote. Empty for a single-turn batch."""
    if rollout.turn is None or not rollout.meta:
        return {}
    turns = [float(m.get("turns", 1)) for m in rollout.meta]
    observed = rollout.observation_mask.bool().sum() if rollout.observation_mask is not None else 0
    tokens = rollout.token_mask.sum()
    return {"env/turns_mean": sum(turns) / len(turns), "env/turns_max": max(turns),
            "env/cut_share": sum(bool(m.get("cut")) for m in rollout.meta) / len(rollout.meta),
            "env/observation_token_share": float(observed) / float(tokens) if tokens else 0.0}
