"""Routing replay inside TRL's GRPOTrainer (the `.[trl]` extra): ``RollcorrGRPOTrainer(routing_replay="r3")``
on the built-in MoE model, with a ``rollout_func`` that samples with rollcorr's bfloat16 hf sampler and returns
its routed experts (``SamplerRollout``). Skipped when TRL is not installed."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl", reason="trl not installed (pip install the .[trl] extra)")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from rollcorr.compat.trl import RollcorrGRPOTrainer, SamplerRollout  # noqa: E402
from rollcorr.models.builtin import BUILTIN_MODELS, load_builtin  # noqa: E402
from rollcorr.moe import capture_routing  # noqa: E402

MOE = "builtin:moe"
PROMPTS = ["12+7=", "30+4=", "6+21=", "18+8="]
pytestmark = pytest.mark.skipif(
    not (BUILTIN_MODELS[MOE].directory / "model.safetensors").exists(), reason="no builtin:moe checkpoint"
)


def moe_rollout_func(with_routing: bool = True):
    """A TRL ``rollout_func``: ``SamplerRollout`` on rollcorr's bf16 hf sampler, which returns the routed experts
    of every completion token (and prompt token) of an MoE model; ``with_routing=False`` drops them."""
    rollout = SamplerRollout("hf:bf16", seed=0)
    if with_routing:
        return rollout

    def without_routing(prompts, trainer):
        out = rollout(prompts, trainer)
        assert "routed_experts" in out  # the sampler gave them: this function is what removes them
        return {k: v for k, v in out.items() if "routed_experts" not in k}

    return without_routing


def alternating_reward(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def make_trainer(tmp_path, steps=2, with_routing=True, **kwargs):
    model, tokenizer = load_builtin(name=MOE)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[],
                      use_cpu=True, save_strategy="no", beta=0.0, seed=0)  # fmt: skip
    return RollcorrGRPOTrainer(model=model, reward_funcs=alternating_reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tokenizer,
                               rollout_func=moe_rollout_func(with_routing), **kwargs)  # fmt: skip


def test_trl_trainer_replays_the_sampler_routing(tmp_path):
    trainer = make_trainer(tmp_path, correction="decoupled_token_is", routing_replay="r3")
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(4)])
    routes = batch["routed_experts"]
    width = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    assert routes.shape == (16, width, 2, 2)
    # the loss's forward runs the sampler's experts at every position that has them
    with capture_routing(trainer.model) as recorder:
        loss = trainer._compute_loss(trainer.model, batch)
    (used,) = recorder.take()
    given = routes >= 0
    assert given.any() and torch.equal(used.view_as(routes)[given], routes[given])
    assert math.isfinite(loss.item())
    trainer.train()  # two steps end to end
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)


def test_trl_replay_needs_routing_from_the_rollout_func(tmp_path):
    trainer = make_trainer(tmp_path, with_routing=False, routing_replay="r3")
    with pytest.raises(ValueError, match="routed_experts per completion"):
        trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(4)])
    with pytest.raises(ValueError, match="routing_replay"):
        make_trainer(tmp_path, routing_replay="r2")
