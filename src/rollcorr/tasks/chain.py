"""The long-response task: a chain of numbers, each computed from the one(s) before it, written out in full.

Given ``order`` starting numbers, write the next ``terms`` numbers modulo 10^digits. Rule: with ``order`` ≥ 2,
each number is the sum of the ``order`` before it (order 2: Fibonacci); with ``order`` 1 (the shipped task),
each number is the one before plus its own last digit plus one, x_{n+1} = x_n + (x_n mod 10) + 1. Every number
is zero-padded to ``digits`` digits, written least significant digit first and followed by a comma, in the
prompt and in the response. The shipped task (``make_task("chain")``, the ``builtin:chain`` model) is
order 1, 4 digits, 14 terms:

    prompt    "7730,"                  x₀ = 377
    response  "5830,1930,3930,...,"    385 = 377 + 7 + 1, 391 = 385 + 5 + 1, 393, ...
              14 numbers × 5 characters = 70 tokens, then <eos>

Every digit of a number is computed from the digits 5 and 6 tokens back (the same and the previous digit of the
number before it: the last digit doubles plus one, the others copy or take the carry), so a ~1 M-parameter
model can learn the rule; but every number feeds the next one, so one wrong digit makes every later number
wrong: the reward depends on the whole 70-token response and per-token errors compound over it.

Reward, in [0, 1] with partial credit: the share of the ``terms`` answer numbers written exactly right, read
number by number (split at commas); a missing number scores 0 and each extra number adds one to the
denominator. Since a wrong number derails the rest of the chain, this is in practice the length of the right
prefix: one slip at token 10 costs every number after it. (A per-digit score would not: a model that only
copies the previous number gets most upper digits right and scores ~0.4 without knowing the rule.)

Train and test problems are disjoint: a problem is a test problem iff the first byte of md5 of its prompt
is below 26 (about 10 %).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from rollcorr.tasks.base import check_count, check_split

NAME = "chain"
DIGITS = 4  # width of every number
ORDER = 1  # each number is the sum of the ORDER before it (2: Fibonacci); 1: x + (x mod 10) + 1
TERMS = 14  # numbers in the answer: 14 × (4 digits + comma) = 70 tokens, then <eos>


def write(x: int, digits: int) -> str:
    """``x`` zero-padded to ``digits`` digits, least significant first, then a comma."""
    return f"{x:0{digits}d}"[::-1] + ","


def number_score(response: str, answer: str) -> float:
    """Share of the answer's numbers written exactly right, compared number by number (split at commas);
    the denominator is the answer's number count, or the response's if it writes more numbers."""
    want = answer.rstrip(",").split(",")
    got = response.rstrip(",").split(",") if response else []
    return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want))


class ChainTask:
    """x₀ … x_{order−1} → the next ``terms`` numbers modulo 10^digits: the sum of the ``order`` before it
    (order ≥ 2; 2 is Fibonacci) or x + (x mod 10) + 1 (order 1); reward ``number_score``.

    ``max_answer_tokens`` = terms × (digits + 1): the answer without <eos>.
    """

    def __init__(self, terms: int = TERMS, digits: int = DIGITS, order: int = ORDER) -> None:
        if not isinstance(terms, int) or not 1 <= terms <= 200:
            raise ValueError(f"terms must be an int in [1, 200], got {terms!r}")
        if not isinstance(digits, int) or not 1 <= digits <= 18:
            raise ValueError(f"digits must be an int in [1, 18], got {digits!r}")
        if not isinstance(order, int) or not 1 <= order <= 8:
            raise ValueError(f"order must be an int in [1, 8], got {order!r}")
        self.terms, self.digits, self.order = terms, digits, order
        self.name = NAME if terms == TERMS else f"{NAME}:{terms}"
        self.max_answer_tokens = terms * (digits + 1)

    def item(self, *seeds: int) -> dict[str, Any]:
        if len(seeds) != self.order:
            raise ValueError(f"{self.name} needs {self.order} starting numbers, got {len(seeds)}")
        modulus, xs = 10**self.digits, list(seeds)
        for _ in range(self.terms):
            if self.order == 1:  # one number: add its own last digit and 1
                xs.append((xs[-1] + xs[-1] % 10 + 1) % modulus)
            else:
                xs.append(sum(xs[-self.order :]) % modulus)
        prompt = "".join(write(x, self.digits) for x in seeds)
        answer = "".join(write(x, self.digits) for x in xs[self.order :])
        return {"prompt": prompt, "answer": answer, "seeds": list(seeds)}

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """n problems drawn uniformly from the split (rejection sampling on the test-pair rule)."""
        check_count(n)
        check_split(split)
        rng = random.Random(f"{self.name}/{split}/{seed}")
        high = 10**self.digits - 1
        want_test = split == "test"
        items = []
        while len(items) < n:
            item = self.item(*(rng.randint(0, high) for _ in range(self.order)))
            if (hashlib.md5(item["prompt"].encode()).digest()[0] < 26) == want_test:
                items.append(item)
        return items

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        """n fresh test-split problems (a generated task has more than any evaluation uses)."""
        return self.sample(n, seed, split="test")

    def reward(self, item: dict[str, Any], response_text: str) -> float:
        return number_score(response_text.strip(), item["answer"])
