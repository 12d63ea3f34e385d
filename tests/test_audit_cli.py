"""``rollcorr audit`` end to end: --from-log on a dump written here, bad input, the built-in model."""

import importlib.util
import json
import math

import pytest
import torch

from rollcorr.audit.collect import load_prompts
from rollcorr.cli import main


def _write_dump(path, rollout="rollout_log_probs", learner="old_log_probs", bad_line=True):
    rows = [
        {
            rollout: [math.log(0.5), math.log(0.9)],
            learner: [math.log(0.38), math.log(0.9)],
            "response_mask": [1, 1],
        },
        {rollout: [math.log(0.2), -1.0], learner: [math.log(0.27), -3.0], "response_mask": [1, 0]},
    ]
    for row, text in zip(rows, (["A", "B"], ["C", "pad"])):
        row["token_text"] = text
    lines = [json.dumps(r) for r in rows]
    if bad_line:
        lines.insert(1, json.dumps({rollout: [-0.1, -0.2], learner: [-0.1]}))  # ragged: skipped
    path.write_text("\n".join(lines) + "\n")
    return path


def test_from_log(tmp_path, capsys):
    dump = _write_dump(tmp_path / "dump.jsonl")
    assert main(["audit", "--from-log", str(dump), "--out", str(tmp_path / "r")]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    p = summary["probability"]
    assert summary["n_tokens"] == 3 and summary["n_responses"] == 2
    assert p["prob_diff_frac_ge_0.1"] == pytest.approx(1 / 3) and p["prob_diff_max"] == pytest.approx(0.12)
    assert summary["worst_tokens"][0]["token"] == "A"
    assert summary["source"]["malformed_rows"][0].startswith("line 2:")
    assert (tmp_path / "r" / "report.html").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "share ≥ 0.1" in printed and "33.33 %" in printed and "malformed" in printed


def test_from_log_custom_field_names(tmp_path):
    dump = _write_dump(tmp_path / "trl.jsonl", rollout="mu_lp", learner="old_lp", bad_line=False)
    out = tmp_path / "r"
    assert main(["audit", "--from-log", str(dump), "--out", str(out)]) == 2  # default names are absent
    argv = ["audit", "--from-log", str(dump), "--rollout-field", "mu_lp", "--learner-field", "old_lp"]
    assert main([*argv, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["n_tokens"] == 3


def test_from_log_errors(tmp_path, capsys):
    assert main(["audit", "--from-log", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    dump = _write_dump(tmp_path / "d.jsonl")
    assert main(["audit", "--from-log", str(dump), "--sampler", "hf:bf16"]) == 2
    assert "--sampler" in capsys.readouterr().err


def test_prompts_file_formats_and_errors(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("1+2=\n\n3+4=\n")
    assert load_prompts(text) == ["1+2=", "3+4="]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"prompt": "b\\nc"}\n')
    assert load_prompts(jsonl) == ["a", "b\nc"]
    jsonl.write_text('{"prompt": "a"}\n\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: .*non-empty string"):
        load_prompts(jsonl)
    jsonl.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: invalid JSON"):
        load_prompts(jsonl)
    jsonl.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: .*\"prompt\" key"):
        load_prompts(jsonl)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts", "{bad}"], "invalid JSON"),
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--model", "{tmp}", "--gguf-file", "nope.gguf"], "not found in"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["-n", "0"], "must be >= 1"),
        (["--model", "{tmp}/SmolLM2-135M-Instruct.Q4_1.gguf"], "give it with --gguf-file"),
    ],
)
def test_bad_input_fails_fast(tmp_path, capsys, argv, message):
    pytest.importorskip("rollcorr.engines", reason="engines not built yet")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    argv = [a.replace("{bad}", str(bad)).replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["audit", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _tiny_model(path, vocab_size=None, seed=0):
    """A randomly initialised tiny Qwen2 with the built-in character tokenizer, saved as an HF folder."""
    import torch
    from transformers import Qwen2ForCausalLM

    from rollcorr.models.builtin import build_tokenizer, builtin_config

    tokenizer = build_tokenizer()
    config = builtin_config(
        vocab_size or len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        initializer_range=1.0,  # peaked next-token distributions, so dtype rounding shows in p
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("rollcorr.engines.hf", reason="hf engines not built yet")
    return _tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.slow  # the built-in end-to-end test covers the same path in the default run
def test_live_audit_on_a_tiny_model(tiny_model, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("12+34=\n5+6=\n")
    out = tmp_path / "r"
    argv = [
        "audit",
        "--model",
        str(tiny_model),
        "--prompts",
        str(prompts),
        "-n",
        "4",
        "--max-new-tokens",
        "6",
    ]
    assert main([*argv, "--batch-size", "1", "--seed", "3", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_responses"] == 4 and summary["source"]["sampler"] == "hf:bf16"
    assert summary["source"]["responses"] == 4 and summary["worst_tokens"][0]["token"] != ""
    assert summary["probability"]["prob_diff_max"] > 1e-2  # bf16 rounding moves the probabilities
    assert len(list(out.glob("*.png"))) == 5 and (out / "report.html").is_file()  # with levels.png
    assert "sampling (hf:bf16)" in capsys.readouterr().out


def test_collect_same_engine_agrees_and_is_reproducible(tiny_model):
    from rollcorr.audit import audit_stats, collect, from_rollout
    from rollcorr.engines import SamplingParams, make_learner, make_sampler

    sampler, learner = (
        make_sampler("hf:fp32", model_path=tiny_model),
        make_learner("hf:fp32", model_path=tiny_model),
    )
    params = SamplingParams(max_new_tokens=5, top_k=5, seed=7)
    calls = []
    runs = [
        collect(
            sampler,
            learner,
            ["1+2=", "3+4=", "5+6="],
            params,
            n=2,
            batch_size=2,
            on_batch=lambda *a: calls.append(a),
        )
        for _ in range(2)
    ]
    assert calls[:4] == [("sample", 4), ("score", 4), ("sample", 2), ("score", 2)]
    assert runs[0].batch_size == 6 and torch.equal(runs[0].response_ids, runs[1].response_ids)
    data = from_rollout(runs[0], learner.tokenizer)  # full distribution: top-k truncation is not mismatch
    p = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask)["probability"]
    assert p["prob_diff_frac_lt_1e-3"] == 1.0  # one engine, one dtype: the learner reproduces the sampler
    processed = from_rollout(runs[0], learner.tokenizer, sampler_dist="processed")
    m = runs[0].response_mask.bool()
    kept = runs[0].log_kept_mass[m]
    # "full" is log μ + log kept mass (one float32 add) and this difference one more rounding: each rounds by
    # ≤ ε₃₂/2 of its result, so they agree to ε₃₂ (|log μ| + 2 |log kept|)
    log_mu = processed.rollout_log_prob[m]
    bound = torch.finfo(torch.float32).eps * (log_mu.abs() + 2 * kept.abs())
    assert bool((((processed.rollout_log_prob - data.rollout_log_prob)[m] + kept).abs() <= bound).all())
    assert (kept < 0).any()  # top-k did cut mass somewhere, so the two comparisons differ
    assert data.tokens is not None and len(data.tokens) == 6


def test_tokenizer_not_matching_model(tmp_path, capsys):
    pytest.importorskip("rollcorr.engines.hf", reason="hf engines not built yet")
    model = _tiny_model(tmp_path / "small_vocab", vocab_size=8)
    assert main(["audit", "--model", str(model), "-n", "1", "--out", str(tmp_path / "o")]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _builtin_ready() -> str | None:
    for module in ("rollcorr.models.builtin", "rollcorr.engines.hf"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not built yet"
    from rollcorr.models.builtin import BUILTIN_DIR

    if not (BUILTIN_DIR / "model.safetensors").exists():
        return "the built-in checkpoint is not trained yet"
    return None


def test_unknown_engine_spec(tmp_path, capsys):
    if reason := _builtin_ready():
        pytest.skip(reason)
    assert main(["audit", "--sampler", "nosuch:bf16", "-n", "1", "--out", str(tmp_path / "o")]) == 2
    assert "nosuch" in capsys.readouterr().err


def test_builtin_end_to_end(tmp_path, capsys):
    if reason := _builtin_ready():
        pytest.skip(reason)
    out = tmp_path / "r"
    argv = ["audit", "-n", "4", "--max-new-tokens", "6", "--batch-size", "2", "--seed", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_responses"] == 4 and summary["n_tokens"] >= 4
    assert summary["source"]["sampler"] == "hf:bf16" and summary["source"]["learner"] == "hf:fp32"
    assert summary["worst_tokens"][0]["token"] != ""  # decoded with the built-in tokenizer
    assert 0 <= summary["probability"]["prob_diff_frac_ge_0.01"] <= 1
    assert len(list(out.glob("*.png"))) == 5  # the four plots and levels.png


def test_llamacpp_kv_cache_is_sized_to_the_audit(tmp_path, monkeypatch, capsys):
    """llama.cpp allocates max_batch × n_ctx KV cells up front: the audit asks for its batch and the longest
    prompt + max_new_tokens, not the model's full context (8192 for SmolLM2 cost GBs)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    import rollcorr.engines

    seen = {}

    def fake_sampler(spec, model_path=None, **kwargs):
        seen.update(kwargs, spec=spec)
        raise ValueError("stop here")

    monkeypatch.setattr(rollcorr.engines, "make_sampler", fake_sampler)
    prompts = tmp_path / "p.txt"
    prompts.write_text("1+2=\n123+456=\n")
    argv = ["audit", "--sampler", "llamacpp:q8_0", "--prompts", str(prompts), "--batch-size", "3",
            "--max-new-tokens", "7", "-n", "4", "--out", str(tmp_path / "out")]
    assert main(argv) == 2 and "stop here" in capsys.readouterr().err
    assert seen == {"spec": "llamacpp:q8_0", "max_batch": 3, "n_ctx": len("123+456=") + 7}  # one token a char


def test_an_audit_never_overwrites_and_two_cannot_share_a_folder(tmp_path, capsys, monkeypatch):
    """A non-empty --out is refused (--overwrite replaces the report); the default folder has a random suffix,
    so two audits in one second get two; a folder another audit holds is refused at once, naming its pid;
    an audit that stops on bad input leaves no folder behind."""
    import fcntl
    import os

    from rollcorr.audit.cli import _out_dir

    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    argv = ["audit", "-n", "2", "--max-new-tokens", "3", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "not empty (summary.json)" in err and "--overwrite" in err
    assert (out / "summary.json").read_text() == "{}"  # untouched
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["n_responses"] == 2 and not (out / ".lock").exists()
    assert _out_dir(None) != _out_dir(None) and _out_dir(None).name.startswith("audit-")
    # a folder in use: hold its lock as a running audit does
    busy = tmp_path / "busy"
    busy.mkdir()
    fd = os.open(busy / ".lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert main(["audit", "--out", str(busy)]) == 2
        assert "in use by another rollcorr process (pid 4242)" in capsys.readouterr().err
    finally:
        os.close(fd)
    capsys.readouterr()
    assert main(["audit", "--sampler", "hf:fp8", "--out", str(tmp_path / "never")]) == 2
    assert not (tmp_path / "never").exists()
