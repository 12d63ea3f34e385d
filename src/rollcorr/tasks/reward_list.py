"""Rewards as TRL users write them: a list of reward functions with weights, one task-level reward.

``task.reward: [last_number, my_rewards:concise]`` with ``task.reward_weights: [1.0, 0.2]`` (TRL's
``reward_funcs`` / ``reward_weights``; no weights: 1 each). Each function is either

- per response, rollcorr's ``fn(item, response_text) -> float`` (the built-in verifiers), or
- batched, in TRL's signature ``fn(completions, **columns) -> list[float | None]`` (``verifiers.is_batched``: a
  parameter named ``completions``), called with keyword lists: ``prompts``, ``completions`` (the text; for a
  conversation prompt TRL's ``[{"role": "assistant", "content": text}]``), ``completion_ids`` when known, and
  every other column of the row (``answer``, ...); a function that takes no ``**kwargs`` gets only the columns it
  names. None: the function does not score that response.

A response's reward is Σ_j w_j · r_j over the functions that scored it (TRL's ``nansum``); a response no function
scored is an error naming it. Every value is checked as a single reward is (``tasks.base.checked_reward``: a
finite number in [0, 1], or clipped into it with ``task.reward_clip``), so the sum lies in ``reward_range``
(Σ of the negative weights, Σ of the positive ones). The list is the task's reward — the one-turn environment
calls it once per response, through the one door for user code, as it calls a single reward — and ``parts``
also gives each function's value, which the trainer logs as ``reward/<name>/mean``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollcorr.tasks.base import checked_reward, excerpt
from rollcorr.tasks.verifiers import is_batched
from rollcorr.user_code import UserCodeError


@dataclass(frozen=True)
class RewardTerm:
    """One function of a reward list: its name (as ``task.reward`` gave it), the function, its weight."""

    name: str
    fn: Callable
    weight: float = 1.0


def columns_for(fn: Callable, columns: dict[str, list]) -> dict[str, list]:
    """The keyword lists ``fn`` accepts: all of them with ``**kwargs``, else the ones it names."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return columns
    return {key: value for key, value in columns.items() if key in params}


def trl_columns(items: Sequence[dict[str, Any]], responses: Sequence[str],
                completion_ids: Sequence[Sequence[int]] | None = None) -> dict[str, list]:
    """TRL's keyword lists of a batch (module docstring)."""
    conversational = any(isinstance(item.get("prompt"), list) for item in items)
    completions = [[{"role": "assistant", "content": text}] for text in responses] if conversational else list(responses)
    columns: dict[str, list] = {"prompts": [item.get("prompt") for item in items], "completions": completions}
    if completion_ids is not None:
        columns["completion_ids"] = [list(ids) for ids in completion_ids]
    for key in sorted({key for item in items for key in item} - {"prompt"}):
        columns.setdefault(key, [item.get(key) for item in items])
    return columns


class CompositeReward:
    """A task's reward list (module docstring). ``clip``: values outside [0, 1] clipped (``task.reward_clip``)."""

    def __init__(self, terms: Sequence[RewardTerm], clip: bool = False) -> None:
        names = [term.name for term in terms]
        if not terms or len(set(names)) != len(names):
            raise ValueError(f"a reward list names each function once, got {names}")
        self.terms, self.clip = tuple(terms), clip

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(term.name for term in self.terms)

    @property
    def reward_range(self) -> tuple[float, float]:
        """The sum's bounds: every function at 0 or 1, each weight to its side."""
        return (sum(min(t.weight, 0.0) for t in self.terms), sum(max(t.weight, 0.0) for t in self.terms))

    def parts(self, item: dict[str, Any], response_text: str) -> tuple[float, dict[str, float]]:
        """(Σ_j w_j r_j over the functions that scored the response, {name: r_j, NaN where it gave None}); an
        exception of a function propagates (the caller's door names it), a value it may not return or a
        response no function scored is a ``UserCodeError`` naming the function."""
        parts = {term.name: self._value(term, item, response_text) for term in self.terms}
        scored = [(term.weight, parts[term.name]) for term in self.terms if not math.isnan(parts[term.name])]
        if not scored:
            raise UserCodeError(f"no reward scored the response to {excerpt(item.get('prompt'))}: every function of "
                                f"{list(self.names)} returned None for it")
        return sum(weight * value for weight, value in scored), parts

    def _value(self, term: RewardTerm, item: dict[str, Any], text: str) -> float:
        what = f"reward {term.name!r}"
        if not is_batched(term.fn):
            return checked_reward(term.fn(item, text), what, self.clip)
        values = term.fn(**columns_for(term.fn, trl_columns([item], [text])))
        if not isinstance(values, list | tuple) or len(values) != 1:
            raise UserCodeError(f"{what} returned {excerpt(values)} for one completion; a batched reward returns a "
                                "list of one number (or None) per completion")
        return math.nan if values[0] is None else checked_reward(values[0], what, self.clip)
