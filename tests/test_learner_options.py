"""The learner options a real model needs: gradient checkpointing (same gradients, far fewer saved
activations) and model.device (checked against the machine before anything loads)."""

import pytest
import torch

from rollcorr.engines import SamplingParams, make_learner, make_sampler


def _saved_elements_and_grads(learner, rollout):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        log_prob = learner.log_prob(rollout, grad=True)
    log_prob.sum().backward()
    return sum(saved), [p.grad.clone() for p in learner.parameters()]


def test_gradient_checkpointing_gives_the_same_gradients_from_far_fewer_saved_activations():
    rollout = make_sampler("hf:fp32").generate(["12+34=", "5+6=", "70+8="], SamplingParams(max_new_tokens=5, seed=1),
                                               n=3)
    plain = make_learner("hf:fp32")
    plain.share_prompts = False  # the same forward path, with and without checkpoints
    kept, grads = _saved_elements_and_grads(plain, rollout)
    ckpt_kept, ckpt_grads = _saved_elements_and_grads(make_learner("hf:fp32", gradient_checkpointing=True), rollout)
    # the recomputation is the same arithmetic on the same inputs: the same gradients, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(grads, ckpt_grads))
    assert ckpt_kept < 0.2 * kept  # the layers' inner activations are no longer kept
    # without gradients nothing changes (the shared-prompt path still serves scoring)
    learner = make_learner("hf:fp32", gradient_checkpointing=True)
    with torch.no_grad():
        assert torch.equal(learner.log_prob(rollout), make_learner("hf:fp32").log_prob(rollout))


def test_a_train_run_with_gradient_checkpointing(tmp_path):
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    result = run(load_config(None, ["model.gradient_checkpointing=true", "trainer.steps=2", "task.eval_prompts=0",
                                    "rollout.prompts_per_step=4", "trainer.progress=false", "trainer.plot=false",
                                    "trainer.tensorboard=false", f"trainer.out={tmp_path / 'run'}"]))
    assert result.steps == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_model_device_is_checked_before_anything_loads(tmp_path):
    from rollcorr.train.build import check_components
    from rollcorr.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.device: 'cuda:1' asked for, but this machine has no CUDA device"):
        check_components(load_config(None, ["model.device=cuda:1"]))
    check_components(load_config(None, ["model.device=cpu"]))
    with pytest.raises(ConfigError, match="model.device: expected cpu, cuda or cuda:<index>"):
        load_config(None, ["model.device=gpu0"])
