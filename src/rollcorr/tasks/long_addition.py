"""The long-response task: add two 64-digit numbers, every number written least significant digit first.

Prompt ``"<a reversed>+<b reversed>="``, expected response the reversed sum (64 or 65 digits) then EOS, e.g.
with 4 digits ``"4321+8765="`` (1234 + 5678) → ``"2196"`` (6912 reversed). In this layout digit i of the
answer sits a fixed distance after digit i of each operand, and its carry is decided by digit i − 1 of the
operands and of the answer just written, so a small transformer can learn the rule (reversed operands and
answer: Lee et al. 2023, "Teaching Arithmetic to Small Transformers"), and every answer token depends on
the ones before it: one wrong carry makes the following digits wrong.

Reward, in [0, 1] with partial credit: the share of answer positions written correctly,
``#{i : response[i] == answer[i]} / max(len(response), len(answer))`` (a response that is not all digits
scores 0). Too short or too long responses lose the missing / extra positions. The reward depends on the
whole response, so the study of sampler/learner mismatch on long responses (``experiments/long_mismatch.py``)
has 65 tokens per response to compound over. Train and test problems are disjoint: a pair is a test pair iff
the first byte of md5 of its prompt is below 26 (about 10 %).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from rollcorr.tasks.base import check_count, check_split

NAME = "long_addition"
DIGITS = 64  # the shipped model (builtin:long_addition) is trained on exactly this many digits


def digit_accuracy(response: str, answer: str) -> float:
    """Share of positions where ``response`` matches ``answer``, over the longer of the two; 0 if the
    response is empty or not all digits."""
    if not response.isdigit():
        return 0.0
    hits = sum(r == a for r, a in zip(response, answer))
    return hits / max(len(response), len(answer))


class LongAdditionTask:
    """``digits``-digit addition with operands and answer reversed; reward = ``digit_accuracy``.

    Operands are uniform over ``[10^(digits−1), 10^digits − 1]`` (no leading zero, so the reversed strings
    have exactly ``digits`` characters). ``max_answer_tokens`` = digits + 1 (a carry out of the top digit).
    """

    def __init__(self, digits: int = DIGITS) -> None:
        if not isinstance(digits, int) or not 2 <= digits <= 256:
            raise ValueError(f"digits must be an int in [2, 256], got {digits!r}")
        self.digits = digits
        self.name = NAME if digits == DIGITS else f"{NAME}:{digits}"
        self.max_answer_tokens = digits + 1

    def item(self, a: int, b: int) -> dict[str, Any]:
        return {"prompt": f"{str(a)[::-1]}+{str(b)[::-1]}=", "answer": str(a + b)[::-1], "a": a, "b": b}

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """n problems drawn uniformly from the split (rejection sampling on the test-pair rule)."""
        check_count(n)
        check_split(split)
        rng = random.Random(f"{self.name}/{split}/{seed}")
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        want_test = split == "test"
        items = []
        while len(items) < n:
            item = self.item(rng.randint(low, high), rng.randint(low, high))
            if (hashlib.md5(item["prompt"].encode()).digest()[0] < 26) == want_test:
                items.append(item)
        return items

    def reward(self, item: dict[str, Any], response_text: str) -> float:
        return digit_accuracy(response_text.strip(), item["answer"])
