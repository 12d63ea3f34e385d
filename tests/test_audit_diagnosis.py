"""The audit as a diagnosis: --localize (where the mismatch enters) and --whatif (what would remove it), on
the built-in model with real hf engines."""

import json
import shlex

import pytest
import torch

from rollcorr.audit.collect import builtin_prompts, collect
from rollcorr.audit.localize import components, localize
from rollcorr.audit.verdict import commands
from rollcorr.audit.whatif import changed_spec, default_changes, parse_changes
from rollcorr.cli import build_parser, main
from rollcorr.engines import SamplingParams, make_learner, make_sampler

PARAMS = SamplingParams(max_new_tokens=12, seed=0)


@pytest.fixture(scope="module")
def learner():
    return make_learner("hf:fp32")


def _rollout(sampler, learner):
    return collect(sampler, learner, builtin_prompts(8), PARAMS, n=2, batch_size=16)


def test_an_fp32_pair_localises_nothing(learner):
    sampler = make_sampler("hf:fp32")
    loc = localize(sampler, learner, _rollout(sampler, learner))
    assert loc["full_forward"]["k3"] == 0.0  # the same weights, the same forward: bit for bit
    assert all(c["k3"] == 0.0 and c["share"] == 0.0 for c in loc["components"])
    assert all(s["rel_error"] == 0.0 for s in loc["sites"])
    assert loc["entry"].startswith("Nothing to localise")


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_a_perturbed_layer_is_localised_to_that_layer(learner, exact):
    """A sampler whose layer-2 MLP weights were moved (everything else the learner's, fp32): its mismatch is that
    component's — the largest share by far, measured in both modes — and the hidden states agree exactly up to
    that MLP."""
    sampler = make_sampler("hf:fp32")
    with torch.no_grad():
        weight = sampler.model.model.layers[2].mlp.down_proj.weight
        weight.add_(0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    loc = localize(sampler, learner, _rollout(sampler, learner), exact=exact)
    assert loc["mode"] == ("exact" if exact else "estimate")
    ranked = sorted(loc["components"], key=lambda c: -c["share"])
    assert ranked[0]["component"] == "layer 2 mlp" and ranked[0]["share"] > 0.9 and ranked[0]["method"] == "exact"
    assert all(c["k3"] == 0.0 for c in ranked[1:])  # swapping any other component changes nothing
    by_site = {(s["layer"], s["site"]): s["rel_error"] for s in loc["sites"]}
    assert by_site[(2, "attention")] == 0.0 and by_site[(2, "mlp")] > 0 and by_site[(3, "input")] > 0
    assert "layer 2 mlp" in loc["entry"]


def test_components_cover_the_model_in_forward_order(learner):
    names = [name for name, _ in components(learner.model)]
    layers = learner.model.config.num_hidden_layers
    assert names[0] == "embedding" and names[-3:] == ["final norm", "lm head", "residual stream"]
    assert len(names) == 2 * layers + 4


def test_the_changes_that_apply_to_each_engine():
    assert default_changes("hf:bf16") == ["fp16", "lm_head_fp32", "batch"]
    assert default_changes("hf:int8") == ["fp32", "batch"] and default_changes("vllm:bf16") == ["fp16"]
    assert default_changes("llamacpp:q4_0") == ["fp32"] and changed_spec("hf:bf16:sdpa", "fp16") == "hf:fp16:sdpa"
    assert changed_spec("llamacpp:q4_0", "fp32") == "llamacpp:f32" and default_changes("llamacpp") == ["fp32"]
    with pytest.raises(ValueError, match="bf16: llamacpp samplers are chosen by GGUF weight type"):
        parse_changes("bf16", "llamacpp:q4_0")
    assert parse_changes("fp16,batch", "hf:bf16") == ["fp16", "batch"]
    with pytest.raises(ValueError, match="unknown change 'fp8'"):
        parse_changes("fp8", "hf:bf16")
    with pytest.raises(ValueError, match="lm_head_fp32: needs the sampler's modules"):
        parse_changes("lm_head_fp32", "vllm:bf16")


def test_audit_localize_and_whatif_fp16_of_a_bf16_pair(tmp_path, capsys):
    """`rollcorr audit --sampler hf:bf16 --learner hf:fp32 --localize --whatif fp16`: the per-layer table, the plot
    and the counterfactual row in summary.json and report.html; fp16 lowers the share of tokens at |Δp| ≥ 0.01."""
    out = tmp_path / "audit"
    assert main(["audit", "--sampler", "hf:bf16", "--learner", "hf:fp32", "-n", "32", "--max-new-tokens", "16",
                 "--localize", "--whatif", "fp16", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    loc = summary["localization"]
    assert loc["responses"] == 8 and len(loc["components"]) == len(components(make_learner("hf:fp32").model))
    assert loc["full_forward"]["k3"] > 0 and 0 < loc["share_sum"]
    (fp16,) = summary["whatif"]
    assert fp16["change"] == "fp16" and fp16["sampler"] == "hf:fp16"
    assert set(summary["probability"]) <= set(fp16)  # the same keys as the audit's own table
    assert fp16["prob_diff_frac_ge_0.01"] < summary["probability"]["prob_diff_frac_ge_0.01"]
    assert {"localization.png", "levels.png"} <= set(summary["files"])
    page = (out / "report.html").read_text()
    assert "Where it enters" in page and "What would remove it" in page and "Is this level normal?" in page
    assert any(s.startswith("Measured on this model (--whatif)") for s in summary["verdict"])
    assert not any("Precision alone would remove" in s for s in summary["verdict"])  # measured, not quoted
    assert "Where it enters" in capsys.readouterr().out
    # the default estimated most shares, and says so: per row, in the sentence, the page; the exact mode is a
    # command away, the same audit with --localize-exact
    assert loc["mode"] == "estimate" and {c["method"] for c in loc["components"]} == {"exact", "estimate"}
    assert "estimated to first order (--localize-exact measures every one)" in loc["entry"]
    assert "first-order estimate</td>" in page and "exact: swapped in alone</td>" in page
    (exact,) = [c["command"] for c in summary["commands"] if c["label"].startswith("Measure every component")]
    args = build_parser("audit").parse_args(shlex.split(exact)[1:])
    assert (args.sampler, args.learner, args.num_responses, args.max_new_tokens) == ("hf:bf16", "hf:fp32", 32, 16)
    assert (args.localize, args.localize_exact, args.whatif) == (8, True, None)


def test_the_exact_localisation_command_carries_the_audits_model_prompts_and_chat():
    """After a partly estimated --localize of a model of one's own, prompts from a file and its chat template,
    the command that measures every component exactly audits the same model, prompts and chat setting."""
    summary = {"source": {"sampler": "hf:bf16", "learner": "hf:fp32", "model": "models/my model",
                          "prompts_file": "data/my prompts.jsonl", "chat_template": True, "responses": 8,
                          "max_new_tokens": 32},
               "verdict_level": {"level": "same"}, "localization": {"mode": "estimate", "responses": 4,
                                "components": [{"method": "exact"}, {"method": "estimate"}]}}
    (exact,) = [c["command"] for c in commands(summary) if c["label"].startswith("Measure every component")]
    args = build_parser("audit").parse_args(shlex.split(exact)[1:])
    assert (args.model, args.prompts, args.chat) == ("models/my model", "data/my prompts.jsonl", True)
    assert (args.num_responses, args.max_new_tokens, args.localize, args.localize_exact) == (8, 32, 4, True)
    summary["localization"]["components"] = [{"method": "exact"}]  # every share measured: nothing to add
    assert not any(c["label"].startswith("Measure every component") for c in commands(summary))


def test_diagnosis_refusals_are_one_line_before_loading(tmp_path, capsys):
    for argv, message in (
        (["--sampler", "llamacpp:q4_0", "--localize"], "--localize compares the two models module by module"),
        (["--localize", "0"], "--localize N: N must be >= 1"),
        (["--localize-exact"], "--localize-exact measures --localize's components exactly: add --localize"),
        (["--whatif", "fp8"], "unknown change 'fp8'"),
        (["--sampler", "vllm:bf16", "--whatif", "batch"], "--whatif batch: needs the sampler's modules"),
    ):
        assert main(["audit", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    dump = tmp_path / "d.jsonl"
    dump.write_text(json.dumps({"rollout_log_probs": [-1.0], "old_log_probs": [-1.1], "response_mask": [1]}) + "\n")
    assert main(["audit", "--from-log", str(dump), "--whatif", "--out", str(tmp_path / "y")]) == 2
    assert "--whatif" in capsys.readouterr().err


def test_audit_from_run_takes_the_runs_model_engines_prompts_and_sampling(tmp_path, capsys):
    """--from-run RUN: the model at the newest checkpoint (or --step N), the run's sampler and learner, its task's
    training prompts and its sampling settings; a missing step or a flag the run decides is one line."""
    run = tmp_path / "run"
    assert main(["train", "trainer.steps=2", "trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false",
                 "trainer.checkpoint_every=1", "rollout.prompts_per_step=4", "rollout.max_new_tokens=4",
                 "rollout.temperature=0.8", "model.sampler=hf:fp16", f"trainer.out={run}"]) == 0
    out = tmp_path / "audit"
    assert main(["audit", "--from-run", str(run), "--step", "1", "-n", "8", "--out", str(out)]) == 0
    source = json.loads((out / "summary.json").read_text())["source"]
    assert source["model"] == str(run / "checkpoints" / "step_000001" / "model") and source["step"] == 1
    assert (source["sampler"], source["learner"]) == ("hf:fp16", "hf:fp32")
    assert (source["max_new_tokens"], source["temperature"]) == (4, 0.8) and "train split" in source["prompts"]
    assert main(["audit", "--from-run", str(run), "-n", "8", "--out", str(tmp_path / "newest")]) == 0
    assert json.loads((tmp_path / "newest/summary.json").read_text())["source"]["step"] == 2
    capsys.readouterr()
    for argv, message in (
        (["--from-run", str(run), "--step", "7"], "--step 7: "),
        (["--from-run", str(run), "--prompts", "p.txt"], "--from-run takes the model, prompts and chat template"),
        (["--from-run", str(tmp_path)], "not a run folder (no config.yaml)"),
        (["--step", "1"], "--step picks a checkpoint of --from-run RUN"),
    ):
        assert main(["audit", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
