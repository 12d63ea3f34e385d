"""The proximal cost/accuracy benchmark runs end to end on a tiny model (slow: real sampling and training)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM


def _load_bench():
    """benchmarks/bench_proximal.py is a script, not a package module: load it from its path."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_proximal.py"
    spec = importlib.util.spec_from_file_location("bench_proximal", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_proximal"] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
run, table = bench.run, bench.table


@pytest.mark.slow
def test_bench_runs_and_exact_strategies_are_exact(tmp_path):
    from rollcorr.models.builtin import build_tokenizer, builtin_config

    tok = build_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        builtin_config(len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    report = run(model=str(tmp_path), steps=3, prompts=4, n=2, max_new_tokens=6, lr=0.05)
    s = report["strategies"]
    assert set(s) == {
        "recompute",
        "bypass",
        "snapshot",
        "old_logit_model",
        "interrupt",
        "loglinear",
        "linear",
        "ewma",
    }
    assert s["snapshot"]["logp_abs_err_max"] == 0.0
    for name in ("old_logit_model", "interrupt"):  # exact up to re-scoring a prefix vs the full row
        assert s[name]["logp_abs_err_max"] < 1e-4 and s[name]["exact_token_fraction"] == 1.0
    assert s["bypass"]["logp_abs_err_mean"] > 0  # bf16 sampler vs fp32 learner: the discrepancy is not 0
    assert s["snapshot"]["extra_bytes"] > s["ewma"]["extra_bytes"] > 0
    assert report["mean_version_lag"] > 0
    assert "| ewma |" in table(report)
