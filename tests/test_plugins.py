"""A sampler engine added from outside the package, through the public registration API
(``rollcorr.engines.register_sampler``), trains 2 steps.

The toy engine is a real sampler (the hf decode loop on the float32 model, built by the registered function)
that says it cannot resume responses; the run's own metrics show it was used. The other extension points (a
loss, a rejection rule, a π_old strategy) added from outside: tests/test_recipes.py; all four from a plugin named
in the config, in every process of a run: tests/test_plugins_config.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from rollcorr import engines
from rollcorr.engines.hf import HFSampler
from rollcorr.train.build import check_components
from rollcorr.train.config import ConfigError, load_config
from rollcorr.train.loop import run

TINY = [
    "task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
    "task.eval_prompts=0", "trainer.steps=2", "trainer.progress=false", "trainer.plot=false",
    "trainer.tensorboard=false", "trainer.checkpoint_every=0", "trainer.mini_batches=1",
]


class CountingSampler(HFSampler):
    """An outside engine: hf's decode loop in float32, counting its batches; it declares no partial rollouts."""

    can_resume = False
    built: list[CountingSampler] = []

    def __init__(self, model_path, option: str | None):
        super().__init__(model_path, dtype=torch.float32)
        self.option, self.batches = option, 0
        CountingSampler.built.append(self)

    def generate(self, *args, **kwargs):
        self.batches += 1
        return super().generate(*args, **kwargs)


def build_counting(spec, model_path, threads: int = 0, **kwargs):
    from rollcorr.models.builtin import BUILTIN

    return CountingSampler(BUILTIN if model_path is None else model_path, spec.quant)


@pytest.fixture(scope="module", autouse=True)
def registered():
    engines.register_sampler("counting", build_counting, CountingSampler)
    yield
    engines.BACKENDS.pop("counting", None)


def _steps(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "reward/mean" in r]


def test_outside_sampler_engine_trains_two_steps(tmp_path, addition_model_dir):
    CountingSampler.built.clear()
    config = load_config(None, [*TINY, f"model.path={addition_model_dir}", "model.sampler=counting:fast",
                                f"trainer.out={tmp_path / 'run'}"])
    result = run(config)
    assert result.steps == 2 and result.stopped is None
    (sampler,) = CountingSampler.built
    assert (
        sampler.option == "fast" and sampler.batches == 2
    )  # the registered build ran, once, with the option
    steps = _steps(tmp_path / "run")
    assert len(steps) == 2 and all(s["train/applied_updates"] >= 0 for s in steps)
    assert all(torch.isfinite(torch.tensor(s["rollout_corr/kl"])) for s in steps)  # it gave log μ


def test_outside_sampler_declares_what_it_cannot_do():
    config = load_config(
        None, ["model.sampler=counting", "trainer.mode=async", "trainer.partial_rollouts=true"]
    )
    with pytest.raises(ConfigError, match=r"^trainer.partial_rollouts: sampler 'counting' cannot resume"):
        check_components(config)
    with pytest.raises(ValueError, match="unknown engine backend 'countin'.*counting"):
        engines.parse_spec("countin")


def test_registration_refuses_a_clash():
    with pytest.raises(ValueError, match="new identifier"):
        engines.register_sampler("hf", build_counting, CountingSampler)
