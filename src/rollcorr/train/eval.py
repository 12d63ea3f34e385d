"""Greedy evaluation of the learner's current weights on held-out prompts (the task's ``test`` split)."""

from __future__ import annotations

import time

from rollcorr.engines import SamplingParams
from rollcorr.tasks.base import rewards as task_rewards
from rollcorr.tasks.chat import model_input


class GreedyEvaluator:
    """Accuracy = share of held-out prompts whose greedy response earns reward 1.

    Runs on its own sampler (so it never disturbs the training sampler's weights or thread) loaded with the
    learner's weights at evaluation time. The prompts are fixed for the whole run: ``task.held_out`` (a data
    set's held-out rows, each once, in file order; ``n_prompts`` caps them), through the chat template when
    ``chat`` (as the training sampler's).
    """

    def __init__(self, sampler, task, tokenizer, n_prompts: int, max_new_tokens: int, seed: int,
                 chat: bool = False, reward_limits: tuple[float | None, bool] = (None, False)):  # fmt: skip
        self.sampler, self.task, self.tokenizer = sampler, task, tokenizer
        self.reward_limits = reward_limits  # (task.reward_timeout, task.reward_clip): tasks.base.rewards
        self.items = task.held_out(n_prompts, seed)
        self.inputs = [model_input(tokenizer, it["prompt"], chat) for it in self.items]
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, seed=seed)
        self.last: list[dict] = []  # the last evaluation's (item, response text, reward)

    def __call__(self, weights, version: int) -> dict[str, float]:
        if not self.items:
            return {}
        start = time.perf_counter()
        self.sampler.load_weights(weights, version)
        rollout = self.sampler.generate(self.inputs, self.params, n=1, meta=self.items)
        ids = [row[mask].tolist() for row, mask in zip(rollout.response_ids, rollout.response_mask.bool())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        rewards = task_rewards(self.task, self.items, texts, *self.reward_limits, rows="the greedy evaluation")
        self.last = [{"item": item, "response": text, "reward": r} for item, text, r in zip(self.items, texts, rewards)]
        return {
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward": sum(rewards) / len(rewards),
            "eval/prompts": float(len(rewards)),
            "time/eval_s": time.perf_counter() - start,
        }
