"""Routing replay inside TRL's GRPOTrainer (the `.[trl]` extra): ``RollcorrGRPOTrainer(routing_replay="r3")``
on the built-in MoE model, with a ``rollout_func`` that samples with rollcorr's bfloat16 hf sampler and returns
its routed experts. Skipped when TRL is not installed."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl", reason="trl not installed (pip install the .[trl] extra)")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from rollcorr.compat.trl import RollcorrGRPOTrainer  # noqa: E402
from rollcorr.engines import SamplingParams, make_sampler  # noqa: E402
from rollcorr.models.builtin import BUILTIN_MODELS, load_builtin  # noqa: E402
from rollcorr.moe import capture_routing  # noqa: E402

MOE = "builtin:moe"
PROMPTS = ["12+7=", "30+4=", "6+21=", "18+8="]
pytestmark = pytest.mark.skipif(
    not (BUILTIN_MODELS[MOE].directory / "model.safetensors").exists(), reason="no builtin:moe checkpoint"
)


def moe_rollout_func(with_routing: bool = True):
    """A TRL ``rollout_func``: rollcorr's bf16 hf sampler (weights synced from the trainer every batch) returns
    tokens, log μ and, per completion, the experts of every token (and of the prompt)."""
    sampler = make_sampler("hf:bf16", MOE)
    calls = {"n": 0}

    def rollout_func(prompts, trainer):
        calls["n"] += 1
        sampler.load_weights(trainer.model.state_dict(), calls["n"])
        r = sampler.generate(prompts, SamplingParams(max_new_tokens=6, seed=calls["n"]))
        valid, prompt_valid = r.response_mask.bool(), r.prompt_mask.bool()
        out = {
            "prompt_ids": [r.prompt_ids[i][prompt_valid[i]].tolist() for i in range(r.batch_size)],
            "completion_ids": [r.response_ids[i][valid[i]].tolist() for i in range(r.batch_size)],
            "logprobs": [r.rollout_log_prob[i][valid[i]].tolist() for i in range(r.batch_size)],
        }
        if with_routing:
            out["routed_experts"] = [r.routed_experts[i][valid[i]].tolist() for i in range(r.batch_size)]
            out["prompt_routed_experts"] = [
                r.prompt_routed_experts[i][prompt_valid[i]].tolist() for i in range(r.batch_size)
            ]
        return out

    return rollout_func


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
