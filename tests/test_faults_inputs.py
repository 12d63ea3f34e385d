"""Untrusted text is bounded and every refusal is one line: YAML bombs, duplicate keys, out-of-range
values, a stopped or killed sampler process, plain-text messages (issue: inputs you can trust)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from rollcorr.cli import main
from rollcorr.config.yaml_io import MAX_ALIASES, YamlError, excerpt, load_yaml
from rollcorr.train.config import ConfigError, load_config

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)  # 9 lines, ~500 bytes: 9⁹ ≈ 3.9e8 leaves once expanded


def test_alias_bomb_is_refused_fast_with_a_short_message(tmp_path, capsys):
    start = time.process_time()
    with pytest.raises(YamlError, match="alias bomb"):
        load_yaml(BOMB, "bomb.yaml")
    path = tmp_path / "bomb.yaml"
    path.write_text("trainer:\n  seed: 0\nx:\n" + "".join("  " + line + "\n" for line in BOMB.splitlines()))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "alias bomb" in err and len(err) < 400
    assert main(["analyze", "--config", str(path)]) == 2
    assert "alias bomb" in capsys.readouterr().err
    assert time.process_time() - start < 20  # it took 29 s and > 2 GB before (a bound, not a benchmark)


def test_too_many_aliases_and_too_deep_nesting_are_refused():
    many = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(YamlError, match="more than 100 aliases"):
        load_yaml(many)
    with pytest.raises(YamlError, match="nested deeper"):
        load_yaml("[" * 200 + "]" * 200)
    with pytest.raises(YamlError, match="larger than"):
        load_yaml("a: " + "x" * (2 << 20))


def test_duplicate_keys_are_refused_naming_the_key(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("trainer:\n  steps: 5\nmodel:\n  sampler: hf:fp32\ntrainer:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"key 'trainer' appears twice .*first at line 1.* at line 5"):
        load_config(path)
    correction = tmp_path / "correction.yaml"
    correction.write_text("is_level: token\nis_upper: 2\nis_upper: 3\n")
    assert main(["analyze", "--config", str(correction)]) == 2
    assert "'is_upper' appears twice" in capsys.readouterr().err
    assert load_yaml("base: &b {x: 1}\nuse:\n  <<: *b\n  x: 2\n")["use"] == {"x": 2}  # merge keys still work


def test_error_messages_quote_a_bounded_excerpt(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text("trainer:\n  steps: [" + ", ".join(["1"] * 5000) + "]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "trainer.steps: expected an integer" in str(err.value) and len(str(err.value)) < 200
    assert len(excerpt("y" * 10_000)) < 100


def test_override_values_use_the_bounded_loader():
    with pytest.raises(ConfigError, match="appears twice"):
        load_config(None, ["algorithm.correction={preset: decoupled_token_is, preset: bypass_ppo_clip}"])


def test_resumed_run_config_with_a_bomb_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(BOMB)
    assert main(["train", "--resume", str(run)]) == 2
    assert "alias bomb" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.clip_low=1.5", "never binds"),
        ("trainer.seed=-1", r"trainer.seed: must be in \[0, 2\*\*32\)"),
        (f"trainer.seed={2**32}", r"trainer.seed: must be in \[0, 2\*\*32\)"),
    ],
)
def test_values_that_never_bind_or_overflow_are_refused(override, message, capsys):
    assert main(["train", override, "--print-config"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match=message):
        from rollcorr.train.loop import check_components

        check_components(load_config(None, [override]))


def test_cispo_keeps_its_no_lower_bound_default():
    from rollcorr.losses import LossConfig

    assert LossConfig(name="cispo", clip_low=1.0).clip_low == 1.0  # 1 − ε_lo = 0: "no lower bound"
    assert LossConfig(name="gmpo", clip_low=1.5).clip_low == 1.5  # log space: exp(−1.5) binds


def test_analyze_verl_dialect_refuses_reinforce_outside_bypass(tmp_path, capsys):
    path = tmp_path / "verl.yaml"
    path.write_text("rollout_is: token\nloss_type: reinforce\nbypass_mode: false\n")
    assert main(["analyze", "--dialect", "verl", "--config", str(path)]) == 2
    assert "bypass mode only" in capsys.readouterr().err


def test_plain_messages_have_no_rich_markup(tmp_path, capsys):
    from rollcorr.train.logging import RunLogger

    logger = RunLogger(tmp_path, 1, tensorboard=False, progress=False)
    logger.message("[yellow]SIGTERM:[/yellow] saving a checkpoint after this step")
    logger.message("a path with [brackets] and [/odd] markup")  # not markup: printed as it is
    logger.close()
    out = capsys.readouterr().out
    assert "SIGTERM: saving" in out and "[yellow]" not in out and "[/odd]" in out


def test_percentages_are_never_in_exponent_form():
    from rollcorr.analyze.render import _percent

    assert [_percent(x) for x in (1.0, 0.5, 0.0123, 0.0)] == ["100%", "50%", "1.2%", "0%"]


def test_seed_range_documented_values_load():
    assert load_config(None, [f"trainer.seed={2**32 - 1}"]).trainer.seed == 2**32 - 1


# ---------------------------------------------------------------- the sampler process


def test_stopped_sampler_process_is_a_heartbeat_timeout(versions):
    from rollcorr.engines import SamplingParams
    from rollcorr.train.sampler_process import ProcessSource, SamplerProcessError
    from rollcorr.train.source import SourceSpec

    spec = SourceSpec(
        "hf:fp32", None, "addition:1", SamplingParams(max_new_tokens=4, seed=0), 2, 2, 0, threads=1
    )
    source = ProcessSource(spec)
    source.heartbeat_timeout_s = 5.0
    try:
        source.load_weights(versions(0), 0)
        source.sample(0)
        os.kill(source.pid, signal.SIGSTOP)
        with pytest.raises(
            SamplerProcessError, match=r"sent no heartbeat for 5 s during 'sample': it is stopped"
        ):
            source.sample(1)
    finally:
        if source.pid is not None:
            try:
                os.kill(source.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        source.close(timeout_s=5)


def test_killed_sampler_process_is_one_line(tmp_path, addition_model_dir, capsys, monkeypatch):
    from rollcorr.train.loop import Trainer

    one_step = Trainer._one_step

    def step_then_kill(self):
        if self.step == 1:
            os.kill(self.executor.source.pid, signal.SIGKILL)
        return one_step(self)

    monkeypatch.setattr(Trainer, "_one_step", step_then_kill)
    args = ["task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.steps=6",
            "rollout.max_new_tokens=4", "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false",
            "trainer.tensorboard=false", "trainer.mini_batches=1", "trainer.mode=async",
            f"model.path={addition_model_dir}"]
    assert main(["train", "--out", str(tmp_path / "run"), *args]) == 1
    err = capsys.readouterr().err
    assert "died" in err and "--resume" in err and "Traceback" not in err


def test_integer_advantage_past_float_range_is_a_malformed_row(tmp_path):
    from rollcorr.dumps import read_dump

    row = {"rollout_log_probs": [-1.0, -2.0], "old_log_probs": [-1.1, -2.1]}
    text = json.dumps(row)[:-1] + ', "advantages": 1' + "0" * 400 + "}\n"  # JSON allows any integer
    path = tmp_path / "dump.jsonl"
    path.write_text(text + json.dumps({**row, "advantages": 1.0}) + "\n")
    dump = read_dump(path)
    assert len(dump.malformed) == 1 and "too large for a float" in dump.malformed[0].reason


def test_first_sigterm_ends_a_step_waiting_on_a_stopped_sampler(tmp_path, addition_model_dir):
    import threading

    from rollcorr.checkpoint import list_checkpoints
    from rollcorr.train.loop import Trainer

    args = ["task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.steps=50",
            "rollout.max_new_tokens=4", "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false",
            "trainer.tensorboard=false", "trainer.mini_batches=1", "trainer.mode=async", "trainer.max_staleness=1",
            f"model.path={addition_model_dir}", f"trainer.out={tmp_path / 'run'}"]
    trainer = Trainer(load_config(None, args))
    one_step = trainer._one_step

    def step_then_stop_the_sampler():
        out = one_step()
        if trainer.step == 2:
            os.kill(trainer.executor.source.pid, signal.SIGSTOP)  # its queue drains, then the trainer waits
            threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return out

    trainer._one_step = step_then_stop_the_sampler
    result = trainer.run()  # used to wait forever
    assert "SIGTERM" in result.stopped
    assert list_checkpoints(result.run_dir)[-1].name == f"step_{result.steps:06d}"
