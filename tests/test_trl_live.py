"""rollcorr inside TRL's GRPOTrainer (the `.[trl]` extra, TRL 1.16), on CPU with the built-in model.

TRL runs GRPOTrainer without vLLM; rollcorr's ``SamplerRollout`` hands it sampling log-probs from a rollcorr
sampler through TRL's ``rollout_func`` hook (by default the built-in model in bfloat16, weights synced from
the trainer's float32 model every optimiser step), which is what vLLM's ``sampling_per_token_logps`` are on a
GPU. Skipped when TRL is not installed.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import EPS32, forward_rounding

pytest.importorskip("trl", reason="trl not installed (pip install the .[trl] extra)")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rollcorr.compat.trl import RollcorrGRPOTrainer, SamplerRollout, correct_trl_batch  # noqa: E402
from rollcorr.config import from_trl  # noqa: E402
from rollcorr.dumps import read_dump  # noqa: E402
from rollcorr.models.builtin import load_builtin  # noqa: E402

PROMPTS = ["12+7=", "30+4=", "6+21=", "18+8="]  # one length: the sampler needs no padding


def test_installed_version():
    import trl

    assert trl.__version__.startswith("1.16.")


def alternating_reward(completions, **kwargs):
    """1, 0, 1, 0 … within every group: advantages are non-zero by construction, whatever is sampled."""
    return [float(i % 2) for i in range(len(completions))]


def make_trainer(tmp_path, cls=RollcorrGRPOTrainer, steps=3, rollout_func=None, config=None, **kwargs):
    model, tokenizer = load_builtin()
    args = GRPOConfig(**(config or {}),
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        beta=0.0,
        seed=0,
    )
    data = Dataset.from_dict({"prompt": PROMPTS * 4})
    return cls(
        model=model,
        reward_funcs=alternating_reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        rollout_func=rollout_func or SamplerRollout("hf:bf16"),
        **kwargs,
    )


def prob_diff_max(dump) -> float:
    """max |μ(y_t) − π_old(y_t)| over the dump's valid tokens."""
    diff = dump.rollout_log_prob.exp() - dump.learner_log_prob.exp()
    return float(diff[dump.response_mask].abs().max())


def test_grpo_trainer_trains_with_rollcorr_correction(tmp_path):
    # token TIS: suits bf16-level mismatch (Geo-RS's [0.999, 1.001] band rejects every sequence here)
    trainer = make_trainer(tmp_path, correction="decoupled_token_is", dump_path=tmp_path / "dump.jsonl")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:  # rollcorr's metrics reach TRL's logger
        assert entry["rollout_corr/all_rejected"] == 0.0
        assert math.isfinite(entry["rollout_corr/kl"]) and math.isfinite(entry["loss"])
        assert entry["rollout_corr/rollout_is_mean"] > 0
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the weights moved
    dump = read_dump(tmp_path / "dump.jsonl", extra_fields=("step", "batch"))
    assert len(dump) == 3 * 4 and dump.fields["rollout"] == "rollout_log_probs"
    # bf16 sampler vs fp32 learner (the trainer turns GRPOConfig's bf16 default off): bf16 rounding shows
    diff = (dump.rollout_log_prob - dump.learner_log_prob)[dump.response_mask]
    assert prob_diff_max(dump) > 1e-3 and diff.abs().mean() < 0.5
    # the dump says which correction made it and what its tokens are
    assert dump.correction == {"is_level": "token"}
    assert dump.token_text is not None and dump.text[0] == "".join(dump.token_text[0])


def test_learner_runs_at_the_precision_asked_for(tmp_path, capsys):
    """fp32 sampler + fp32 learner agree to float noise; GRPOConfig's bf16 default would put a bf16 gap
    into π_old (prob_diff_max ~1e-2), so the trainer runs fp32 unless told otherwise, and says so."""
    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True).bf16  # TRL's default, which the trainer overrides
    fp32 = make_trainer(tmp_path / "a", steps=1, rollout_func=SamplerRollout("hf:fp32"), dump_path=tmp_path / "a.jsonl")
    assert "learner in fp32" in capsys.readouterr().out
    assert not fp32.args.bf16 and fp32.accelerator.mixed_precision == "no"
    fp32.train()
    # two fp32 forwards of the same weights (the hf sampler's decode, TRL's scoring): |Δp| ≤ 2 forward_rounding
    assert prob_diff_max(read_dump(tmp_path / "a.jsonl")) <= 2 * forward_rounding(fp32.model.config)
    bf16 = make_trainer(tmp_path / "b", steps=1, rollout_func=SamplerRollout("hf:fp32"), dump_path=tmp_path / "b.jsonl",
                        learner_precision="bf16")
    assert "learner in bf16" in capsys.readouterr().out
    bf16.train()
    assert prob_diff_max(read_dump(tmp_path / "b.jsonl")) > 1e-3


def test_the_keep_mask_reaches_trls_policy_forwards(tmp_path):
    """top-k = 4 with an fp32 sampler and learner: with the kept sets replayed, TRL's π_old and the loss's π_θ are
    the sampler's distribution up to float32 noise; without them every token's |Δ log p| is the kept mass's log."""

    def run(keep_mask: bool, name: str):
        rollout = SamplerRollout("hf:fp32", top_k=4, keep_mask=keep_mask)
        trainer = make_trainer(tmp_path / name, steps=1, rollout_func=rollout, dump_path=tmp_path / f"{name}.jsonl")
        batch = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(4)])
        return trainer, batch, read_dump(tmp_path / f"{name}.jsonl")

    trainer, batch, dump = run(True, "kept")
    assert batch["kept_ids"].shape[:2] == batch["completion_ids"].shape and batch["kept_ids"].shape[2] == 4
    log_ratio = (dump.learner_log_prob - dump.rollout_log_prob)[dump.response_mask]
    # two fp32 forwards of the same weights: |Δp| ≤ 2 forward_rounding (as without truncation), in log space
    # for probabilities ≥ 1/4 of a 4-token set: |Δ log p| ≤ 4 · that
    assert float(log_ratio.abs().max()) <= 8 * forward_rounding(trainer.model.config)
    # the loss's forward of π_θ (no step taken yet: the same weights) over the same sets
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].shape[1])
    assert trainer._kept is None  # outside a batch or a loss: full-vocabulary scoring
    trainer._kept = batch["kept_ids"]
    kept, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].shape[1])
    trainer._kept = None
    valid = batch["completion_mask"].bool()
    torch.testing.assert_close(kept[valid], batch["old_per_token_logps"][valid], atol=0, rtol=0)
    assert (kept[valid] >= logps[valid]).all()  # renormalised over a subset: never less likely
    _, _, full = run(False, "full")
    assert float((full.learner_log_prob - full.rollout_log_prob)[full.response_mask].abs().max()) > 1e-2


def test_sampler_rollout_feeds_trl_and_syncs_weights(tmp_path):
    """SamplerRollout: one completion per prompt TRL hands it, log μ per token, weights reloaded per step."""
    rollout = SamplerRollout("hf:bf16", seed=1)
    trainer = make_trainer(tmp_path, steps=2, rollout_func=rollout, dump_path=tmp_path / "d.jsonl")
    out = rollout([p for p in PROMPTS for _ in range(4)], trainer)
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == 16
    assert all(len(c) == len(lp) >= 1 for c, lp in zip(out["completion_ids"], out["logprobs"]))
    assert all(x <= 0 for lp in out["logprobs"] for x in lp)
    trainer.train()
    assert rollout.loaded_step == 1  # synced again after the first optimiser step
    rollout(PROMPTS, trainer)  # after the second step: synced again, to the weights the trainer holds now
    assert rollout.loaded_step == 2
    sampler_w = rollout.sampler.model.state_dict()
    learner_w = trainer.model.state_dict()
    name = next(k for k in learner_w if k.endswith("q_proj.weight"))
    torch.testing.assert_close(sampler_w[name].float(), learner_w[name].to(torch.bfloat16).float())


def test_bad_sampler_spec_fails_before_trl_starts():
    with pytest.raises(ValueError, match="unknown engine backend"):
        SamplerRollout("sglang:bf16")


def test_trl_colocated_vllm_on_cpu_is_refused_with_a_pointer(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("TRL's colocated vLLM works on a GPU")
    config = {"use_vllm": True, "vllm_mode": "colocate"}
    with pytest.raises(ValueError, match="SamplerRollout"):
        make_trainer(tmp_path, steps=1, config=config)


def test_correction_weights_reach_the_loss(tmp_path):
    """The same batch, once with rollcorr's weights and once with all weights 0: the loss differs."""
    trainer = make_trainer(tmp_path, correction="decoupled_token_is", steps=1)
    batch = trainer._generate_and_score_completions(
        [{"prompt": p} for p in PROMPTS * 1 for _ in range(4)][:16]
    )
    assert batch["importance_sampling_ratio"].shape == batch["completion_ids"].shape
    loss = trainer._compute_loss(trainer.model, batch)
    zero = dict(batch, importance_sampling_ratio=torch.zeros_like(batch["importance_sampling_ratio"]))
    assert trainer._compute_loss(trainer.model, zero).item() == 0.0 != loss.item()
    assert not trainer.use_vllm  # the vLLM path was opened for the loss only


def _trl_own_ratio(tmp_path, mode: str, clip_min, clip_max):
    """TRL's own vllm_importance_sampling_* code on a batch: a plain GRPOTrainer told it used vLLM."""
    trainer = make_trainer(
        tmp_path, cls=GRPOTrainer, steps=1,
    )
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer._last_loaded_step = trainer.state.global_step  # no vLLM weight sync
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = clip_min, clip_max
    out = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(4)])
    return out


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 1.001), (0.999, 1.001), (0.5, 3.0)])
def test_rollcorr_reproduces_trl_vllm_importance_sampling(tmp_path, mode, clip_min, clip_max):
    out = _trl_own_ratio(tmp_path, mode, clip_min, clip_max)
    mask = out["completion_mask"].bool()
    config = from_trl(
        {
            "vllm_importance_sampling_mode": mode,
            "vllm_importance_sampling_clip_min": clip_min,
            "vllm_importance_sampling_clip_max": clip_max,
        }
    )
    weights, kept, _ = correct_trl_batch(
        out["old_per_token_logps"], out["sampling_per_token_logps"], out["completion_mask"], config
    )
    assert torch.equal(kept, out["completion_mask"])  # TRL's denominator: zeroed tokens stay in the mask
    trl_ratio = out["importance_sampling_ratio"].expand_as(weights)
    # both exp(Σ_t d_t) (one token for the token modes) of the same float32 d = log π_old − log μ, summed in
    # another order: relative rounding ≤ T ε₃₂ Σ_t |d_t| (Higham's γ_T) plus each side's exp and clip (2 ε₃₂ each)
    d = (out["old_per_token_logps"] - out["sampling_per_token_logps"]).abs() * mask
    length = mask.shape[-1] if mode.startswith("sequence") else 1
    sums = d.sum(-1, keepdim=True) if mode.startswith("sequence") else d
    rtol = (length * sums + 4).expand_as(weights)[mask] * EPS32
    assert ((weights[mask] - trl_ratio[mask]).abs() <= rtol * trl_ratio[mask].abs()).all()
    # the band is tight enough to bite on a bf16 batch for at least one setting of each mode
    if clip_max == 1.001 and "token" in mode:
        assert ((trl_ratio[mask] - 1).abs() > 1e-3).any()


# ---- docs/trl.md: every snippet runs --------------------------------------------------------------------
def test_docs_trl_snippets_run(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "trl.md").read_text()
    train, mapping = re.findall(r"```python\n(.*?)```", doc, re.S)
    setup, analyze = re.findall(r"```bash\n(.*?)```", doc, re.S)
    assert setup.strip() == "ROLLCORR_OPTIONAL=trl bash scripts/setup.sh"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'trl = ["trl==1.16.0"]' in pyproject
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "docs_trl"}
    exec(train, scope)  # as written: it defines everything it uses
    dump = read_dump("runs/trl/rollouts.jsonl")
    assert len(dump) == 2 * 4 and dump.correction == {"is_level": "token"} and dump.token_text is not None
    from rollcorr.cli import main

    argv = analyze.strip().split()
    assert argv[0] == "rollcorr" and main(argv[1:]) == 0
    exec(mapping, scope)
    assert scope["config"].is_mode == "mask" and scope["config"].denominator == "original"


@pytest.mark.slow  # starts a vLLM engine (~20 s on 2 cores)
def test_sampler_rollout_with_the_vllm_sampler(tmp_path):
    """The route docs/trl.md gives instead of TRL's colocated vLLM: vllm:fp32 through SamplerRollout, fp32
    learner: sampler and learner agree to rounding, and the engine takes the trainer's weights each step."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'rollcorr[vllm]')")
    rollout = SamplerRollout("vllm:fp32", block_size=32)
    try:
        trainer = make_trainer(tmp_path, steps=2, rollout_func=rollout, dump_path=tmp_path / "v.jsonl")
        trainer.train()
        dump = read_dump(tmp_path / "v.jsonl")
        assert len(dump) == 2 * 4 and rollout.loaded_step == 1
        assert prob_diff_max(dump) < 1e-3  # after a weight sync too: stale weights would be far off
    finally:
        rollout.close()


def test_importing_the_drop_in_prints_no_vllm_version_warnings():
    """TRL 1.16 warns "TRL currently supports vLLM versions from 0.22.0 to 0.31.0" from five modules when vLLM 0.32
    is installed; rollcorr's import of TRL silences exactly that warning."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "default", "-c", "import rollcorr.compat.trl"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "supports vLLM versions" not in done.stderr
