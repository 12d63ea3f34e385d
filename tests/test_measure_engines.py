"""rollcorr train --measure-engines: real steps of the run's config with each candidate sampler, sync and async,
within a time budget; what does not fit is listed as skipped with why. No test asserts which is faster: they
check the trials' order, the report's structure, the budget's skips and threads=0."""

import subprocess
import sys
from dataclasses import replace

import pytest

from rollcorr.cli import main
from rollcorr.train import measure_engines
from rollcorr.train.config import load_config
from rollcorr.train.measure_engines import (
    Measurement,
    Trial,
    candidates,
    plan,
    report,
    step_four,
    threads_said,
)


def test_the_candidates_are_the_configured_sampler_then_each_backend_once_cheapest_start_up_first():
    config = load_config(None, ["model.sampler=hf:bf16"])
    assert candidates(config) == ["hf:bf16", "llamacpp:q8_0", "vllm:bf16"]
    config = load_config(None, ["model.sampler=vllm"])  # vllm means vllm:bf16: not listed twice
    assert candidates(config) == ["vllm", "hf:bf16", "llamacpp:q8_0"]
    assert candidates(load_config(None, ["model.sampler=hf:fp32"]))[-2] == "llamacpp:f32"


def test_the_plan_measures_the_configured_sampler_sync_then_async_then_the_others_sync_vllm_last():
    config = load_config(None, ["model.sampler=hf:bf16", "trainer.mode=async"])
    assert plan(config) == [("hf:bf16", "sync"), ("hf:bf16", "async"), ("llamacpp:q8_0", "sync"),
                            ("vllm:bf16", "sync")]
    # building vLLM here changes this process for what follows: its sync trial is last, even when configured
    assert plan(load_config(None, ["model.sampler=vllm:fp16"])) == [
        ("vllm:fp16", "async"), ("hf:fp16", "sync"), ("llamacpp:q8_0", "sync"), ("vllm:fp16", "sync")]
    hf, fast = Trial("hf:bf16", "sync", 0.1, 1.0), Trial("llamacpp:q8_0", "sync", 0.1, 0.5)  # start-up, s/step
    tried = [hf, Trial("hf:bf16", "async", skipped="x"), fast]
    assert step_four(config, tried) == [("llamacpp:q8_0", "async")]  # async with the fastest in sync
    assert step_four(config, [*tried, Trial("llamacpp:q8_0", "async", skipped="x")]) == []  # once
    assert step_four(config, [*tried, Trial("vllm:bf16", "sync", 9.0, 0.1)]) == [("llamacpp:q8_0", "async")]
    assert step_four(config, [Trial("hf:bf16", "sync", skipped="x")]) == []


def _measured(*trials: Trial) -> Measurement:
    return Measurement(list(trials), learner_load_s=1.0, used_s=9.0, budget_s=10.0)


def test_the_report_gives_each_trial_its_numbers_or_its_reason_and_the_verdict_with_the_numbers():
    sync = Trial("hf:bf16", "sync", 0.1, 1.0, (0.9, 1.1), 0.4, 0.4, 0.55, 0.05, 800, 3)
    overlapped = Trial("hf:bf16", "async", 6.0, 0.6, (0.55, 0.65), 0.5, 0.0, 0.58, 0.02, 800, 3)
    skipped = Trial("vllm:bf16", "sync", skipped="the 10 s budget was spent (9.0 s); raise --measure-budget")
    text = report(_measured(sync, overlapped, skipped), threads_said(1, 1, 2))
    lines = text.splitlines()
    assert lines[0].split() == ["sampler", "mode", "start-up", "s", "s/step", "(min-max)", "generate", "wait",
                                "learn", "publish", "tokens/s"]
    assert lines[1].split() == ["hf:bf16", "sync", "0.1", "1.000", "(0.900-1.100)", "0.400", "0.400", "0.550",
                                "0.050", "2000"]
    assert lines[2].split()[:5] == ["hf:bf16", "async", "6.0", "0.600", "(0.550-0.650)"]
    assert lines[3].startswith("vllm:bf16        sync  not measured: the 10 s budget was spent")
    assert "measured in 9.0 s (budget 10 s) after loading the learner (1.0 s); 1 torch thread(s) a process" in text
    assert "fastest here: model.sampler=hf:bf16 trainer.mode=async (0.600 s a step)." in text
    assert "hf:bf16: async 0.600 vs sync 1.000 s a step = 1.67× (async pays)." in text


def test_async_is_recommended_only_when_each_of_its_steps_beats_each_sync_one():
    sync = Trial("hf:bf16", "sync", 0.1, 1.0, (0.9, 1.1), 0.4, 0.4, 0.55, 0.05, 800, 3)
    close = Trial("hf:bf16", "async", 6.0, 0.98, (0.9, 1.05), 0.5, 0.0, 0.95, 0.03, 800, 2)
    text = report(_measured(sync, close), threads_said(1, 1, 2))
    assert "fastest here: model.sampler=hf:bf16 trainer.mode=sync" in text
    assert "= 1.02× (no clear difference over these steps: stay sync" in text
    assert "the mean of 2-3 real step(s)" in text
    faster_but_overlapping = replace(close, step_s=0.8, spread=(0.5, 0.95))  # 20 % on the mean, one slow step
    assert "trainer.mode=sync" in report(_measured(sync, faster_but_overlapping), threads_said(1, 1, 2))
    slower = replace(close, step_s=1.4, spread=(1.3, 1.5))
    assert "= 0.71× (async is slower here: stay sync)." in report(_measured(sync, slower), threads_said(1, 1, 2))


def test_threads_zero_is_torchs_default_not_one_thread():
    assert threads_said(0, 16, 16) == "16 torch thread(s) a process (trainer.threads=0: torch's default), 16 cores"
    assert threads_said(2, 2, 16) == "2 torch thread(s) a process, 16 cores"


@pytest.mark.parametrize("threads, set_to", [(0, []), (2, [2])])
def test_measuring_sets_torchs_threads_as_a_run_does(monkeypatch, threads, set_to):
    import torch

    def stop(config):
        raise KeyError("stop before the learner loads")

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr("rollcorr.train.build.build_learner", stop)
    with pytest.raises(KeyError):
        measure_engines.measure(load_config(None, [f"trainer.threads={threads}"]))
    assert calls == set_to  # 0: left to torch (every core), never 1


@pytest.mark.parametrize("argv, said", [
    (["--measure-engines", "--measure-budget", "0"], "'0' is not a positive number of seconds"),
    (["--measure-engines", "--measure-budget", "ten"], "'ten' is not a positive number of seconds"),
    (["--measure-budget", "5"], "--measure-budget: only with --measure-engines"),
])
def test_a_bad_budget_is_one_line(capsys, argv, said):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err


def test_a_short_budget_measures_the_first_trial_and_lists_the_rest_as_skipped(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rollcorr", "train", "--measure-engines", "--measure-budget", "0.01",
                          "rollout.prompts_per_step=2", "rollout.group_size=2", f"trainer.out={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {tuple(line.split()[:2]): line for line in out.stdout.splitlines()[1:5]}
    assert list(rows) == [("hf:bf16", "sync"), ("hf:bf16", "async"), ("llamacpp:q8_0", "sync"), ("vllm:bf16", "sync")]
    assert "not measured" not in rows["hf:bf16", "sync"]  # the first trial always runs
    # its sampler process gets what is left of the budget to start (it may, on a fast machine: then it runs)
    assert "not measured" not in rows["hf:bf16", "async"] or "0.01 s budget" in rows["hf:bf16", "async"]
    for key in (("llamacpp:q8_0", "sync"), ("vllm:bf16", "sync")):
        assert "not measured: the 0.01 s budget was spent" in rows[key], rows[key]
    assert "(budget 0.01 s)" in out.stdout and "fastest here: model.sampler=hf:bf16 trainer.mode=sync" in out.stdout
    assert not (tmp_path / "run").exists()  # nothing trained, no run folder


def test_sync_and_async_are_both_measured_with_real_steps(monkeypatch):
    """The configured sampler alone (no other engine's start-up), with a budget its sampler process fits in."""
    monkeypatch.setattr(measure_engines, "candidates", lambda config: [config.model.sampler])
    config = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2"])
    m = measure_engines.measure(config, budget_s=300)
    assert [(t.engine, t.mode) for t in m.trials] == [("hf:bf16", "sync"), ("hf:bf16", "async")]
    for t in m.trials:
        assert t.skipped is None and t.steps == measure_engines.TIMED_STEPS, t
        assert t.step_s > 0 and t.learn_s > 0 and t.generate_s > 0 and t.tokens > 0
    text = report(m, threads_said(1, 1, 2))
    assert "hf:bf16: async " in text and " vs sync " in text and "fastest here: model.sampler=hf:bf16" in text


def test_a_sampler_process_that_does_not_start_in_time_is_ended_at_once(monkeypatch):
    """The async trial gives its sampler process what is left of the budget: one still starting then is
    terminated, not asked to close and waited for (it could answer only once started)."""
    import signal

    import torch

    from rollcorr.train import sampler_process
    from rollcorr.train.source import SourceSpec

    started, popen = [], sampler_process.subprocess.Popen

    def recorded(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(sampler_process.subprocess, "Popen", recorded)
    source = sampler_process.ProcessSource(SourceSpec.from_config(load_config(None, [])), start_timeout_s=0.01)
    with pytest.raises(sampler_process.SamplerProcessError, match="did not start in 0 s"):
        source.load_weights({"w": torch.zeros(2)}, 0)
    assert started[0].returncode == -signal.SIGTERM and not source.alive
