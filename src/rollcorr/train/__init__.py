"""``rollcorr train``: RL training with a separate sampler and learner (sync, simulated-async, async).

from rollcorr.train import load_config, run
result = run(load_config(None, ["trainer.steps=50", "algorithm.name=dapo"]))

The names below load on first use (PEP 562), so ``rollcorr train --help`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"ConfigError": "config", "TrainConfig": "config", "load_config": "config", "RunResult": "loop",
          "Trainer": "loop", "run": "loop"}

__all__ = ["ConfigError", "RunResult", "TrainConfig", "Trainer", "load_config", "run"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'rollcorr.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rollcorr.train.{_HOMES[name]}"), name)
