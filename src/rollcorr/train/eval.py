"""Greedy evaluation of the learner's current weights on held-out prompts (the task's ``test`` split)."""

from __future__ import annotations

import time

from rollcorr.engines import SamplingParams


class GreedyEvaluator:
    """Accuracy = share of held-out prompts whose greedy response earns reward 1.

    Runs on its own sampler (so it never disturbs the training sampler's weights or thread) loaded with the
    learner's weights at evaluation time. The prompts are fixed for the whole run (``seed``).
    """

    def __init__(self, sampler, task, tokenizer, n_prompts: int, max_new_tokens: int, seed: int):
        self.sampler, self.task, self.tokenizer = sampler, task, tokenizer
        self.items = task.sample(n_prompts, seed=seed, split="test")
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, seed=seed)

    def __call__(self, weights, version: int) -> dict[str, float]:
        if not self.items:
            return {}
        start = time.perf_counter()
        self.sampler.load_weights(weights, version)
        rollout = self.sampler.generate(
            [it["prompt"] for it in self.items], self.params, n=1, meta=self.items
        )
        ids = [row[mask].tolist() for row, mask in zip(rollout.response_ids, rollout.response_mask.bool())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        rewards = [float(self.task.reward(item, text)) for item, text in zip(self.items, texts)]
        return {
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward": sum(rewards) / len(rewards),
            "time/eval_s": time.perf_counter() - start,
        }
