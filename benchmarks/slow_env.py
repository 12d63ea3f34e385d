"""A plugin for bench_multi_turn.py: ``slow_checkpoints``, the built-in ``checkpoints`` environment whose every
reset and step first waits ``wait`` seconds, as an environment calling a tool or a service does.

    rollcorr train --config chain_turns plugins=[slow_env] task.env='{name: slow_checkpoints, wait: 0.05}'

(with this folder on PYTHONPATH, so that every process rollcorr starts can import it)."""

from __future__ import annotations

import time

from rollcorr.envs import register_env
from rollcorr.envs.checkpoints import CheckpointChain, Checkpoints


class SlowCheckpoints(Checkpoints):
    def __init__(self, env: CheckpointChain, item: dict, wait: float) -> None:
        time.sleep(wait)
        super().__init__(env, item)
        self.wait = wait

    def step(self, response_text: str):
        time.sleep(self.wait)
        return super().step(response_text)


class SlowCheckpointChain(CheckpointChain):
    def __init__(self, task, every: int = 7, wait: float = 0.05) -> None:
        super().__init__(task, every)
        self.wait = wait

    def reset(self, item: dict) -> SlowCheckpoints:
        return SlowCheckpoints(self, item, self.wait)


register_env("slow_checkpoints", lambda task, every=7, wait=0.05: SlowCheckpointChain(task, every, wait))
