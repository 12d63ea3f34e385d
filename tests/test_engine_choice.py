"""rollcorr train --measure-engines: each candidate sampler timed on one batch of the run's shape, the learner's
share of a step, and a recommendation that follows the rule written in rollcorr.train.engine_choice."""

import subprocess
import sys

from rollcorr.train.config import load_config
from rollcorr.train.engine_choice import EngineTiming, async_s, candidates, report, sync_s


def test_the_candidates_are_the_configured_sampler_then_each_backend_once():
    config = load_config(None, ["model.sampler=hf:bf16"])
    assert candidates(config) == ["hf:bf16", "vllm:bf16", "llamacpp:q8_0"]
    config = load_config(None, ["model.sampler=vllm"])  # vllm means vllm:bf16: not listed twice
    assert candidates(config) == ["vllm", "hf:bf16", "llamacpp:q8_0"]
    assert candidates(load_config(None, ["model.sampler=hf:fp32"]))[-1] == "llamacpp:f32"


def test_the_recommendation_follows_the_rule():
    slow = EngineTiming("hf:bf16", 0.1, 1.0, 0.0, 100)
    fast = EngineTiming("vllm:bf16", 10.0, 0.5, 0.1, 100)
    broken = EngineTiming("llamacpp:q8_0", skipped="no llama_cpp")
    assert sync_s(fast, 1.0) == 1.6 and async_s(fast, 1.0) == 1.1
    text = report([slow, fast, broken], learn_s=1.0, cores=4, threads=1)
    assert "fastest sampler here: vllm:bf16" in text and "llamacpp:q8_0    not measured: no llama_cpp" in text
    assert "async (trainer.mode=async) could bring a step towards 1.10 s" in text  # 1.1 ≤ 0.75 · 1.6
    assert "stay sync: 2 cores cannot give" in report([fast], learn_s=1.0, cores=2, threads=2)
    assert "save less than a quarter" in report([EngineTiming("hf", 0, 0.1, 0.0, 10)], 1.0, cores=8, threads=1)


def test_the_command_measures_and_trains_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rollcorr", "train", "--measure-engines", "rollout.prompts_per_step=2",
                          "rollout.group_size=2", f"trainer.out={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "hf:bf16 " in out.stdout and "learner (π_old + loss forward/backward" in out.stdout
    assert "fastest sampler here:" in out.stdout
    assert not (tmp_path / "run").exists()  # nothing trained, no run folder
