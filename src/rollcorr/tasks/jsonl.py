"""A user data set as a task: one ``{"prompt": ..., "answer": ...}`` object per line of a JSONL file."""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollcorr.tasks.base import check_count, check_split

RewardFn = Callable[[dict[str, Any], str], float]


def exact_match(item: dict[str, Any], response_text: str) -> float:
    """1.0 if the stripped response equals the stripped answer, else 0.0."""
    return 1.0 if response_text.strip() == str(item["answer"]).strip() else 0.0


def resolve_reward(reward: str | RewardFn) -> RewardFn:
    """ "exact" or "package.module:function" (called as ``fn(item, response_text) -> float``)."""
    if callable(reward):
        return reward
    if reward == "exact":
        return exact_match
    module_name, sep, fn_name = reward.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"reward must be 'exact' or 'module:function', got {reward!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import reward module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward module {module_name!r} has no function {fn_name!r}")
    return fn


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Items of a JSONL file; blank lines skipped; ValueError naming the line for anything invalid."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL task file {str(path)!r} does not exist")
    items = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(item).__name__}")
            for key in ("prompt", "answer"):
                if key not in item:
                    raise ValueError(f"{path}, line {lineno}: missing key {key!r}")
            if not isinstance(item["prompt"], str) or not item["prompt"]:
                raise ValueError(f"{path}, line {lineno}: 'prompt' must be a non-empty string")
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no items")
    return items


class JsonlTask:
    """Prompts from a JSONL file, scored by ``reward`` ("exact" or "module:function").

    Split: when the file has a ``"split"`` key on items, it is used; otherwise every 10th item (index
    % 10 == 9) is a test item. ``sample`` draws with replacement, deterministically per (seed, split).
    """

    def __init__(self, path: str | Path, reward: str | RewardFn = "exact") -> None:
        self.path = Path(path)
        self.items = read_jsonl(self.path)
        self.reward_fn = resolve_reward(reward)
        self.name = f"jsonl:{self.path.name}"
        has_split = any("split" in item for item in self.items)
        self.by_split = {
            s: [
                item
                for i, item in enumerate(self.items)
                if (item.get("split", "train") == s if has_split else (i % 10 == 9) == (s == "test"))
            ]
            for s in ("train", "test")
        }

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        check_count(n)
        check_split(split)
        pool = self.by_split[split] or self.items
        rng = random.Random(f"{self.name}/{split}/{seed}")
        return [dict(rng.choice(pool)) for _ in range(n)]

    def reward(self, item: dict[str, Any], response_text: str) -> float:
        return float(self.reward_fn(item, response_text))
