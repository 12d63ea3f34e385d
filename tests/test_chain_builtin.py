"""The long-response built-in: ``builtin:<name>`` spellings, its checkpoint, the ``chain`` config
preset, and a two-step ``rollcorr train`` on it (the task's reward is tested in test_tasks.py)."""

from __future__ import annotations

import json

import pytest
import torch

from rollcorr.models.builtin import BUILTIN_DIR, BUILTIN_MODELS, builtin_path, is_builtin, load_builtin
from rollcorr.tasks import ChainTask, make_task
from rollcorr.train.config import ConfigError, load_config, preset_overrides

LONG = "builtin:chain"
LONG_DIR = BUILTIN_MODELS[LONG].directory
needs_checkpoint = pytest.mark.skipif(
    not (LONG_DIR / "model.safetensors").exists(), reason="no builtin:chain checkpoint"
)


def test_builtin_spellings_resolve_to_their_directories():
    assert builtin_path("builtin") == BUILTIN_DIR and builtin_path(None) == BUILTIN_DIR
    assert builtin_path(LONG) == LONG_DIR != BUILTIN_DIR
    assert builtin_path("some/dir") == "some/dir"  # any other path is left alone
    assert is_builtin("builtin") and is_builtin(LONG) and is_builtin(None) and not is_builtin("some/dir")
    with pytest.raises(ValueError, match="unknown built-in model 'builtin:nope'"):
        builtin_path("builtin:nope")
    from rollcorr.engines import make_learner, make_sampler

    with pytest.raises(ValueError, match="builtin:nope"):
        make_sampler("hf:fp32", "builtin:nope")
    with pytest.raises(ValueError, match="builtin:nope"):
        make_learner("hf", "builtin:nope")
    for spelling, model in BUILTIN_MODELS.items():  # every built-in names a task make_task knows
        assert make_task(model.task).name.startswith(model.task), spelling


@needs_checkpoint
def test_long_checkpoint_is_small_qwen2_fitting_its_task():
    size = sum(f.stat().st_size for f in LONG_DIR.iterdir())
    assert size < 8e6
    model, tok = load_builtin(name=LONG)
    config = json.loads((LONG_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert sum(p.numel() for p in model.parameters()) < 5e6
    task = make_task(BUILTIN_MODELS[LONG].task)
    item = task.sample(1, seed=0, split="test")[0]
    assert len(item["prompt"]) + task.max_answer_tokens + 1 <= config["max_position_embeddings"]
    assert tok(item["prompt"], add_special_tokens=False)["input_ids"][0] == 4 + int(item["prompt"][0])
    assert config["max_position_embeddings"] >= 128


@needs_checkpoint
def test_long_checkpoint_starts_low_but_writes_the_format():
    """Greedy score (share of the 14 numbers right) on held-out problems is at most 0.5 (RL has room), but the
    model has learned the format (most responses: 14 numbers of 4 digits, each followed by a comma) and the
    last digit's cycle; what it gets wrong is the carry into the tens digit, which derails the rest."""
    import re

    model, tok = load_builtin(name=LONG)
    task = ChainTask()
    items = task.sample(32, seed=2024, split="test")
    ids = torch.tensor([tok(i["prompt"], add_special_tokens=False)["input_ids"] for i in items])
    from transformers import DynamicCache

    out, cache = [], DynamicCache(config=model.config)
    with torch.no_grad():
        for _ in range(task.max_answer_tokens):
            ids = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids)
    rows = torch.cat(out, 1).tolist()
    texts = [tok.decode(r, skip_special_tokens=False).split("<eos>")[0] for r in rows]
    score = sum(task.reward(i, t) for i, t in zip(items, texts)) / len(items)
    assert 0.05 <= score <= 0.5, score
    assert sum(bool(re.fullmatch(r"(\d{4},){14}", t)) for t in texts) / len(texts) > 0.6
    pairs = [(g[0], w[0]) for i, t in zip(items, texts) for g, w in zip(t.split(","), i["answer"].split(",")) if g]
    assert sum(g == w for g, w in pairs) / len(pairs) > 0.8  # the last digit (written first) is mostly right


def test_chain_preset_is_the_default_config_plus_its_own_keys():
    config = load_config("chain")
    default = load_config(None)
    assert config.model.path == LONG and config.task.name == "chain"
    task = make_task(config.task.name)
    assert config.rollout.max_new_tokens == task.max_answer_tokens  # the answer exactly; <eos> optional
    assert config.algorithm == default.algorithm and config.model.learner == default.model.learner
    assert "task.name=chain" in preset_overrides("chain")
    # overrides on the command line win over the preset
    assert load_config("chain", ["rollout.group_size=2"]).rollout.group_size == 2
    with pytest.raises(ConfigError, match="'nope' does not exist"):
        load_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        preset_overrides("default")


@needs_checkpoint
def test_rollcorr_train_two_steps_on_the_long_task(tmp_path, capsys):
    """``rollcorr train task.name=chain model.path=builtin:chain`` with tiny settings runs
    two steps, scores long responses and logs the study's mismatch metrics."""
    from rollcorr.cli import main

    out = tmp_path / "run"
    code = main(["train", "task.name=chain", f"model.path={LONG}", "rollout.max_new_tokens=70",
                 "trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "task.eval_prompts=4",
                 "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
                 "trainer.checkpoint_every=0", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["response/length_mean"] > 10  # long responses, not the 6-token default
        assert 0.0 <= r["reward/mean"] <= 1.0
        for key in ("rollout_corr/k3_kl", "rollout_corr/chi2_seq", "rollout_corr/rollout_is_eff_sample_size",
                    "rollout_corr/prob_diff_seq_max_mean"):
            assert key in r and r[key] == r[key], key
    assert any("eval/accuracy" in r for r in records)
