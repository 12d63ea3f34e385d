"""LoRA learners (rollcorr.engines.lora, model.lora): adapters train on a frozen base, the sampler and greedy
evaluation get the merged weights, checkpoints hold the adapters (model/: PEFT's files) and resume."""

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")

from rollcorr.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from rollcorr.engines import make_learner  # noqa: E402
from rollcorr.engines.lora import adapter_state_dict, lora_layers, merged_state_dict  # noqa: E402
from rollcorr.train.config import ConfigError, load_config  # noqa: E402
from rollcorr.train.loop import Trainer, run  # noqa: E402

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
TINY = ["task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=8", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.mini_batches=1", "optim.lr=1e-2", "model.lora.r=4", "model.lora.alpha=8.0",
        "model.lora.target_modules=[q_proj, v_proj]", "model.sampler=hf:fp32"]


def test_merged_weights_are_base_plus_scaled_low_rank_product_and_score_like_the_adapted_model():
    learner = make_learner("hf:fp32", lora=LORA)
    base = make_learner("hf:fp32").state_dict()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    merged = learner.state_dict()
    assert set(merged) == set(base)  # the plain model's names, no adapter keys
    layer = learner.model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    want = base["model.layers.0.self_attn.q_proj.weight"].double() + (8.0 / 4) * b @ a
    got = merged["model.layers.0.self_attn.q_proj.weight"].double()
    eps = torch.finfo(torch.float32).eps
    assert (got - want).abs().max() <= 4 * eps * want.abs().max()  # one float32 add of a float32 product
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
    # a plain model loaded with the merged weights scores what the adapted model scores
    plain = make_learner("hf:fp32")
    plain.model.load_state_dict(merged)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        lp_lora = learner.model(ids).logits.double()
        lp_plain = plain.model(ids).logits.double()
    assert (lp_lora - lp_plain).abs().max() <= 1e-4 * lp_plain.abs().max()  # float32, two summation orders


def test_lora_trains_the_adapters_only_and_the_sampler_sees_the_update(tmp_path):
    config = load_config(None, [*TINY, f"trainer.out={tmp_path / 'run'}", "trainer.steps=3"])
    trainer = Trainer(config)
    base = {k: v.clone() for k, v in make_learner("hf:fp32").state_dict().items()}
    trainer.run()
    model = trainer.learner.model
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n in dict(model.named_parameters()) if ".lora_" in n}
    for name, layer in lora_layers(model).items():  # the base never moved; the adapters did
        assert torch.equal(layer.base_layer.weight, base[f"{name}.weight"])
    assert any(layer.lora_B["default"].weight.abs().max() > 0 for layer in lora_layers(model).values())
    merged = trainer.learner.state_dict()
    sampler = trainer.executor.source.sampler.model.state_dict()
    assert all(torch.equal(sampler[k], merged[k]) for k in merged)  # the sampler holds the merged update
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    # the checkpoint: adapters in the training state, and in model/ as PEFT saves them (PeftModel loads them)
    ckpt = latest_checkpoint(tmp_path / "run")
    state = load_checkpoint(ckpt)
    assert set(state["model"]) == set(adapter_state_dict(model))
    from peft import PeftModel

    from rollcorr.models.builtin import load_model

    exported = PeftModel.from_pretrained(load_model("builtin")[0], ckpt / "model").merge_and_unload().state_dict()
    assert exported.keys() == merged.keys() and all(torch.equal(exported[k], merged[k]) for k in merged)


def test_a_lora_run_resumes_from_its_adapters(tmp_path):
    out = tmp_path / "run"
    run(load_config(None, [*TINY, f"trainer.out={out}", "trainer.steps=2", "trainer.checkpoint_every=1"]))
    first = merged_state_dict_of(out)
    resumed = run(load_config(None, [*TINY, f"trainer.out={out}", "trainer.steps=3"]), resume=out)
    assert resumed.steps == 3
    after = merged_state_dict_of(out)
    assert not torch.equal(first["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"])


def merged_state_dict_of(run_dir):
    from transformers import AutoModelForCausalLM

    from rollcorr.engines.lora import merge_adapters

    folder = merge_adapters("builtin", latest_checkpoint(run_dir) / "model", run_dir / "merged")
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="model.lora: LoRA trains in one process"):
        load_config(None, ["model.lora.r=4", "trainer.ranks=2", "rollout.prompts_per_step=16"])
    with pytest.raises(ValueError, match=r"target_modules: \['qkv'\] match no linear layer"):
        make_learner("hf:fp32", lora={**LORA, "target_modules": ["qkv"]})
    assert merged_state_dict(make_learner("hf:fp32").model).keys() == make_learner("hf:fp32").model.state_dict().keys()
