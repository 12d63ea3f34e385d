"""Write the sample rollout dump shipped with rollcorr (``src/rollcorr/data/sample_rollouts.jsonl``).

The built-in model answers 3-digit additions; a bfloat16 ``hf`` sampler generates the responses (its own
decode loop, temperature 1) and records log μ, and a float32 ``hf`` learner scores the same tokens (log π_old).
The only difference between the two is numeric precision, as in a real inference engine vs trainer. Rows are
written like a verl dump: per-token lists right-padded to the batch width with ``response_mask``.

After the real rows, the script appends a few deliberately malformed lines so ``rollcorr analyze`` can show
how it reports them (each is listed in ``BROKEN`` below and in docs/analyze.md).

    .venv/bin/python scripts/make_sample_dump.py [--out PATH] [--prompts 32] [--n 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from rollcorr.engines import make_learner, make_sampler
from rollcorr.engines.base import SamplingParams
from rollcorr.tasks import AdditionTask

OUT = Path(__file__).resolve().parents[1] / "src" / "rollcorr" / "data" / "sample_rollouts.jsonl"


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) GRPO advantages: reward minus its group mean, divided by the group std (+1e-6)."""
    adv = torch.zeros_like(rewards)
    for g in group_ids.unique():
        idx = group_ids == g
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return adv


def on_valid(values: list[float], valid: list[bool], digits: int = 7) -> list[float]:
    """Rounded values on valid tokens, 0 past the response (verl-style right padding)."""
    return [round(float(x), digits) if v else 0.0 for x, v in zip(values, valid)]


def broken_rows(good: dict) -> list[str]:
    """Malformed lines appended after the real rows, one per kind the reader reports."""
    n = len(good["rollout_log_probs"])
    ragged = dict(good, old_log_probs=good["old_log_probs"][:-1])
    nan = dict(good, old_log_probs=[float("nan")] + good["old_log_probs"][1:])
    positive = dict(good, rollout_log_probs=[0.7] + good["rollout_log_probs"][1:])
    missing = {k: v for k, v in good.items() if k != "old_log_probs"}
    empty = dict(good, response_mask=[0] * n)
    truncated = json.dumps(good)[:80]  # a line cut off mid-write
    return [
        json.dumps(ragged),
        json.dumps(nan),
        json.dumps(positive),
        json.dumps(missing),
        json.dumps(empty),
        truncated,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--model", default=None, help="HF model directory (default: the built-in model)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    task = AdditionTask(digits=3)
    items = task.sample(args.prompts, seed=args.seed, split="test")
    sampler = make_sampler("hf:bf16", model_path=args.model)
    learner = make_learner("hf:fp32", model_path=args.model)
    params = SamplingParams(max_new_tokens=8, temperature=args.temperature, seed=args.seed)
    rollout = sampler.generate([it["prompt"] for it in items], params, n=args.n, meta=items)
    old_log_prob = learner.log_prob(rollout, temperature=args.temperature)

    texts = [m["response_text"] for m in rollout.meta]
    rewards = torch.tensor([task.reward(item, text) for item, text in zip(rollout.meta, texts)])
    advantages = grpo_advantages(rewards, rollout.group_ids)

    rows = []
    for i in range(rollout.batch_size):
        valid = rollout.response_mask[i].bool().tolist()
        ids = rollout.response_ids[i].tolist()

        rows.append(
            {
                "uid": int(rollout.group_ids[i]),
                "prompt": rollout.meta[i]["prompt"],
                "response_text": texts[i],
                "responses": ids,
                "token_text": [
                    t if v else "" for t, v in zip(learner.tokenizer.convert_ids_to_tokens(ids), valid)
                ],
                "response_mask": [int(v) for v in valid],
                "rollout_log_probs": on_valid(rollout.rollout_log_prob[i].tolist(), valid),
                "old_log_probs": on_valid(old_log_prob[i].tolist(), valid),
                "advantages": on_valid([float(advantages[i])] * len(valid), valid, 6),
                "reward": float(rewards[i]),
                "version": rollout.version[i].tolist(),
            }
        )

    lines = [json.dumps(r) for r in rows] + broken_rows(rows[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; the file ships in the package
    os.replace(tmp, args.out)
    size = args.out.stat().st_size
    print(
        f"wrote {len(rows)} responses + {len(lines) - len(rows)} malformed lines to {args.out} ({size / 1024:.0f} KiB); "
        f"mean reward {rewards.mean():.3f}"
    )


if __name__ == "__main__":
    main()
