"""Per-step routing metrics in training (``routing/flip_share``, ``routing/flip_token_share``): the learner's own
router choice, captured inside its π_θ forward (under replay too), against the sampler's ``routed_experts``."""

from __future__ import annotations

import json

import pytest
import torch

from rollcorr.engines.hf import HFLearner
from rollcorr.models.builtin import BUILTIN, BUILTIN_MODELS
from rollcorr.moe import RoutingFlips, capture_routing, replay_routing, response_routing

MOE = "builtin:moe"
needs_checkpoint = pytest.mark.skipif(
    not (BUILTIN_MODELS[MOE].directory / "model.safetensors").exists(), reason="no builtin:moe"
)
KEYS = ("routing/flip_share", "routing/flip_token_share")


def tiny_qwen3_moe():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts_per_tok=2, num_experts=6, moe_intermediate_size=16, head_dim=16,
        norm_topk_prob=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def test_own_capture_is_the_routers_choice_even_under_replay():
    model = tiny_qwen3_moe()
    ids = torch.randint(3, 40, (2, 5))
    with capture_routing(model) as ran, capture_routing(model, own=True) as chose:
        model(input_ids=ids)
    (base,) = ran.take()
    assert torch.equal(chose.take()[0], base)  # no replay: what the router picks is what the layer runs
    forced = torch.full((2, 5, 2, 2), -1, dtype=torch.long)
    forced[..., -1, :] = (base.view(2, 5, 2, 2)[..., -1, :] + 1) % 6  # the last layer runs other experts
    with replay_routing(model, forced), capture_routing(model) as ran, capture_routing(model, own=True) as chose:
        model(input_ids=ids)
    assert torch.equal(ran.take()[0].view(2, 5, 2, 2)[..., -1, :], forced[..., -1, :])
    # the last layer's output feeds no router: its own choice, and layer 0's, are unchanged by the replay
    assert torch.equal(chose.take()[0], base)


def test_response_routing_takes_the_predicting_positions_and_checks_the_shape():
    calls = [torch.arange(2 * 5).view(2 * 5, 1, 1)]  # one call, 2 rows × (3 prompt + 2 response) positions
    mask = torch.tensor([[True, True], [True, False]])
    out = response_routing(calls, 3, mask)
    assert out[..., 0, 0].tolist() == [[2, 3], [7, 0]]  # positions P − 1 + t; padding 0
    chunks = [calls[0][:5], calls[0][5:]]  # scored in row chunks, in order
    assert torch.equal(response_routing(chunks, 3, mask), out)
    with pytest.raises(ValueError, match="does not match one forward over 2 rows × 2 \\+ 2"):
        response_routing(calls, 2, mask)


# ---- one training step on builtin:moe ------------------------------------------------------------------


def _step_parts(replay: str | None):
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.config import load_config
    from rollcorr.train.source import SourceSpec, sample_batch

    overrides = ["model.sampler=hf:fp32", "trainer.mini_batches=1", "rollout.prompts_per_step=4",
                 "rollout.group_size=2", "rollout.max_new_tokens=5"]
    if replay:
        overrides.append(f"model.routing_replay={replay}")
    config = load_config("moe", overrides)
    rollout = sample_batch(SourceSpec.from_config(config).build(), 0)
    rollout = rollout.replace(rewards=(torch.arange(rollout.batch_size) % 2).float())  # non-zero advantages
    learner = HFLearner(MOE, routing_replay=replay)
    optimizer = torch.optim.AdamW(learner.model.parameters(), lr=1e-3)
    proximal = build_proximal(config)
    proximal.on_publish(0, learner.model)
    return rollout, learner, optimizer, proximal, build_step_config(config)


@needs_checkpoint
@pytest.mark.parametrize("replay", [None, "r3"])
def test_step_logs_the_share_of_sampler_choices_the_learner_would_not_make(replay):
    from rollcorr.train.step import train_step

    rollout, learner, optimizer, proximal, step_config = _step_parts(replay)
    mask = rollout.response_mask
    # hand-built: on every other valid token the sampler "chose" other experts in the last MoE layer (that
    # layer's output feeds no router, so under replay too the learner's own choice stays the fp32 one)
    changed = mask & (torch.arange(mask.shape[1]) % 2 == 0)
    routes = rollout.routed_experts.clone()
    routes[..., -1, :] = torch.where(changed[..., None], (routes[..., -1, :].long() + 1) % 8, routes[..., -1, :].long())
    sampled = rollout.replace(routed_experts=routes.to(rollout.routed_experts.dtype))
    metrics = train_step(sampled, learner, optimizer, proximal, step_config, version=0).metrics
    valid, flipped = int(mask.sum()), int(changed.sum())
    assert 0 < flipped < valid
    layers = routes.shape[2]
    assert metrics["routing/flip_share"] == pytest.approx(flipped / (layers * valid))
    assert metrics["routing/flip_token_share"] == pytest.approx(flipped / valid)
    if replay:
        assert learner.replayed_pairs > 0  # the forward that measured the flips ran the sampler's experts
    # a rollout without routing (as from a dense model's sampler) logs nothing new
    plain = train_step(rollout.replace(routed_experts=None, prompt_routed_experts=None), HFLearner(MOE), optimizer,
                       proximal, step_config, version=0).metrics
    assert not any(k.startswith("routing/") for k in plain)


def test_dense_learner_has_no_routing_metrics():
    from rollcorr.rollout import Rollout

    learner = HFLearner(BUILTIN)
    rollout = Rollout(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.bool),
                      response_ids=torch.ones(1, 1, dtype=torch.long),
                      response_mask=torch.ones(1, 1, dtype=torch.bool), rollout_log_prob=torch.zeros(1, 1),
                      version=torch.zeros(1, 1, dtype=torch.long), group_ids=torch.zeros(1, dtype=torch.long),
                      routed_experts=torch.zeros(1, 1, 2, 2, dtype=torch.uint8))
    flips = RoutingFlips(learner.model, rollout)
    assert not flips.active and flips.metrics() == {}


# ---- rollcorr train: the metrics in metrics.jsonl ------------------------------------------------------------


def _train(tmp_path, *overrides) -> list[dict]:
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import Trainer

    out = tmp_path / "run"
    config = load_config("moe", ["trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                 "rollout.max_new_tokens=5", "task.eval_prompts=4", "trainer.progress=false",
                                 "trainer.plot=false", "trainer.tensorboard=false", "trainer.checkpoint_every=0",
                                 f"trainer.out={out}", *overrides])
    assert Trainer(config).run().steps == 2
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("step", 0) > 0 and "reward/mean" in r]


@needs_checkpoint
@pytest.mark.parametrize("replay", ["null", "r3"])
def test_fp32_sync_run_logs_zero_flips(tmp_path, replay):
    """fp32 sampler, fp32 learner, one mini-batch: each step's π_θ forward sees the weights that sampled the
    batch, so the learner's routers choose exactly the sampler's experts (with replay on or off)."""
    steps = _train(tmp_path, "model.sampler=hf:fp32", "trainer.mini_batches=1", f"model.routing_replay={replay}")
    assert len(steps) == 2
    for record in steps:
        assert record["routing/flip_share"] == 0.0 and record["routing/flip_token_share"] == 0.0


@needs_checkpoint
@pytest.mark.parametrize("replay", ["null", "r3"])
def test_simulated_async_run_logs_routing_metrics(tmp_path, replay):
    steps = _train(tmp_path, "trainer.mode=simulated_async", "trainer.lag=1", f"model.routing_replay={replay}")
    assert len(steps) == 2
    for record in steps:
        assert all(0.0 <= record[k] <= 1.0 for k in KEYS)
        assert record["routing/flip_share"] <= record["routing/flip_token_share"]  # L ≥ 1 layers per token


def test_routing_verdict_when_every_token_flipped():
    from rollcorr.audit.verdict import routing_sentences
    from rollcorr.moe import routing_summary

    a = torch.tensor([[[[0, 1]], [[2, 3]]]])  # (1, 2, 1, 2)
    summary = routing_summary(a, (a + 1) % 8, torch.tensor([[-0.1, -0.2]]), torch.tensor([[-0.2, -0.2]]),
                              torch.tensor([[True, True]]))
    assert summary["abs_dp_mean_unflipped"] is None
    (text,) = routing_sentences({"routing": summary})
    assert "100.0 % of tokens" in text and "no token unflipped" in text
