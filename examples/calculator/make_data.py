"""Writes train.jsonl (200 items) and eval.jsonl (40 held-out items): two-step arithmetic questions for the
calculator environment (docs/multi-turn.md), the answer an integer as text. Half are written as expressions
("What is 27 * 14 + 35?"), half in words ("Add 27 and 14, then multiply by 3."), where the order of the steps
is not the order of the operators' precedence for two of the four forms. Deterministic (seed 0); the
questions of the two files are disjoint.

    python examples/calculator/make_data.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMS = (  # (question, answer) from two-digit a, b and a one-digit c ≥ 2
    (lambda a, b, c: f"What is {a} * {b} + {c}?", lambda a, b, c: a * b + c),
    (lambda a, b, c: f"What is {a} * {b} - {c}?", lambda a, b, c: a * b - c),
    (lambda a, b, c: f"What is ({a} + {b}) * {c}?", lambda a, b, c: (a + b) * c),
    (lambda a, b, c: f"What is ({a} - {b}) * {c}?", lambda a, b, c: (a - b) * c),
    (lambda a, b, c: f"Multiply {a} by {b}, then add {c}.", lambda a, b, c: a * b + c),
    (lambda a, b, c: f"Multiply {a} by {b}, then subtract {c}.", lambda a, b, c: a * b - c),
    (lambda a, b, c: f"Add {a} and {b}, then multiply by {c}.", lambda a, b, c: (a + b) * c),
    (lambda a, b, c: f"Subtract {b} from {a}, then multiply by {c}.", lambda a, b, c: (a - b) * c),
)


def main() -> None:
    rng = random.Random(0)
    rows: list[dict[str, str]] = []
    while len(rows) < 240:
        question, answer = FORMS[len(rows) % len(FORMS)]
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        row = {"prompt": question(a, b, c), "answer": str(answer(a, b, c))}
        if all(r["prompt"] != row["prompt"] for r in rows):
            rows.append(row)
    rng.shuffle(rows)
    for name, chunk in (("train.jsonl", rows[:200]), ("eval.jsonl", rows[200:])):
        with open(HERE / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in chunk)


if __name__ == "__main__":
    main()
