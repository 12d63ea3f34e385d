"""Tasks: prompts plus a verifiable reward.

``make_task("addition" | "addition:4" | "chain" | "chain:20" | "data.jsonl")``.
"""

from __future__ import annotations

from pathlib import Path

from rollcorr.tasks.addition import AdditionTask
from rollcorr.tasks.base import Task, rewards
from rollcorr.tasks.chain import ChainTask
from rollcorr.tasks.jsonl import JsonlTask

__all__ = ["AdditionTask", "ChainTask", "JsonlTask", "Task", "make_task", "rewards"]


def make_task(name_or_path: str, reward: str = "exact") -> Task:
    """ "addition" (3 digits), "addition:<digits>", "chain" (14 terms), "chain:<terms>",
    or a path to a .jsonl file (scored by ``reward``)."""
    name, _, arg = name_or_path.partition(":")
    builtin_tasks = {"addition": AdditionTask, "chain": ChainTask}
    if name in builtin_tasks:
        if not arg:
            return builtin_tasks[name]()
        if not arg.isdigit():
            raise ValueError(
                f"{name}: the number after ':' must be an integer, got {arg!r} in {name_or_path!r}"
            )
        return builtin_tasks[name](int(arg))
    if name_or_path.endswith(".jsonl") or Path(name_or_path).is_file():
        return JsonlTask(name_or_path, reward=reward)
    raise ValueError(
        f"unknown task {name_or_path!r}; use 'addition', 'addition:<digits>', "
        "'chain', 'chain:<terms>' or a .jsonl path"
    )
