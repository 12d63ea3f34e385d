"""Greedy evaluation of the learner's current weights on held-out prompts (the task's ``test`` split)."""

from __future__ import annotations

import time

from rollcorr.engines import SamplingParams
from rollcorr.envs import Limits, Renderer, as_environment, play


class GreedyEvaluator:
    """Accuracy = share of held-out episodes whose greedy trajectory earns reward 1 (a task: its one turn).

    Runs on its own sampler (so it never disturbs the training sampler's weights or thread) loaded with the
    learner's weights at evaluation time. The items are fixed for the whole run: ``env.held_out`` (a data set's
    held-out rows, each once, in file order; ``n_prompts`` caps them), through the chat template when ``chat``
    (as the training sampler's), played to their end with the run's trajectory ``limits``.
    """

    def __init__(self, sampler, env, tokenizer, n_prompts: int, max_new_tokens: int, seed: int,
                 chat: bool = False, limits: Limits = Limits()):
        self.sampler, self.env, self.tokenizer = sampler, as_environment(env), tokenizer
        self.items = self.env.held_out(n_prompts, seed)
        self.renderer = Renderer(tokenizer, chat)
        self.limits = limits
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, seed=seed)
        self.last: list[dict] = []  # the last evaluation's (item, response text, reward)

    def __call__(self, weights, version: int) -> dict[str, float]:
        if not self.items:
            return {}
        start = time.perf_counter()
        self.sampler.load_weights(weights, version)
        rollout = play(self.sampler, self.env, self.items, self.renderer, self.params, limits=self.limits,
                       rows="the greedy evaluation")
        ids = [row[mask].tolist() for row, mask in zip(rollout.response_ids, rollout.token_mask)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        rewards = rollout.rewards.tolist()
        self.last = [{"item": item, "response": text, "reward": r} for item, text, r in zip(self.items, texts, rewards)]
        return {
            "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward": sum(rewards) / len(rewards),
            "eval/prompts": float(len(rewards)),
            "time/eval_s": time.perf_counter() - start,
        }
