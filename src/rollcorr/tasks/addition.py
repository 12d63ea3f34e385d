"""Built-in verifiable task: multi-digit addition with the answer written least significant digit first.

Prompt ``"123+456="``, expected response ``"975"`` (579 reversed) followed by EOS. Writing the sum reversed
lets a left-to-right model emit each digit after the carry that determines it, which a ~1 M-parameter model
can learn. Operands have exactly ``digits`` digits (for digits=1: 0..9). Train and test are disjoint: a pair
(a, b) is a test pair iff the first byte of md5("a+b") is < 26 (about 10 % of pairs, unrelated to the digits;
a linear rule such as (7919a + 104729b) % 10 would put every sum ending in 0 in the test split).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from rollcorr.tasks.base import check_count, check_split


def reversed_sum(a: int, b: int) -> str:
    """The expected response text: decimal digits of a + b, least significant first."""
    return str(a + b)[::-1]


def is_test_pair(a: int, b: int) -> bool:
    return hashlib.md5(f"{a}+{b}".encode()).digest()[0] < 26


class AdditionTask:
    """``digits``-digit addition. Reward: 1.0 for the exact reversed sum, else ``format_reward`` if the
    response is a non-empty string of digits (default 0.0: no format reward), else 0.0.
    """

    def __init__(self, digits: int = 3, format_reward: float = 0.0) -> None:
        if not isinstance(digits, int) or not 1 <= digits <= 18:
            raise ValueError(f"digits must be an int in [1, 18], got {digits!r}")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward!r}")
        self.digits = digits
        self.format_reward = float(format_reward)
        self.name = f"addition:{digits}"
        self.low = 0 if digits == 1 else 10 ** (digits - 1)
        self.high = 10**digits - 1

    def item(self, a: int, b: int) -> dict[str, Any]:
        return {"prompt": f"{a}+{b}=", "answer": reversed_sum(a, b), "a": a, "b": b}

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """n problems drawn uniformly from the split (rejection sampling on the test-pair rule)."""
        check_count(n)
        check_split(split)
        rng = random.Random(f"{self.name}/{split}/{seed}")
        want_test = split == "test"
        items = []
        while len(items) < n:
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            if is_test_pair(a, b) == want_test:
                items.append(self.item(a, b))
        return items

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        """n fresh test-split problems (a generated task has more than any evaluation uses)."""
        return self.sample(n, seed, split="test")

    def reward(self, item: dict[str, Any], response_text: str) -> float:
        text = response_text.strip()
        if text == item["answer"]:
            return 1.0
        return self.format_reward if text.isdigit() else 0.0
