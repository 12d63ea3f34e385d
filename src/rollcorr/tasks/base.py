"""The task interface: prompts to sample and a verifiable reward for a response."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "test")


@runtime_checkable
class Task(Protocol):
    """A source of prompts with a reward.

    ``sample(n, seed, split)`` returns n items, each a dict with at least ``"prompt"`` (str) and whatever
    ``reward`` needs (e.g. ``"answer"``); the same (n, seed, split) always gives the same items.
    ``held_out(n, seed)`` returns the items greedy evaluation scores: a data set's held-out rows, each once in
    a fixed order (at most n); a generated task's n fresh test-split problems.
    ``reward(item, response_text)`` scores one decoded response (special tokens already removed) in [0, 1].
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


def rewards(task: Task, items: list[dict[str, Any]], responses: list[str]) -> list[float]:
    """``task.reward`` over a batch; raises if items and responses have different lengths."""
    if len(items) != len(responses):
        raise ValueError(f"{len(items)} items but {len(responses)} responses")
    return [float(task.reward(item, text)) for item, text in zip(items, responses)]
