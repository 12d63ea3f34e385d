"""``checkpoints``: the chain task in turns, the environment writing back the right number between them.

The built-in chain task (``rollcorr.tasks.chain``) asks for 14 numbers, each computed from the one before, in
one 70-token response, so one slip costs every number after it. Here the model writes ``every`` numbers per
turn (``rollout.max_new_tokens`` = 5 · every caps each turn); the environment then checks them and writes the
right last number of the turn back — a verifier the model consults, as a tool — and the model continues the
chain from it. A trajectory has ⌈14 / every⌉ model turns, each scored on its own numbers:

    reward of turn k = (numbers of turn k written exactly right) / 14,    trajectory reward = Σ_k ≤ 1

so the trajectory's reward is the share of the 14 numbers right, the chain task's reward, with errors reset
at each checkpoint instead of compounding to the end.

    rollcorr train --config chain_turns          # every: 7 — two turns per trajectory
"""

from __future__ import annotations

from typing import Any

from rollcorr.envs.base import Turn, register_env
from rollcorr.tasks.chain import ChainTask


class CheckpointChain:
    """``ChainTask`` items played ``every`` numbers per model turn, the right number written back after each."""

    def __init__(self, task: ChainTask, every: int = 7) -> None:
        if not isinstance(task, ChainTask):
            raise ValueError(f"checkpoints plays the chain task (task.name=chain); got {task.name!r}")
        if not isinstance(every, int) or not 1 <= every <= task.terms:
            raise ValueError(f"every must be an int in [1, {task.terms}], got {every!r}")
        self.task, self.every = task, every
        self.name = f"{task.name}/checkpoints:{every}"
        self.max_turns = -(-task.terms // every)
        self.turn_tokens = every * (task.digits + 1)  # one turn's numbers: the cap rollout.max_new_tokens sets

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        return self.task.sample(n, seed, split)

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        return self.task.held_out(n, seed)

    def reset(self, item: dict[str, Any]) -> Checkpoints:
        return Checkpoints(self, item)


class Checkpoints:
    """One chain's episode: the numbers still to write, turn by turn."""

    def __init__(self, env: CheckpointChain, item: dict[str, Any]) -> None:
        self.env, self.prompt = env, item["prompt"]
        self.numbers = item["answer"].rstrip(",").split(",")  # the right answer, each number reversed
        self.done_numbers = 0

    def step(self, response_text: str) -> Turn:
        want = self.numbers[self.done_numbers : self.done_numbers + self.env.every]
        got = response_text.strip().rstrip(",").split(",") if response_text.strip() else []
        reward = sum(g == w for g, w in zip(got, want)) / len(self.numbers)
        self.done_numbers += len(want)
        if self.done_numbers >= len(self.numbers):
            return Turn(reward=reward, done=True)
        return Turn(observation=want[-1] + ",", reward=reward)  # the right last number: the chain goes on from it


def _checkpoints(task, every: int = 7) -> CheckpointChain:
    return CheckpointChain(task, every)


register_env("checkpoints", _checkpoints)
