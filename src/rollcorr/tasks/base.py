"""The task interface: prompts to sample and a verifiable reward for a response."""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, runtime_checkable

from rollcorr.user_code import UserCodeError, call_each

SPLITS = ("train", "test")


@runtime_checkable
class Task(Protocol):
    """A source of prompts with a reward.

    ``sample(n, seed, split)`` returns n items, each a dict with at least ``"prompt"`` (str) and whatever
    ``reward`` needs (e.g. ``"answer"``); the same (n, seed, split) always gives the same items.
    ``held_out(n, seed)`` returns the items greedy evaluation scores: a data set's held-out rows, each once in
    a fixed order (at most n); a generated task's n fresh test-split problems.
    ``reward(item, response_text)`` scores one decoded response (special tokens already removed) in [0, 1];
    it is called through ``rewards`` (below), which bounds its time and checks its value.
    ``reward_name`` (optional): how an error names the reward, e.g. "reward 'my_mod:score'".
    ``reward_range`` and ``reward_parts(item, response_text)`` (optional, a reward list's: ``tasks.reward_list``):
    the bounds of the reward when they are not [0, 1] (``task_reward_range``), and (the reward, each part by name).
    An item's ``"prompt"`` is text, or a conversation (a list of {"role", "content"} messages) that the chat
    template turns into the model's input (``rollcorr.tasks.chat``).
    """

    name: str

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]: ...

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]: ...

    def reward(self, item: dict[str, Any], response_text: str) -> float: ...


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")


def check_count(n: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"number of items must be a non-negative int, got {n!r}")


REWARD_TIMEOUT_S = 5.0  # task.reward_timeout's default: seconds one reward call may take


def rewards(task: Task, items: list[dict[str, Any]], responses: list[str], timeout: float | None = None,
            clip: bool = False, rows: str = "the batch") -> list[float]:
    """``task.reward`` of each (item, response), called through the door for user code (``rollcorr.user_code``:
    each call bounded by ``timeout`` seconds, a failure one line naming the reward and the row of ``rows``) and
    checked by ``checked_reward``; ``UserCodeError`` when one fails. Raises if items and responses differ in number."""
    if len(items) != len(responses):
        raise ValueError(f"{len(items)} items but {len(responses)} responses")
    name = getattr(task, "reward_name", None) or f"the reward of task {task.name!r}"

    def what(i: int) -> str:
        return f"{name} on row {i} of {rows} (prompt {excerpt(items[i].get('prompt'))})"

    values = call_each(task.reward, list(zip(items, responses)), what, timeout, "task.reward_timeout")
    return [checked_reward(value, what(i), clip, task_reward_range(task)) for i, value in enumerate(values)]


def task_reward_range(task: Task) -> tuple[float, float]:
    """The bounds of a task's reward: [0, 1], or a reward list's (its weights' range: the sum may pass 1)."""
    return getattr(task, "reward_range", (0.0, 1.0))


def checked_reward(value: Any, what: str, clip: bool = False, bounds: tuple[float, float] = (0.0, 1.0)) -> float:
    """A reward as a float in ``bounds`` ([0, 1]; a reward list's sum: its ``reward_range``): a finite real number
    (an int, a float, True/False as 1/0, a one-element NumPy or torch value); out of bounds refused, or clipped
    into them when ``clip`` (``task.reward_clip``). ``UserCodeError`` naming ``what`` otherwise."""
    if hasattr(value, "item") and not isinstance(value, numbers.Real):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element
            pass
    if not isinstance(value, numbers.Real):
        raise UserCodeError(f"{what} returned {excerpt(value)} ({type(value).__name__}); a reward is a number in "
                            "[0, 1]")
    value = float(value)
    if not math.isfinite(value):
        raise UserCodeError(f"{what} returned {value}; a reward is a finite number in [0, 1]")
    low, high = bounds
    if not low <= value <= high:
        if not clip:
            raise UserCodeError(f"{what} returned {value:g}, outside [{low:g}, {high:g}]; fix the function, or clip "
                                f"rewards into [{low:g}, {high:g}] with task.reward_clip=true")
        value = min(max(value, low), high)
    return value


def excerpt(value: Any, width: int = 60) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], dict):  # a conversation: its last message
        value = value[-1].get("content")
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"
