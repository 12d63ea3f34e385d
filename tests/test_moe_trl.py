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


def make_trainer(tmp_path, steps=2, with_routing=True, num_iterations=1, **kwargs):
    model, tokenizer = load_builtin(name=MOE)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[],
                      use_cpu=True, save_strategy="no", beta=0.0, seed=0, num_iterations=num_iterations)
    return RollcorrGRPOTrainer(model=model, reward_funcs=alternating_reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tokenizer,
                               rollout_func=moe_rollout_func(with_routing), **kwargs)


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


def shifted_last_layer(rollout_func, record: list):
    """A ``rollout_func`` whose sampler "chose" other experts in the last MoE layer on every completion token
    (that layer's output feeds no router, so the learner's own choice is unchanged under replay too)."""

    def shifted(prompts, trainer):
        out = rollout_func(prompts, trainer)
        out["routed_experts"] = [[[*layers[:-1], [(e + 1) % 8 for e in layers[-1]]] for layers in row]
                                 for row in out["routed_experts"]]
        record.append(out)
        return out

    return shifted


# num_iterations 2: TRL scores π_old itself; 1: TRL skips it and rollcorr scores it
@pytest.mark.parametrize(("replay", "iterations"), [(None, 1), ("r3", 1), ("r3", 2)])
def test_trl_dump_carries_routed_experts_and_analyze_reports_routing(tmp_path, replay, iterations):
    import contextlib
    import io
    import json

    from rollcorr.analyze.analysis import analyze
    from rollcorr.dumps import read_dump

    dump_path = tmp_path / "rollouts.jsonl"
    trainer = make_trainer(tmp_path, correction="decoupled_token_is", routing_replay=replay, dump_path=dump_path,
                           num_iterations=iterations)
    returned: list = []
    trainer.rollout_func = shifted_last_layer(SamplerRollout("hf:fp32", seed=0), returned)
    trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(4)])
    rows = [json.loads(line) for line in dump_path.read_text().splitlines()]
    (given,) = returned
    assert [row["routed_experts"] for row in rows] == given["routed_experts"]  # per completion token, (L, k)
    assert all(len(row["learner_routed_experts"]) == len(row["rollout_log_probs"]) for row in rows)
    dump = read_dump(dump_path)
    assert dump.fields["routed_experts"] == "routed_experts" and dump.learner_routed_experts is not None
    metrics = analyze(dump, trainer.correction).metrics
    # the learner's own routers never pick the shifted set: every token is flipped in the last layer, and
    # (fp32 sampler, fp32 learner) nearly none in the first; under replay the layers ran the shifted experts,
    # yet the dump holds what the routers themselves chose
    assert metrics["routing/routing_flip_token_share"] == 1.0
    assert 0.5 <= metrics["routing/routing_flip_share"] <= 0.55
    if replay is None or iterations > 1:
        return
    from rollcorr.cli import main  # the commands a user runs on the dump

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["analyze", str(dump_path)]) == 0
        assert main(["audit", "--from-log", str(dump_path), "--out", str(tmp_path / "audit")]) == 0
    assert "Routing: 50.0 % of token × layer router decisions differ" in " ".join(printed.getvalue().split())
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    assert summary["routing"]["routing_flip_token_share"] == 1.0
