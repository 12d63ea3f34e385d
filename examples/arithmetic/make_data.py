"""Writes train.jsonl (200 items) and eval.jsonl (40 held-out items): "What is a + b?" with a, b two-digit
numbers, the answer the sum as text. Deterministic (seed 0); the pairs of the two files are disjoint.

    python examples/arithmetic/make_data.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    rng = random.Random(0)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < 240:
        pair = (rng.randint(10, 99), rng.randint(10, 99))
        if pair not in pairs:
            pairs.append(pair)
    for name, chunk in (("train.jsonl", pairs[:200]), ("eval.jsonl", pairs[200:])):
        with open(HERE / name, "w") as f:
            for a, b in chunk:
                f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")


if __name__ == "__main__":
    main()
