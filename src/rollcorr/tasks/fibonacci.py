"""The long-response task: a Fibonacci-style chain of running sums, written out number by number.

Given two 4-digit numbers x₀ and x₁, write x₂ … x₁₅ where each is the sum of the two before it modulo 10⁴:
``x_{n+1} = (x_n + x_{n−1}) mod 10⁴``. Every number is zero-padded to 4 digits, written least significant digit
first and followed by a comma, in the prompt and in the response:

    prompt    "8127,3341,"            x₀ = 7218, x₁ = 1433
    response  "1469,9...,...,"        x₂ = 8651 → "1568", ... 14 numbers = 70 tokens, then <eos>

Each answer digit sits a fixed distance after the digits it is computed from (5 and 10 tokens back), and its
carry is decided by the digits just before them, so a ~1 M-parameter model can learn the rule; but every
number feeds the next two, so one wrong digit makes most later digits wrong: the reward depends on the whole
70-token response and per-token errors compound over it.

Reward, in [0, 1] with partial credit: the share of the ``terms × digits`` answer digits that are right, read
number by number (split at commas) and digit by digit; missing numbers and characters score 0 and each extra
number adds ``digits`` to the denominator. Train and test problems are disjoint: a pair is a test pair iff the
first byte of md5 of its prompt is below 26 (about 10 %).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from rollcorr.tasks.base import check_count, check_split

NAME = "fibonacci"
DIGITS = 4  # width of every number
TERMS = 14  # numbers in the answer: 14 × (4 digits + comma) = 70 tokens, then <eos>


def write(x: int, digits: int) -> str:
    """``x`` zero-padded to ``digits`` digits, least significant first, then a comma."""
    return f"{x:0{digits}d}"[::-1] + ","


def digit_score(response: str, answer: str, digits: int) -> float:
    """Share of the answer's digits matched number by number (comma-separated) and position by position;
    the denominator is the answer's digit count, plus ``digits`` per extra number in the response."""
    want = answer.rstrip(",").split(",")
    got = response.rstrip(",").split(",") if response else []
    hits = sum(g == w for got_n, want_n in zip(got, want) for g, w in zip(got_n, want_n))
    return hits / (max(len(got), len(want)) * digits)


class FibonacciTask:
    """x₀, x₁ → x₂ … x_{terms+1} with ``x_{n+1} = (x_n + x_{n−1}) mod 10^digits``; reward ``digit_score``.

    ``max_answer_tokens`` = terms × (digits + 1): the answer without <eos>.
    """

    def __init__(self, terms: int = TERMS, digits: int = DIGITS) -> None:
        if not isinstance(terms, int) or not 1 <= terms <= 100:
            raise ValueError(f"terms must be an int in [1, 100], got {terms!r}")
        if not isinstance(digits, int) or not 1 <= digits <= 18:
            raise ValueError(f"digits must be an int in [1, 18], got {digits!r}")
        self.terms, self.digits = terms, digits
        self.name = NAME if terms == TERMS else f"{NAME}:{terms}"
        self.max_answer_tokens = terms * (digits + 1)

    def item(self, x0: int, x1: int) -> dict[str, Any]:
        modulus, xs = 10**self.digits, [x0, x1]
        for _ in range(self.terms):
            xs.append((xs[-1] + xs[-2]) % modulus)
        prompt = write(x0, self.digits) + write(x1, self.digits)
        answer = "".join(write(x, self.digits) for x in xs[2:])
        return {"prompt": prompt, "answer": answer, "x0": x0, "x1": x1}

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """n problems drawn uniformly from the split (rejection sampling on the test-pair rule)."""
        check_count(n)
        check_split(split)
        rng = random.Random(f"{self.name}/{split}/{seed}")
        high = 10**self.digits - 1
        want_test = split == "test"
        items = []
        while len(items) < n:
            item = self.item(rng.randint(0, high), rng.randint(0, high))
            if (hashlib.md5(item["prompt"].encode()).digest()[0] < 26) == want_test:
                items.append(item)
        return items

    def reward(self, item: dict[str, Any], response_text: str) -> float:
        return digit_score(response_text.strip(), item["answer"], self.digits)
