"""Tasks: prompts plus a verifiable reward.

``make_task("addition" | "addition:4" | "long_addition" | "long_addition:16" | "data.jsonl")``.
"""

from __future__ import annotations

from pathlib import Path

from rollcorr.tasks.addition import AdditionTask
from rollcorr.tasks.base import Task, rewards
from rollcorr.tasks.jsonl import JsonlTask
from rollcorr.tasks.long_addition import LongAdditionTask

__all__ = ["AdditionTask", "JsonlTask", "LongAdditionTask", "Task", "make_task", "rewards"]


def make_task(name_or_path: str, reward: str = "exact") -> Task:
    """ "addition" (3 digits), "addition:<digits>", "long_addition" (64 digits), "long_addition:<digits>",
    or a path to a .jsonl file (scored by ``reward``)."""
    name, _, arg = name_or_path.partition(":")
    builtin_tasks = {"addition": AdditionTask, "long_addition": LongAdditionTask}
    if name in builtin_tasks:
        if not arg:
            return builtin_tasks[name]()
        if not arg.isdigit():
            raise ValueError(f"{name} digits must be an integer, got {arg!r} in {name_or_path!r}")
        return builtin_tasks[name](digits=int(arg))
    if name_or_path.endswith(".jsonl") or Path(name_or_path).is_file():
        return JsonlTask(name_or_path, reward=reward)
    raise ValueError(
        f"unknown task {name_or_path!r}; use 'addition', 'addition:<digits>', "
        "'long_addition', 'long_addition:<digits>' or a .jsonl path"
    )
