"""What shapes a step besides the policy loss (#50): the KL term to a frozen reference (in the loss or the reward),
responses cut at the token cap (masked, measured), DAPO's soft overlong punishment — each against a value
computed by hand — and the metrics TRL users read (clipped_ratio, terminated length, zero-variance groups)."""

import json
import math
from dataclasses import replace

import pytest
import torch

from rollcorr.config.correction import CorrectionConfig
from rollcorr.losses import LossConfig, policy_loss
from rollcorr.losses.kl import kl_loss, kl_penalty, kl_reward_penalty
from rollcorr.rollout import Rollout
from rollcorr.train.step import (
    StepConfig,
    _loss,
    correct_and_advantage,
    reward_metrics,
    shaped_rewards,
    truncated_rows,
)

LOG_PI = [[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]]
LOG_REF = [[-0.7, -1.0, -1.5], [-0.4, -2.0, 0.0]]
MASK = [[True, True, True], [True, True, False]]


def k3(log_pi: float, log_ref: float) -> float:
    """e^{ref − π} − (ref − π) − 1: the per-token k3 / low_var_kl estimate, by hand."""
    d = log_ref - log_pi
    return math.exp(d) - d - 1


def tensors():
    return (torch.tensor(LOG_PI, dtype=torch.float64), torch.tensor(LOG_REF, dtype=torch.float64),
            torch.tensor(MASK))


def test_the_kl_loss_is_the_hand_computed_estimate_aggregated_as_the_loss():
    log_pi, log_ref, mask = tensors()
    values = [[k3(p, r) for p, r, m in zip(rp, rr, rm) if m] for rp, rr, rm in zip(LOG_PI, LOG_REF, MASK)]
    token_mean = sum(map(sum, values)) / 5
    seq_mean = sum(sum(v) / len(v) for v in values) / 2
    assert kl_loss(log_pi, log_ref, mask, "low_var_kl", "token-mean").item() == pytest.approx(token_mean, rel=1e-12)
    assert kl_loss(log_pi, log_ref, mask, "k3", "seq-mean-token-mean").item() == pytest.approx(seq_mean, rel=1e-12)
    assert kl_loss(log_pi, log_ref, mask, "k3", "token-mean", per_sequence=True).item() == pytest.approx(seq_mean)
    k1 = sum(p - r for rp, rr, rm in zip(LOG_PI, LOG_REF, MASK) for p, r, m in zip(rp, rr, rm) if m) / 5
    assert kl_loss(log_pi, log_ref, mask, "k1", "token-mean").item() == pytest.approx(k1, rel=1e-12)
    # padding holding NaN reaches neither the value nor the gradient
    nan = log_pi.clone().requires_grad_(True)
    kl_loss(nan.masked_fill(~mask, math.nan), log_ref, mask, "k3", "token-mean").backward()
    assert torch.isfinite(nan.grad).all() and (nan.grad[~mask] == 0).all()


def test_k2_abs_and_the_straight_through_estimators_by_hand():
    """k2 = ½Δ² and abs = |Δ| (Δ = log π − log π_ref) token-averaged; k3+ keeps k3's value and takes k2's
    gradient, Δ / (kept tokens) per token (autograd against the hand-computed derivative)."""
    log_pi, log_ref, mask = tensors()
    deltas = [p - r for rp, rr, rm in zip(LOG_PI, LOG_REF, MASK) for p, r, m in zip(rp, rr, rm) if m]
    assert kl_loss(log_pi, log_ref, mask, "k2", "token-mean").item() == pytest.approx(
        sum(0.5 * d * d for d in deltas) / 5, rel=1e-12)
    assert kl_loss(log_pi, log_ref, mask, "abs", "token-mean").item() == pytest.approx(
        sum(abs(d) for d in deltas) / 5, rel=1e-12)
    x = log_pi.clone().requires_grad_(True)
    value = kl_loss(x, log_ref, mask, "k3+", "token-mean")
    assert value.item() == pytest.approx(kl_loss(log_pi, log_ref, mask, "k3", "token-mean").item(), rel=1e-12)
    value.backward()
    want = torch.where(mask, (log_pi - log_ref) / 5, torch.zeros_like(log_pi))
    assert torch.allclose(x.grad, want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'"):
        kl_loss(log_pi, log_ref, mask, "k4", "token-mean")


def test_the_kl_in_the_reward_is_the_hand_computed_sum_per_response():
    log_pi, log_ref, mask = tensors()
    got = kl_reward_penalty(log_pi, log_ref, mask, "low_var_kl")
    want = [sum(k3(p, r) for p, r, m in zip(rp, rr, rm) if m) for rp, rr, rm in zip(LOG_PI, LOG_REF, MASK)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    # verl's clamps: Δ beyond ±20 is clamped before the exp, the estimate beyond 10
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() == 10.0


def rollout(rewards, lengths, truncated, groups, t=4) -> Rollout:
    b = len(rewards)
    mask = torch.tensor([[i < n for i in range(t)] for n in lengths])
    return Rollout(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.bool),
                   response_ids=torch.ones(b, t, dtype=torch.long), response_mask=mask,
                   rollout_log_prob=torch.zeros(b, t), version=torch.zeros(b, t, dtype=torch.long),
                   group_ids=torch.tensor(groups), meta=[{"truncated": c} for c in truncated],
                   rewards=torch.tensor(rewards, dtype=torch.float32))


def step_config(**changes) -> StepConfig:
    base = StepConfig(loss=LossConfig(name="ppo_clip"), correction=CorrectionConfig(), advantage="grpo", norm_std=True,
                      dynamic_sampling=False, baseline_excludes_rejected=True, oapl_beta1=1.0, temperature=1.0,
                      max_new_tokens=4)
    return replace(base, **changes)


def test_response_metrics_as_trl_names_them():
    r = rollout([1.0, 0.0, 1.0, 1.0], [4, 2, 4, 3], [True, False, True, False], [0, 0, 1, 1])
    m = reward_metrics(r)
    assert m["response/clipped_ratio"] == 0.5
    assert m["response/terminated_length_mean"] == 2.5  # the two that ended: 2 and 3 tokens
    assert m["reward/zero_std_group_fraction"] == 0.5  # group 1's rewards are all 1
    none_ended = reward_metrics(rollout([1.0, 0.0], [4, 4], [True, True], [0, 0]))
    assert math.isnan(none_ended["response/terminated_length_mean"])
    assert truncated_rows(replace(r, meta=[])).tolist() == [False] * 4  # rows without the flag: not cut


class _NoStrategy:
    """A π_old strategy that watches nothing (correct_and_advantage tells it the keep share)."""

    def after_correction(self, rollout, version):
        pass


def test_mask_truncated_takes_the_cut_responses_out_of_the_loss_and_leaves_them_in_the_baselines():
    """rollout.mask_truncated (TRL's mask_truncated_completions): a response cut at the token cap keeps none of
    its tokens in the loss; its reward still counts in its group's mean and std, so every other row's advantage
    and kept tokens are what they are without the mask."""
    r = rollout([1.0, 0.0, 1.0, 0.0], [4, 2, 4, 3], [True, False, False, True], [0, 0, 1, 1])
    r = replace(r, old_log_prob=r.rollout_log_prob.clone())  # π_old = μ: every weight 1, every token kept
    plain, _ = correct_and_advantage(r, step_config(), None, _NoStrategy(), 0)
    masked, _ = correct_and_advantage(r, step_config(mask_truncated=True), None, _NoStrategy(), 0)
    cut = torch.tensor([True, False, False, True])
    assert torch.equal(plain.kept_mask, r.response_mask)  # nothing rejected without the mask
    assert not masked.kept_mask[cut].any()
    assert torch.equal(masked.kept_mask[~cut], plain.kept_mask[~cut])
    assert torch.equal(masked.advantages, plain.advantages)  # the cut rows stayed in the baselines
    # each group holds rewards 1 and 0: with the cut rows out of the baselines the others' advantage would be 0
    assert (plain.advantages[~cut][plain.kept_mask[~cut]] != 0).all()


def test_dapo_overlong_punishment_and_the_kl_reward_by_hand():
    r = rollout([1.0, 1.0, 0.0], [4, 3, 1], [True, False, False], [0, 0, 0])
    shaped, m = shaped_rewards(r, step_config(overlong_buffer=2, overlong_penalty=0.5))
    # L = 4, buffer 2: lengths 4, 3, 1 exceed L − 2 = 2 by 2, 1, −1 → −2/2·0.5, −1/2·0.5, 0
    assert shaped.rewards.tolist() == pytest.approx([0.5, 0.75, 0.0])
    assert m["reward/overlong_penalty_mean"] == pytest.approx((0.5 + 0.25) / 3)
    assert shaped_rewards(r, step_config())[0] is r  # nothing to shape: the task's rewards
    old = torch.tensor([[-0.5, -1.0, -2.0, -1.0]] * 3)
    ref = torch.tensor([[-0.7, -1.0, -1.5, -1.0]] * 3)
    r = replace(r, old_log_prob=old, ref_log_prob=ref)
    shaped, m = shaped_rewards(r, step_config(kl_coef=0.1, kl_where="reward"))
    sums = [sum(k3(p, q) for p, q in zip([-0.5, -1.0, -2.0, -1.0][:n], [-0.7, -1.0, -1.5, -1.0][:n])) for n in (4, 3, 1)]
    assert shaped.rewards.tolist() == pytest.approx([1 - 0.1 * sums[0], 1 - 0.1 * sums[1], 0 - 0.1 * sums[2]], rel=1e-6)
    assert shaped_rewards(r, step_config(kl_coef=0.1, kl_where="loss"))[0] is r  # in the loss: rewards untouched


def test_the_kl_term_joins_the_loss_with_its_coefficient():
    log_pi, log_ref, mask = (x.float() if x.is_floating_point() else x for x in tensors())
    part = rollout([1.0, 0.0], [3, 2], [False, False], [0, 0], t=3)
    part = replace(part, old_log_prob=log_pi, ref_log_prob=log_ref, kept_mask=mask,
                   advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]))
    config = step_config(kl_coef=0.25)
    plain, _ = policy_loss(config.loss, log_pi, log_pi, part.advantages, mask, denominator_mask=mask)
    total, metrics = _loss(config, part, log_pi, None)
    by_hand = sum(k3(p, r) for rp, rr, rm in zip(LOG_PI, LOG_REF, MASK) for p, r, m in zip(rp, rr, rm) if m) / 5
    assert total.item() == pytest.approx(plain.item() + 0.25 * by_hand, rel=1e-6)
    assert metrics["actor/kl_loss"].item() == pytest.approx(by_hand, rel=1e-6)
    assert _loss(step_config(), part, log_pi, None)[0].item() == pytest.approx(plain.item())


@pytest.mark.usefixtures("alternating_rewards")
@pytest.mark.parametrize("lora", [False, True])
def test_a_run_with_a_kl_term_starts_at_zero_kl_and_moves(tmp_path, addition_model_dir, capsys, lora):
    """Step 1 scores π_old with the starting weights, which are the reference: KL 0 exactly; then it grows. The
    reference costs a copy of the weights, or none with LoRA (the base, adapters off); the run says which."""
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    extra = ["model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"] if lora else []
    config = load_config(None, ["task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=4",
                                "rollout.max_new_tokens=4", "task.eval_prompts=0", "trainer.progress=false",
                                "trainer.plot=false", "trainer.tensorboard=false", "trainer.steps=3", "optim.lr=1e-2",
                                f"model.path={addition_model_dir}", f"trainer.out={tmp_path / 'run'}",
                                "algorithm.kl.coef=0.05", "rollout.mask_truncated=true", *extra])
    run(config)
    said = capsys.readouterr().out
    assert ("adapters off: no extra weights" in said) == lora and ("a frozen copy of the starting weights" in said) != lora
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kl/reference" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and steps[0]["kl/reference"] == 0.0
    assert steps[-1]["kl/reference"] > 0 and all("actor/kl_loss" in r and "response/clipped_ratio" in r for r in steps)


def test_the_reference_says_its_memory_cost_the_bytes_of_the_weights_it_copies(addition_model_dir):
    """algorithm.kl's memory cost as the run states it: a full learner's reference is a copy of every parameter and
    persistent buffer (tied weights once), in storage of its own, and the start line gives those bytes; a LoRA
    learner's holds nothing (its base, adapters off)."""
    from rollcorr.engines import make_learner
    from rollcorr.train.reference import FrozenReference

    learner = make_learner("hf:fp32", addition_model_dir)
    model = learner.model
    state = model.state_dict()
    by_hand = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters(): tied ones once
    by_hand += sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name in state)
    ref = FrozenReference(learner)
    assert ref.bytes == by_hand > 0
    ours = {t.untyped_storage().data_ptr() for t in state.values()}
    assert not ours & {t.untyped_storage().data_ptr() for t in ref.weights.values()}  # a copy, not the model's
    assert f"a frozen copy of the starting weights, {by_hand / 1e9:.2f} GB beside the model" in ref.describe(
        0.1, "k3", "loss")
    lora = make_learner("hf:fp32", addition_model_dir,
                        lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    held = FrozenReference(lora)
    assert held.weights is None and held.bytes == 0
    assert "the base model with the LoRA adapters off: no extra weights" in held.describe(0.1, "k3", "reward")
