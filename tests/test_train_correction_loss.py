"""The trainer acts on the correction's loss_type and batch_norm_scope, and each algorithm keeps its own
aggregation (three bugs: a bypass REINFORCE preset under a PPO ratio counted π_θ/μ twice; batch_norm_scope was
accepted and ignored; every algorithm inherited default.yaml's token-mean)."""

from __future__ import annotations

import pytest
import torch

from rollcorr.config.presets import preset
from rollcorr.rollout import Rollout
from rollcorr.train.build import check_components
from rollcorr.train.config import ALGORITHMS, ConfigError, load_config
from rollcorr.train.step import renormalize


def algo_of(*overrides):
    return check_components(load_config(None, list(overrides)))[0]


BYPASS = "algorithm.proximal.name=bypass"


@pytest.mark.parametrize("name", ["bypass_pg_is", "bypass_pg_token_icepop", "bypass_pg_geo_rs_token_tis"])
def test_reinforce_bypass_preset_sets_the_reinforce_loss(name):
    algo = algo_of(f"algorithm.correction.preset={name}", BYPASS)
    assert algo.correction.loss_type == "reinforce"
    assert algo.loss.name == "reinforce"  # w = min(π_θ/μ, C) is the whole ratio: no PPO ratio on top


def test_reinforce_bypass_preset_refuses_a_ratio_loss():
    with pytest.raises(ConfigError, match=r"^algorithm.loss: 'ppo_clip' .* count twice"):
        algo_of("algorithm.correction.preset=bypass_pg_is", BYPASS, "algorithm.loss=ppo_clip")
    with pytest.raises(ConfigError, match=r"^algorithm.loss: 'cispo'"):
        algo_of("algorithm.correction.preset=bypass_pg_is", BYPASS, "algorithm.loss=cispo")
    assert algo_of("algorithm.correction.preset=bypass_pg_is", BYPASS, "algorithm.loss=gpg").loss.name == "gpg"


def test_ppo_clip_bypass_preset_refuses_a_loss_without_ratio():
    assert algo_of("algorithm.correction.preset=bypass_ppo_clip", BYPASS).loss.name == "ppo_clip"
    with pytest.raises(ConfigError, match=r"^algorithm.loss: 'reinforce' has no ratio"):
        algo_of("algorithm.correction.preset=bypass_ppo_clip", BYPASS, "algorithm.loss=reinforce")


def test_reinforce_loss_type_outside_bypass_is_refused():
    with pytest.raises(ConfigError, match=r"^algorithm.correction.loss_type: 'reinforce' applies in bypass"):
        algo_of("algorithm.correction.preset=tis", "algorithm.correction.loss_type=reinforce")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_algorithm_keeps_its_own_aggregation(name):
    overrides = [f"algorithm.name={name}"]
    if name == "oapl":
        overrides += ["algorithm.correction.preset=disabled"]
    assert algo_of(*overrides).loss.agg_mode == ALGORITHMS[name]["aggregation"]


def test_gspo_aggregates_per_sequence_and_the_default_run_stays_token_mean():
    assert algo_of("algorithm.name=gspo").loss.agg_mode == "seq-mean-token-mean"
    assert algo_of().loss.agg_mode == "token-mean"
    assert algo_of("algorithm.aggregation=seq-mean-token-sum").loss.agg_mode == "seq-mean-token-sum"


def _rollout(weights: torch.Tensor, mask: torch.Tensor) -> Rollout:
    b, t = weights.shape
    return Rollout(
        prompt_ids=torch.zeros(b, 1, dtype=torch.long),
        prompt_mask=torch.ones(b, 1, dtype=torch.bool),
        response_ids=torch.zeros(b, t, dtype=torch.long),
        response_mask=mask,
        rollout_log_prob=None,
        version=torch.zeros(b, t, dtype=torch.long),
        group_ids=torch.arange(b),
        is_weights=weights,
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_renormalize_divides_by_the_parts_own_mean(level):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    if level == "token":
        w = torch.tensor([[0.5, 1.5, 0.0], [2.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
    else:  # one weight per row, broadcast over its valid tokens
        w = torch.tensor([0.5, 2.0, 3.5])[:, None] * mask
    scoped = {"is_level": level, "batch_normalize": True}
    for scope in ("mini_batch", "micro_batch"):
        algo = algo_of("algorithm.correction.preset=tis", *(f"algorithm.correction.{k}={v}" for k, v in scoped.items()),
                       f"algorithm.correction.batch_norm_scope={scope}")
        part = renormalize(_rollout(w, mask), algo, scope)
        out = part.is_weights
        if level == "token":
            assert float(out[mask].mean()) == pytest.approx(1.0)
        else:
            assert float((out.sum(-1) / mask.sum(-1)).mean()) == pytest.approx(1.0)
        other = "micro_batch" if scope == "mini_batch" else "mini_batch"
        assert renormalize(_rollout(w, mask), algo, other).is_weights is w  # the other scope: untouched
    batch = algo_of("algorithm.correction.preset=tis", "algorithm.correction.batch_normalize=true")
    assert batch.correction.batch_norm_scope == "batch"
    assert renormalize(_rollout(w, mask), batch, "mini_batch").is_weights is w  # compute_correction did it


def test_bypass_presets_normalise_per_micro_batch_like_verl():
    assert preset("bypass_pg_is").batch_norm_scope == "micro_batch"



def test_opsm_takes_one_advantages_pass_and_reads_what_the_loss_uses(monkeypatch, tmp_path, addition_model_dir):
    """OPSM needs advantages before the correction: one pass per step computes them (every valid sequence in
    the baselines), OPSM reads them, and the loss gets the same tensor."""
    from rollcorr import correction
    from rollcorr.train import step
    from rollcorr.train.loop import run

    passes, read = [], []
    real_adv, real_corr, real_optimize = step.attach_advantages, correction.compute_correction, step.optimize

    def counting_advantages(rollout, config):
        out = real_adv(rollout, config)
        passes.append(out[0].advantages)
        return out

    def spying_correction(*args, **kwargs):
        read.append(kwargs["advantages"])
        return real_corr(*args, **kwargs)

    def spying_optimize(rollout, *args, **kwargs):
        read.append(rollout.advantages)
        return real_optimize(rollout, *args, **kwargs)

    monkeypatch.setattr(step, "attach_advantages", counting_advantages)
    monkeypatch.setattr(correction, "compute_correction", spying_correction)
    monkeypatch.setattr(step, "optimize", spying_optimize)
    config = load_config(None, [
        "algorithm.correction.preset=opsm", f"model.path={addition_model_dir}", "task.name=addition:1",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4", "task.eval_prompts=0",
        "trainer.steps=2", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.checkpoint_every=0", f"trainer.out={tmp_path / 'run'}"])
    assert run(config).steps == 2
    assert len(passes) == 2  # one advantages pass per step
    for k in range(2):  # OPSM and the loss read the tensor that pass made
        assert read[2 * k] is passes[k] and read[2 * k + 1] is passes[k]
