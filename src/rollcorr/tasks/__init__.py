"""Tasks: prompts plus a verifiable reward. ``make_task("addition" | "addition:4" | "data.jsonl")``."""

from __future__ import annotations

from pathlib import Path

from rollcorr.tasks.addition import AdditionTask
from rollcorr.tasks.base import Task, rewards
from rollcorr.tasks.jsonl import JsonlTask

__all__ = ["AdditionTask", "JsonlTask", "Task", "make_task", "rewards"]


def make_task(name_or_path: str, reward: str = "exact") -> Task:
    """ "addition" (3 digits), "addition:<digits>", or a path to a .jsonl file (scored by ``reward``)."""
    name, _, arg = name_or_path.partition(":")
    if name == "addition":
        if not arg:
            return AdditionTask()
        if not arg.isdigit():
            raise ValueError(f"addition digits must be an integer, got {arg!r} in {name_or_path!r}")
        return AdditionTask(digits=int(arg))
    if name_or_path.endswith(".jsonl") or Path(name_or_path).is_file():
        return JsonlTask(name_or_path, reward=reward)
    raise ValueError(f"unknown task {name_or_path!r}; use 'addition', 'addition:<digits>' or a .jsonl path")
