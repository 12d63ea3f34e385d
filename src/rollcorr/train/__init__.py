"""``rollcorr train``: RL training with a separate sampler and learner (sync, simulated-async, async).

from rollcorr.train import load_config, run
result = run(load_config(None, ["trainer.steps=50", "algorithm.name=dapo"]))
"""

from rollcorr.train.config import ConfigError, TrainConfig, load_config
from rollcorr.train.loop import RunResult, Trainer, run

__all__ = ["ConfigError", "RunResult", "TrainConfig", "Trainer", "load_config", "run"]
