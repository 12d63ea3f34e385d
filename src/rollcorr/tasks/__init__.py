"""Tasks: prompts plus a verifiable reward.

``make_task("addition" | "addition:4" | "chain" | "chain:20" | <data file or folder>, reward=..., ...)``: the
built-in generated tasks, or a user's data set (JSONL, Parquet, a ``datasets`` folder; docs/tasks.md) scored
by a reward of ``rollcorr.tasks.verifiers``.
"""

from __future__ import annotations

from pathlib import Path

from rollcorr.tasks.addition import AdditionTask
from rollcorr.tasks.base import Task, rewards
from rollcorr.tasks.chain import ChainTask
from rollcorr.tasks.data import DataError, DataTask
from rollcorr.tasks.verifiers import REWARDS, register_reward

__all__ = ["AdditionTask", "ChainTask", "DataError", "DataTask", "REWARDS", "Task", "make_task", "register_reward",
           "rewards"]

BUILTIN_TASKS = {"addition": AdditionTask, "chain": ChainTask}
DATA_SUFFIXES = (".jsonl", ".parquet")


def is_builtin_task(name: str) -> bool:
    return name.partition(":")[0] in BUILTIN_TASKS and not Path(name).exists()


def make_task(name_or_path: str, reward: str | list | None = None, *, prompt_key: str = "prompt",
              answer_key: str = "answer", eval_file: str | None = None, reward_weights: list | None = None,
              reward_clip: bool = False) -> Task:
    """ "addition" (3 digits), "addition:<digits>", "chain" (14 terms), "chain:<terms>" — each with its own
    reward —, or the path of a data set scored by ``reward`` (default "exact"), with its columns and an
    optional held-out file. ValueError / FileNotFoundError naming the problem."""
    name, _, arg = name_or_path.partition(":")
    if is_builtin_task(name_or_path):
        given = [key for key, value in (("reward", reward), ("reward_weights", reward_weights is not None),
                                        ("prompt_key", prompt_key != "prompt"),
                                        ("answer_key", answer_key != "answer"), ("eval_file", eval_file)) if value]
        if given:
            raise DataError(f"the built-in task {name!r} has its own prompts and reward; task.{given[0]} applies to "
                            "a data set (a JSONL / Parquet file or a datasets folder)", given[0])
        if not arg:
            return BUILTIN_TASKS[name]()
        if not arg.isdigit():
            raise ValueError(
                f"{name}: the number after ':' must be an integer, got {arg!r} in {name_or_path!r}"
            )
        return BUILTIN_TASKS[name](int(arg))
    path = Path(name_or_path)
    if path.exists() or path.suffix in DATA_SUFFIXES:
        return DataTask(path, reward or "exact", prompt_key=prompt_key, answer_key=answer_key, eval_file=eval_file,
                        reward_weights=reward_weights, reward_clip=reward_clip)
    raise ValueError(
        f"unknown task {name_or_path!r}; use 'addition', 'addition:<digits>', 'chain', 'chain:<terms>', or the "
        "path of a data set (a .jsonl / .parquet file or a folder saved by datasets' save_to_disk)"
    )
