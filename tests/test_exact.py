"""hf:exact: the sampler's decode and the learner's forward give bitwise-identical log-probs for the same tokens,
whatever the batch composition, padding and cache; on every CPU capability torch picks; in the audit and in
training (every weight exactly 1)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from rollcorr.audit.collect import builtin_prompts
from rollcorr.cli import main
from rollcorr.engines import SamplingParams, exact, make_learner, make_sampler
from rollcorr.engines.preflight import PreflightError, preflight
from rollcorr.engines.vllm import vllm_cpu_build


@pytest.fixture(scope="module")
def pair():
    return make_sampler("hf:exact"), make_learner("hf:exact")


def _equal(log_prob, rollout) -> bool:
    mask = rollout.response_mask.bool()
    return torch.equal(log_prob[mask], rollout.rollout_log_prob[mask])


def test_tree_sums_ignore_zero_padding_and_layout():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 37, generator=g) * torch.logspace(-3, 3, 37)
    ref = exact.tree_sum(x)
    for width in (64, 128, 1024):  # padded with zeros to any larger power of two: the same bits
        assert torch.equal(exact.tree_sum(torch.cat([x, torch.zeros(7, width - 37)], 1)), ref)
    assert torch.equal(exact.tree_sum(x[3:4]), ref[3:4])  # one row alone, or among others
    assert torch.equal(exact.tree_sum(x.T.contiguous(), dim=0), ref)  # another memory layout
    assert torch.allclose(ref.double(), x.double().sum(1), rtol=0, atol=64 * torch.finfo(torch.float32).eps * float(x.abs().sum(1).max()))


def test_exact_exp_and_log_are_accurate_and_the_same_in_any_shape():
    x = torch.linspace(-100, 88, 10_001)
    e = exact.exp(x)
    want = torch.exp(x.double())
    ulp = torch.finfo(torch.float32).eps
    assert float(((e.double() - want).abs() / want.clamp(min=1e-38)).max()) <= ulp  # within one rounding
    assert float(exact.exp(torch.tensor([float("-inf")]))) == 0.0
    y = torch.logspace(-30, 30, 10_001)
    lg = exact.log(y)
    assert float((lg.double() - torch.log(y.double())).abs().max()) <= ulp * 70  # |log y| ≤ 69
    assert float(exact.log(torch.tensor([0.0]))) == -math.inf
    # each element's value is its own: in a 1-element tensor, at an odd offset, in a long vector
    for fn, values in ((exact.exp, x), (exact.log, y)):
        whole = fn(values)
        for i in (0, 1, 5_003, 10_000):
            assert torch.equal(fn(values[i : i + 1]), whole[i : i + 1])
            assert torch.equal(fn(values[i:][:3]), whole[i : i + 3])


def test_the_exact_forward_is_the_models_forward_to_float_rounding(pair):
    """Not a different model: the exact forward agrees with transformers' fp32 forward within float32 rounding."""
    sampler, learner = pair
    rollout = sampler.generate(builtin_prompts(8), SamplingParams(max_new_tokens=6, seed=0), n=2)
    ours, theirs = learner.log_prob(rollout), make_learner("hf:fp32").log_prob(rollout)
    mask = rollout.response_mask.bool()
    config = learner.model.config
    bound = 2 * (config.num_hidden_layers + 1) * max(config.hidden_size, config.intermediate_size) * torch.finfo(torch.float32).eps
    assert float((ours - theirs)[mask].abs().max()) <= bound * max(1.0, float(theirs[mask].abs().max()))


def test_sampler_and_learner_agree_bit_for_bit_in_any_batch_composition(pair):
    """128 responses sampled in batches of 8 and of 64, scored all at once, in chunks, reversed, one by one:
    every token's two log-probs are bitwise equal."""
    sampler, learner = pair
    prompts = builtin_prompts(32, seed=3)
    for batch in (8, 64):
        rollouts = [sampler.generate(prompts[i : i + batch // 4], SamplingParams(max_new_tokens=6, seed=i), n=4)
                    for i in range(0, len(prompts), batch // 4)]
        for rollout in rollouts:
            assert _equal(learner.log_prob(rollout), rollout)
        rows = rollouts[0]
        order = list(range(rows.batch_size))[::-1]
        assert _equal(learner.log_prob(rows.select(order)), rows.select(order))
        for i in (0, rows.batch_size - 1):
            assert _equal(learner.log_prob(rows.select([i])), rows.select([i]))


def test_greedy_and_temperature_decodes_are_exact_too(pair):
    sampler, learner = pair
    for params in (SamplingParams(max_new_tokens=5, temperature=0.7, seed=1), SamplingParams(max_new_tokens=5, temperature=0.0)):
        rollout = sampler.generate(builtin_prompts(6), params, n=1)
        if params.greedy:  # log μ = 0; the kept mass is the argmax's exact untempered log-prob
            assert torch.equal(learner.log_prob(rollout, temperature=0)[rollout.response_mask.bool()],
                               rollout.log_kept_mass[rollout.response_mask.bool()])
        else:
            assert _equal(learner.log_prob(rollout, temperature=0.7), rollout)
    with pytest.raises(ValueError, match="temperature only"):
        sampler.generate(["1+2="], SamplingParams(max_new_tokens=3, top_k=5, seed=0))


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_bitwise_on_every_cpu_capability(capability, tmp_path):
    """The same check in a fresh process under each float kernel set torch can pick (where the CPU has it)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if capability != "default" and capability not in flags:
        pytest.skip(f"this CPU has no {capability}")
    script = ("import torch\nfrom rollcorr.engines import make_learner, make_sampler, SamplingParams\n"
              "from rollcorr.audit.collect import builtin_prompts\n"
              "s, l = make_sampler('hf:exact'), make_learner('hf:exact')\n"
              "r = s.generate(builtin_prompts(8), SamplingParams(max_new_tokens=5, seed=5), n=2)\n"
              "m = r.response_mask.bool()\n"
              "print(torch.backends.cpu.get_cpu_capability(), bool(torch.equal(l.log_prob(r)[m], r.rollout_log_prob[m])))\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got, equal = done.stdout.split()[-2:]
    assert equal == "True" and got.lower() == capability


def test_the_audit_reports_no_differing_token(tmp_path):
    out = tmp_path / "audit"
    assert main(["audit", "--sampler", "hf:exact", "--learner", "hf:exact", "-n", "64", "--max-new-tokens", "8",
                 "--batch-size", "16", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_differing"] == 0 and summary["n_tokens"] > 0 and summary["probability"]["prob_diff_max"] == 0
    assert summary["verdict"][0].startswith("Bit for bit")


def test_training_an_exact_pair_weights_every_token_exactly_one(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "model.sampler=hf:exact", "model.learner=hf:exact", "trainer.steps=2", "trainer.eval_every=0",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.progress=false", "trainer.plot=false",
                 f"trainer.out={out}"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    for r in steps:
        assert r["rollout_corr/k3_kl"] == 0.0 and r["rollout_corr/prob_diff_max"] == 0.0
        assert r["rollout_corr/rollout_is_min"] == r["rollout_corr/rollout_is_max"] == 1.0
        assert r["actor/kept_token_fraction"] == 1.0


@pytest.mark.slow
def test_the_audit_over_a_thousand_responses_finds_no_differing_token(tmp_path):
    """≥ 1,000 responses, in batches of 8 and of 64 (two batch compositions of the decode)."""
    for batch in ("8", "64"):
        out = tmp_path / f"audit{batch}"
        assert main(["audit", "--sampler", "hf:exact", "--learner", "hf:exact", "-n", "1024", "--max-new-tokens",
                     "8", "--batch-size", batch, "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["n_responses"] == 1024 and summary["tokens_differing"] == 0


def test_vllm_batch_invariant_mode_is_refused_on_the_cpu_build_and_amp_as_a_sampler():
    if vllm_cpu_build():
        with pytest.raises(PreflightError, match="batch-invariant mode .* CPU build .* use hf:exact"):
            preflight("vllm:fp32:batch-invariant", None)
    with pytest.raises(PreflightError, match="is a learner"):
        preflight("hf:amp-fp16", None)
    with pytest.raises(ValueError, match="covers LlamaForCausalLM, Qwen2ForCausalLM"):
        make_learner("hf:exact", "builtin:moe")
