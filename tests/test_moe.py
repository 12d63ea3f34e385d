"""Mixture of experts: the builtin:moe checkpoint, routing metrics, capture through the hf decode loop, and
routing replay (R3) on Qwen3-MoE and other transformers MoE families built from tiny configs."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import FORWARD_SANITY, assert_as_accurate, assert_same_forward
from rollcorr.engines import SamplingParams, make_sampler
from rollcorr.engines.hf import HFLearner
from rollcorr.models.builtin import BUILTIN_MODELS, load_builtin
from rollcorr.moe import (
    capture_routing,
    compact_expert_dtype,
    delta_p_by_flip,
    find_routers,
    replay_gate_weights,
    replay_routing,
    routing_flip_metrics,
    routing_flips,
    routing_shape,
    sequence_routing,
)
from rollcorr.rollout import Rollout
from rollcorr.tasks import AdditionTask

MOE = "builtin:moe"
MOE_DIR = BUILTIN_MODELS[MOE].directory
needs_checkpoint = pytest.mark.skipif(not (MOE_DIR / "model.safetensors").exists(), reason="no builtin:moe")


def tiny_moe(model_type: str, **extra):
    """A random 2-layer transformers MoE (6 experts, top-2) of the given family."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra,
    )
    return AutoModelForCausalLM.from_config(config).eval()


FAMILIES = {
    "qwen3_moe": dict(num_experts=6, moe_intermediate_size=16, norm_topk_prob=True, head_dim=16),
    "qwen3_moe_raw": dict(num_experts=6, moe_intermediate_size=16, norm_topk_prob=False, head_dim=16),
    "mixtral": dict(num_local_experts=6, intermediate_size=16),
    "olmoe": dict(num_experts=6, intermediate_size=16),
}


# ---- metrics -----------------------------------------------------------------------------------------


def test_flips_compare_sets_not_order():
    a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])  # (1, 2, 2, 2)
    b = torch.tensor([[[[1, 0], [2, 3]], [[4, 6], [6, 7]]]])  # same set; one layer changed
    assert routing_flips(a, b).tolist() == [[[False, False], [True, False]]]
    m = routing_flip_metrics(a, b, torch.tensor([[True, True]]))
    assert m["routing_flip_share"] == pytest.approx(0.25)
    assert m["routing_flip_token_share"] == pytest.approx(0.5)
    assert m["routing_layer_flip_rate"] == [pytest.approx(0.5), 0.0] and m["routing_tokens"] == 2
    masked = routing_flip_metrics(a, b, torch.tensor([[True, False]]))  # the flipped token is padding
    assert masked["routing_flip_share"] == 0.0 and masked["routing_tokens"] == 1
    dp = torch.tensor([[0.01, 0.3]])
    split = delta_p_by_flip(dp, routing_flips(a, b), torch.tensor([[True, True]]))
    assert split["abs_dp_mean_flipped"] == pytest.approx(0.3)
    assert split["abs_dp_mean_unflipped"] == pytest.approx(0.01)
    assert split["tokens_flipped"] == 1 and split["tokens_unflipped"] == 1
    with pytest.raises(ValueError, match="cannot be compared"):
        routing_flips(a, b[:, :1])
    assert compact_expert_dtype(8) == torch.uint8 and compact_expert_dtype(300) == torch.int16


def test_replay_gate_weights_are_the_softmax_over_the_chosen_experts():
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0]])
    ids = torch.tensor([[3, 1]])
    norm = replay_gate_weights(logits, ids, normalize=True)
    assert torch.allclose(norm, torch.softmax(logits[0, [3, 1]], -1)[None])  # R3: softmax over chosen logits
    raw = replay_gate_weights(logits, ids, normalize=False)
    assert torch.allclose(raw, torch.softmax(logits, -1)[:, [3, 1]])


def test_sequence_routing_places_response_routing_at_predicting_positions():
    prompt_mask = torch.tensor([[False, True, True]])
    response_mask = torch.tensor([[True, True, False]])
    routed = torch.tensor([[[[1, 2]], [[3, 4]], [[0, 0]]]])  # (1, 3, 1, 2)
    prompt_routed = torch.tensor([[[[7, 7]], [[5, 6]], [[1, 2]]]])
    seq = sequence_routing(prompt_mask, response_mask, routed, prompt_routed)
    assert seq[0, :, 0].tolist() == [[-1, -1], [5, 6], [1, 2], [3, 4], [-1, -1], [-1, -1]]


# ---- capture and replay on transformers MoE families ---------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replay_forces_experts_and_recomputes_gates_from_own_logits(family):
    model = tiny_moe(family.removesuffix("_raw"), **FAMILIES[family])
    assert routing_shape(model) == (2, 2, 6) and len(find_routers(model)) == 2
    ids = torch.randint(3, 40, (2, 5))
    with capture_routing(model) as rec:
        base = model(input_ids=ids).logits
    own = rec.take()[0].view(2, 5, 2, 2)
    with replay_routing(model, own) as replay:  # replaying the model's own choice changes nothing
        same = model(input_ids=ids).logits
    assert torch.allclose(same, base, atol=1e-6) and replay.forced_tokens == 2 * 5 * 2
    other = (own + 1) % 6
    other[0, 0] = -1  # the router keeps its own choice here
    with replay_routing(model, other), capture_routing(model) as rec:
        forced = model(input_ids=ids).logits
    used = rec.take()[0].view(2, 5, 2, 2)
    assert torch.equal(used[0, 0], own[0, 0]) and torch.equal(used.flatten(0, 1)[1:], other.flatten(0, 1)[1:])
    assert not torch.allclose(forced, base, atol=1e-4)
    # gradients reach the router through the recomputed gate weights
    with replay_routing(model, other):
        model(input_ids=ids).logits.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in find_routers(model))


def test_replay_refuses_wrong_shapes_and_dense_models(addition_model_dir, float64_reference):
    model = tiny_moe("qwen3_moe", **FAMILIES["qwen3_moe"])
    ids = torch.randint(3, 40, (2, 5))
    with pytest.raises(ValueError, match="3 layers, the model has 2"):
        with replay_routing(model, torch.zeros(2, 5, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="sees 10 tokens"):
        with replay_routing(model, torch.zeros(2, 4, 2, 2, dtype=torch.long)):
            model(input_ids=ids)
    # scored in row chunks, in order: each chunk replays its own rows
    with capture_routing(model) as rec:
        model(input_ids=ids)
    other = (rec.take()[0].view(2, 5, 2, 2) + 1) % 6
    with replay_routing(model, other), capture_routing(model) as rec:
        whole = model(input_ids=ids).logits
        parts = torch.cat([model(input_ids=ids[:1]).logits, model(input_ids=ids[1:]).logits])
    calls = rec.take()
    # the row chunks as close to float64 as the whole batch: the same model in float64 (transformers' eager
    # expert loop: grouped_mm has no float64 kernel), replaying the same routing. The replayed gate weights are
    # float32 softmax values (rollcorr.moe computes them as the routers do), one rounding the float32 paths
    # share: within the floor of 4 ε₃₂ ‖ref‖
    twin = copy.deepcopy(model).double()
    twin.set_experts_implementation("eager")
    with float64_reference(), replay_routing(twin, other), torch.no_grad():
        exact = twin(input_ids=ids).logits
    assert_as_accurate(parts, whole.detach(), exact, sanity=FORWARD_SANITY * float(exact.norm()), what="logits")
    assert torch.equal(torch.cat([c.view(-1, 5, 2, 2) for c in calls[1:]]), other)
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(addition_model_dir)
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        with replay_routing(dense, None):
            pass
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        HFLearner(addition_model_dir, routing_replay="r3")


# ---- the shipped model, the sampler's capture and the learner's replay ---------------------------------


@needs_checkpoint
def test_builtin_moe_is_a_small_qwen3_moe():
    config = json.loads((MOE_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2
    assert config["norm_topk_prob"] is True
    model, _ = load_builtin(name=MOE)
    assert sum(p.numel() for p in model.parameters()) < 250_000
    assert (MOE_DIR / "model.safetensors").stat().st_size < 1_000_000
    assert routing_shape(model) == (2, 2, 8)
    info = json.loads((MOE_DIR / "training_info.json").read_text())
    assert 0.15 <= info["final_greedy_score_test"] <= 0.40  # the dense model's accuracy window


@needs_checkpoint
def test_sampler_capture_matches_learner_at_fp32_and_replay_forces_sampler_routing():
    prompts = [i["prompt"] for i in AdditionTask(3).sample(8, seed=0, split="test")]
    params = SamplingParams(max_new_tokens=6, seed=0)
    fp32 = make_sampler("hf:fp32", MOE).generate(prompts, params, n=2)
    assert fp32.routed_experts.dtype == torch.uint8 and fp32.routed_experts.shape[2:] == (2, 2)
    assert fp32.prompt_routed_experts.shape[:2] == fp32.prompt_ids.shape
    mask = fp32.response_mask
    learner, replaying = HFLearner(MOE), HFLearner(MOE, routing_replay="r3")
    # the KV decode loop and the full-sequence learner route alike at the same precision
    assert (
        routing_flip_metrics(fp32.routed_experts, learner.routed_experts(fp32), mask)["routing_flip_share"]
        == 0
    )
    # the prompt routing's last column is the first response token's routing
    assert torch.equal(fp32.prompt_routed_experts[:, -1], fp32.routed_experts[:, 0])
    # a routing the learner would never pick is what it uses under replay, on every valid token
    forced = fp32.replace(routed_experts=((fp32.routed_experts.long() + 3) % 8).to(torch.uint8))
    assert routing_flips(forced.routed_experts, learner.routed_experts(forced))[mask].any()
    used = replaying.routed_experts(forced)
    assert not routing_flips(forced.routed_experts, used)[mask].any()
    assert not torch.allclose(replaying.log_prob(forced), learner.log_prob(forced), atol=1e-4)
    with pytest.raises(ValueError, match="needs the sampler's routed experts"):
        replaying.log_prob(fp32.replace(routed_experts=None))


@needs_checkpoint
def test_bf16_sampler_flips_some_routes_and_replay_follows_them():
    prompts = [i["prompt"] for i in AdditionTask(3).sample(64, seed=0, split="test")]
    r = make_sampler("hf:bf16", MOE).generate(prompts, SamplingParams(max_new_tokens=6, seed=0), n=4)
    learner, replaying = HFLearner(MOE), HFLearner(MOE, routing_replay="r3")
    metrics = routing_flip_metrics(r.routed_experts, learner.routed_experts(r), r.response_mask)
    assert 0 < metrics["routing_flip_share"] < 0.2
    assert not routing_flips(r.routed_experts, replaying.routed_experts(r))[r.response_mask].any()


@needs_checkpoint
def test_rollout_concat_and_select_carry_routing_and_resume_keeps_old_tokens():
    sampler = make_sampler("hf:fp32", MOE)
    prompts = [i["prompt"] for i in AdditionTask(3).sample(3, seed=1, split="test")]
    params = SamplingParams(max_new_tokens=6, seed=0)
    short = sampler.generate(["1+2="], params)
    long = sampler.generate(prompts, params)
    both = Rollout.concat([short, long])
    assert both.routed_experts.shape[:2] == both.response_ids.shape
    assert both.prompt_routed_experts.shape[:2] == both.prompt_ids.shape
    assert torch.equal(
        both.select([0]).routed_experts[0, : short.response_ids.shape[1]], short.routed_experts[0]
    )
    part = sampler.generate(prompts, params, max_steps=2)
    done = sampler.generate(prompts, params, resume=part)
    assert done.routed_experts.shape[:2] == done.response_ids.shape
    assert torch.equal(done.routed_experts[:, :2], part.routed_experts[:, :2])
    # at fp32 the resumed tokens' routing is what a full-sequence forward picks
    assert (
        routing_flip_metrics(done.routed_experts, HFLearner(MOE).routed_experts(done), done.response_mask)[
            "routing_flip_share"
        ]
        == 0.0
    )
    with pytest.raises(ValueError, match="routed_experts has shape"):
        long.replace(routed_experts=long.routed_experts[:, :1])


# ---- dumps -----------------------------------------------------------------------------------------------


@needs_checkpoint
def test_dumps_carry_routing_and_analyze_reports_flips(tmp_path):
    import subprocess
    import sys

    from rollcorr.analyze.analysis import analyze
    from rollcorr.config import CorrectionConfig
    from rollcorr.dumps import read_dump, write_dump

    prompts = [i["prompt"] for i in AdditionTask(3).sample(16, seed=0, split="test")]
    r = make_sampler("hf:bf16", MOE).generate(prompts, SamplingParams(max_new_tokens=6, seed=0), n=4)
    learner = HFLearner(MOE)
    own = learner.routed_experts(r)
    path = tmp_path / "dump.jsonl"
    write_dump(path, r.rollout_log_prob, learner.log_prob(r), r.response_mask, routed_experts=r.routed_experts,
               learner_routed_experts=own, append=False)
    dump = read_dump(path)
    assert dump.fields["routed_experts"] == "routed_experts"
    assert torch.equal(dump.routed_experts, r.routed_experts.long()) and torch.equal(
        dump.learner_routed_experts, own
    )
    assert torch.equal(dump.to_rollout().routed_experts, dump.routed_experts)
    analysis = analyze(dump, CorrectionConfig())
    expected = routing_flip_metrics(r.routed_experts, own, r.response_mask)["routing_flip_share"]
    assert analysis.metrics["routing/routing_flip_share"] == pytest.approx(expected)
    assert any(note.startswith("routing") or note.startswith("Routing") for note in analysis.notes)
    out = subprocess.run(
        [sys.executable, "-m", "rollcorr.cli", "analyze", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_dump_reader_takes_skyrl_and_full_sequence_routing(tmp_path):
    from rollcorr.dumps import read_dump

    seq = [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[1, 2]]]  # 3 prompt positions + 2 response tokens
    rows = [
        {"rollout_log_probs": [-0.1, -0.2], "old_log_probs": [-0.1, -0.3], "rollout_expert_indices": seq},
        {"rollout_log_probs": [-0.5], "old_log_probs": [-0.4], "rollout_expert_indices": [[[3, 4]]]},
        {
            "rollout_log_probs": [-0.5],
            "old_log_probs": [-0.4],
            "rollout_expert_indices": [[3, 4]],
        },  # bad shape
    ]
    path = tmp_path / "skyrl.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dump = read_dump(path)
    assert dump.fields["routed_experts"] == "rollout_expert_indices"
    # the full sequence: the positions that predict the two response tokens (last prompt token, first response)
    assert dump.routed_experts[0].tolist() == [[[4, 5]], [[6, 7]]]
    assert dump.routed_experts[1, 0].tolist() == [[3, 4]]
    assert [m.line for m in dump.malformed] == [3] and "rollout_expert_indices" in dump.malformed[0].reason


# ---- training: π_θ and every π_old replay the rollout's routing ----------------------------------------


@needs_checkpoint
@pytest.mark.parametrize("name", ["recompute", "snapshot", "old_logit_model", "ewma", "interrupt"])
def test_every_old_policy_strategy_replays_the_rollout_routing(name):
    from rollcorr.proximal import make_proximal

    prompts = [i["prompt"] for i in AdditionTask(3).sample(4, seed=2, split="test")]
    r = make_sampler("hf:fp32", MOE).generate(prompts, SamplingParams(max_new_tokens=5, seed=0), n=2)
    forced = r.replace(routed_experts=((r.routed_experts.long() + 5) % 8).to(torch.uint8),
                       version=torch.zeros_like(r.version))
    replaying, plain = HFLearner(MOE, routing_replay="r3"), HFLearner(MOE)
    strategy = make_proximal(name, max_staleness=2)
    strategy.on_publish(0, replaying.model)
    try:
        old = strategy.old_log_prob(forced, replaying, 0).old_log_prob
    finally:
        getattr(strategy, "close", lambda: None)()
    mask = forced.response_mask
    assert_same_forward(old[mask], replaying.log_prob(forced)[mask], replaying.model.config, name)
    assert (old - plain.log_prob(forced))[mask].abs().max() > 1e-3  # without replay it would differ


@needs_checkpoint
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])  # async: a minute
def test_train_moe_config_with_routing_replay(tmp_path, mode):
    from rollcorr.train.config import ConfigError, load_config
    from rollcorr.train.loop import Trainer

    overrides = ["model.routing_replay=r3", f"trainer.mode={mode}", "trainer.steps=2", "rollout.prompts_per_step=2",
                 "rollout.group_size=2", "task.eval_prompts=4", "trainer.progress=false", "trainer.plot=false",
                 "trainer.tensorboard=false", "trainer.checkpoint_every=0", f"trainer.out={tmp_path / 'run'}"]
    if mode == "async":
        overrides.append("algorithm.proximal.name=ewma")
    config = load_config("moe", overrides)
    assert config.model.path == MOE and config.model.routing_replay == "r3"
    trainer = Trainer(config)
    result = trainer.run()
    assert result.steps == 2
    assert trainer.learner.replayed_pairs > 0  # π_θ was scored through the sampler's experts
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert len(steps) == 2  # each step logs how far the learner's own routers are from the sampler's choice
    assert all(0.0 <= r["routing/flip_share"] <= r["routing/flip_token_share"] <= 1.0 for r in steps)
    with pytest.raises(ConfigError, match="model.routing_replay"):
        load_config("moe", ["model.routing_replay=r2"])
    with pytest.raises(ConfigError, match="model.routing_replay"):
        load_config("moe", ["model.routing_replay=r3", "model.sampler=llamacpp:q8_0"])
