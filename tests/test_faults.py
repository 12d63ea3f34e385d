"""Fault injection: what a hostile user, a kill or a bad file does to a run folder, a dump or the math.

Each test reproduces one way things used to go wrong — code run from a checkpoint, two runs merged into one
folder, NaN weights saved, a failed ``--resume`` that broke the run, data lost or duplicated on resume, a
traceback from ``analyze`` — and checks that nothing is lost and the message names the problem. The kill
loops (real ``kill -9`` of a subprocess at many moments) are behind the ``slow`` marker.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollcorr.checkpoint import (
    STATE_FILE,
    STATE_KEYS,
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    write_manifest,
)
from rollcorr.cli import main
from rollcorr.dumps import read_dump
from rollcorr.train.config import ConfigError, load_config, save_config
from rollcorr.train.loop import Trainer, run
from rollcorr.train.rundir import RESUMABLE_KEYS, RunFinished, RunFolderError, RunLock, new_run_dir

# training batches rewarded 1, 0, 1, … by row (tests/conftest.py): gradients non-zero on any CPU
pytestmark = pytest.mark.usefixtures("alternating_rewards")

TINY = [
    "task.name=addition:1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "task.eval_prompts=0",
    "trainer.progress=false",
    "trainer.plot=false",
    "trainer.tensorboard=false",
    "trainer.mini_batches=1",
    "optim.lr=1e-3",
]


def tiny(tmp_path, model_dir, *overrides, name="run"):
    return load_config(None, [*TINY, f"model.path={model_dir}", f"trainer.out={tmp_path / name}", *overrides])


def lines(run_dir: Path) -> list[dict]:
    """The complete records of ``metrics.jsonl``: a test polling a live run can read a line the trainer is
    still writing (a write is not atomic for a concurrent reader), so a last line without its newline is left."""
    complete = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    return [json.loads(x) for x in complete if x.strip()]


def steps_logged(run_dir: Path) -> list[int]:
    return [r["step"] for r in lines(run_dir) if "reward/mean" in r]


def resume(run_dir: Path, *overrides):
    return run(load_config(run_dir / "config.yaml", list(overrides)), resume=run_dir)


# ---------------------------------------------------------------- checkpoints are data, never code


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_checkpoint_runs_no_code(tmp_path, addition_model_dir):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=1"))
    marker = tmp_path / "pwned"
    state = checkpoint_dir(result.run_dir, 1) / STATE_FILE
    torch.save({"step": 1, "payload": _Evil(marker)}, state)  # `torch.load(weights_only=False)` ran it
    write_manifest(state.parent)  # an attacker rewrites the checksums too: the unpickler still refuses
    with pytest.raises(CheckpointError, match="refused to load: it calls '(posix|os).system'"):
        load_checkpoint(state.parent)
    with state.open("wb") as f:  # a bare pickle (not torch's zip format) is refused too
        pickle.dump({"step": 1, "payload": _Evil(marker)}, f)
    write_manifest(state.parent)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(state.parent)
    with pytest.raises(RunFolderError, match="no checkpoint can be read"):
        resume(result.run_dir, "trainer.steps=2")
    assert not marker.exists()
    assert steps_logged(result.run_dir) == [1]  # nothing was rewritten


def test_checkpoint_rng_state_round_trips_under_weights_only(tmp_path):
    import random

    import numpy as np

    from rollcorr.checkpoint import rng_state, set_rng_state

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    save_checkpoint(tmp_path, 1, {**dict.fromkeys(STATE_KEYS), "step": 1, "rng": rng_state()})
    expected = (torch.rand(2), random.random(), np.random.rand())
    set_rng_state(load_checkpoint(checkpoint_dir(tmp_path, 1))["rng"])
    assert (torch.rand(2), random.random(), np.random.rand())[1:] == expected[1:]


# ---------------------------------------------------------------- one run, one folder, one writer


def test_new_run_refuses_a_folder_holding_a_run(tmp_path, addition_model_dir, capsys):
    config = tiny(tmp_path, addition_model_dir, "trainer.steps=2")
    first = run(config)
    before = (first.run_dir / "metrics.jsonl").read_text()
    with pytest.raises(RunFolderError, match=r"--resume .*--overwrite"):
        run(config)
    assert (first.run_dir / "metrics.jsonl").read_text() == before  # not appended to
    code = main(["train", "--out", str(first.run_dir), *TINY, f"model.path={addition_model_dir}"])
    assert code == 2 and "--overwrite" in capsys.readouterr().err
    second = run(config, overwrite=True)  # replaced, not merged
    assert second.run_dir == first.run_dir and steps_logged(first.run_dir) == [1, 2]


def test_overwrite_only_replaces_a_run_folder(tmp_path, addition_model_dir):
    other = tmp_path / "run"
    other.mkdir()
    (other / "thesis.tex").write_text("keep me")
    with pytest.raises(RunFolderError, match="only replaces a run folder"):
        run(tiny(tmp_path, addition_model_dir, "trainer.steps=1"), overwrite=True)
    assert (other / "thesis.tex").read_text() == "keep me"


def test_a_folder_of_other_files_is_refused_without_resume_or_overwrite_advice(tmp_path, addition_model_dir):
    """A non-empty --out that holds no run: neither `--resume` (nothing to continue) nor `--overwrite` (refused
    for a folder that is not a run) is offered; one line, exit 2, the files untouched."""
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "thesis.tex").write_text("keep me")
    done = subprocess.run([sys.executable, "-m", "rollcorr", "train", "--out", str(other), *TINY,
                           f"model.path={addition_model_dir}", "trainer.steps=1"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "holds no run" in line and "thesis.tex" in line and "choose another --out" in line, line
    assert "--resume" not in line and "--overwrite" not in line, line
    assert sorted(p.name for p in other.iterdir()) == ["thesis.tex"]


def test_default_run_folders_are_unique():
    names = {new_run_dir(None) for _ in range(50)}
    assert len(names) == 50 and all(n.parent == Path("runs") for n in names)


def test_second_writer_fails_naming_the_holder(tmp_path, addition_model_dir):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=1"))
    before = (result.run_dir / "config.yaml").read_text()
    with RunLock(result.run_dir):  # this process holds the run, as a running `rollcorr train` would
        with pytest.raises(RunFolderError, match=f"pid {os.getpid()}"):
            resume(result.run_dir, "trainer.steps=2")
        with pytest.raises(RunFolderError, match=f"pid {os.getpid()}"):  # even with --overwrite
            run(tiny(tmp_path, addition_model_dir, "trainer.steps=1"), overwrite=True)
    assert (result.run_dir / "config.yaml").read_text() == before
    assert resume(result.run_dir, "trainer.steps=2").steps == 2  # released: the run continues


def test_no_folder_is_created_before_the_checks(tmp_path, addition_model_dir, capsys):
    out = tmp_path / "never"
    code = main(["train", "--out", str(out), "algorithm.correction.preset=no_such_preset"])
    assert code == 2 and "algorithm.correction.preset" in capsys.readouterr().err
    code = main(["train", "--print-config", "algorithm.correction.preset=no_such_preset"])
    assert code == 2 and "unknown preset" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="model.learner"):
        Trainer(tiny(tmp_path, addition_model_dir, "model.learner=hf:fp16", name="never"))
    assert not out.exists()


# ---------------------------------------------------------------- never publish or save non-finite weights


def test_huge_learning_rate_is_a_bad_step_and_no_nan_is_saved(tmp_path, addition_model_dir):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=6", "optim.lr=1e30", "optim.weight_decay=0.01",
                      "trainer.max_bad_steps=2"))
    assert result.stopped and "non-finite" in result.stopped and result.steps == 2
    weights = load_checkpoint(list_checkpoints(result.run_dir)[-1])["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())
    from rollcorr.engines import make_sampler

    start = make_sampler("hf:fp32", addition_model_dir).float_model.state_dict()
    assert all(torch.equal(start[k].float(), weights[k]) for k in weights)  # every step was undone
    assert lines(result.run_dir)[-1]["train/nonfinite_weight_steps"] == 1.0


def test_guarded_step_restores_weights_and_optimizer_state():
    from rollcorr.train.step import GuardedStep

    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p, q], lr=1e-2)
    step = GuardedStep(opt, [p, q])
    p.grad = torch.ones(3)
    assert step()  # q has no gradient: no optimizer state yet
    saved_p, saved_state = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    for _ in range(2):  # the buffers are reused: a second undone step restores the same state again
        for group in opt.param_groups:
            group["lr"] = float("inf")
        p.grad, q.grad = torch.ones(3), torch.ones(2)
        assert not step()
        assert torch.equal(p.detach(), saved_p) and torch.equal(q.detach(), torch.ones(2))
        assert all(torch.equal(opt.state[p][k], v) for k, v in saved_state.items())
        assert q not in opt.state or not opt.state[q]  # its first step was undone: no state again
    for group in opt.param_groups:
        group["lr"] = 1e-2
    assert step() and torch.isfinite(q).all() and not torch.equal(q.detach(), torch.ones(2))


# ---------------------------------------------------------------- resume: checked first, never worse


def test_refused_resume_override_writes_nothing(tmp_path, addition_model_dir):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.mode=simulated_async", "trainer.steps=2"))
    folder = result.run_dir
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    for override, key in [("trainer.mode=async", "trainer.mode"), ("algorithm.proximal.name=snapshot",
                          "algorithm.proximal"), ("trainer.out=elsewhere", "trainer.out"),
                          ("trainer.steps=1", "trainer.steps")]:
        with pytest.raises(ConfigError, match=key):
            resume(folder, override)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert resume(folder, "trainer.steps=3", "trainer.checkpoint_every=7").steps == 3  # allowed keys
    assert steps_logged(folder) == [1, 2, 3]
    assert "trainer.steps" in RESUMABLE_KEYS and "trainer.mode" not in RESUMABLE_KEYS


def test_run_killed_before_its_first_checkpoint_restarts_from_zero(tmp_path, addition_model_dir):
    config = tiny(tmp_path, addition_model_dir, "trainer.steps=2")
    folder = tmp_path / "run"
    folder.mkdir()
    save_config(config, folder / "config.yaml")
    (folder / "checkpoints").mkdir()  # a new run makes it at once; the first checkpoint was never written
    (folder / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    assert resume(folder).steps == 2
    assert steps_logged(folder) == [1, 2]  # the killed life's lines are gone, none duplicated


def test_resuming_a_finished_run_appends_nothing(tmp_path, addition_model_dir, capsys):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=2"))
    before = (result.run_dir / "metrics.jsonl").read_text()
    with pytest.raises(RunFinished, match="already finished"):
        resume(result.run_dir)
    assert main(["train", "--resume", str(result.run_dir)]) == 0
    assert "already finished" in capsys.readouterr().out
    assert (result.run_dir / "metrics.jsonl").read_text() == before


def test_corrupt_metrics_line_keeps_every_intact_line(tmp_path, addition_model_dir, capsys):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=4", "trainer.checkpoint_every=3"))
    folder = result.run_dir
    for ckpt in list_checkpoints(folder)[1:]:  # as if killed during step 4: newest checkpoint is step 3
        shutil.rmtree(ckpt)
    text = (folder / "metrics.jsonl").read_text().splitlines()
    text[1] = text[1][:10]  # step 1's line torn in the middle of the file
    (folder / "metrics.jsonl").write_text("\n".join(text) + "\n")
    capsys.readouterr()
    assert resume(folder).steps == 4
    assert steps_logged(folder) == [2, 3, 4]  # step 2 and 3 kept (they used to be dropped), 4 re-run
    out = capsys.readouterr().out
    assert "dropped" in out and "line 2" in out


def test_truncated_newest_checkpoint_falls_back_to_the_older_one(tmp_path, addition_model_dir, capsys):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=3", "trainer.checkpoint_every=2"))
    newest = checkpoint_dir(result.run_dir, 3) / STATE_FILE
    newest.write_bytes(newest.read_bytes()[:1000])
    assert resume(result.run_dir, "trainer.steps=4").steps == 4
    assert "skipped checkpoint step_000003" in capsys.readouterr().out
    assert steps_logged(result.run_dir) == [1, 2, 3, 4]


def test_resume_of_a_damaged_run_folder_is_one_line(tmp_path, addition_model_dir, capsys):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=1"))
    torch.save({"step": 1}, checkpoint_dir(result.run_dir, 1) / STATE_FILE)  # loads, but is not a checkpoint
    write_manifest(checkpoint_dir(result.run_dir, 1))
    assert main(["train", "--resume", str(result.run_dir), "trainer.steps=2"]) == 2
    assert "no 'version' entry" in capsys.readouterr().err
    shutil.rmtree(result.run_dir / "checkpoints")
    (result.run_dir / "checkpoints").write_text("not a folder")
    assert main(["train", "--resume", str(result.run_dir), "trainer.steps=2"]) == 2
    assert "checkpoints: is not a directory" in capsys.readouterr().err
    (result.run_dir / "config.yaml").write_text("trainer: [unclosed")
    assert main(["train", "--resume", str(result.run_dir)]) == 2
    assert "not valid YAML at line 1" in capsys.readouterr().err


def test_kill_between_the_renames_of_a_resave_keeps_the_checkpoint(tmp_path, addition_model_dir):
    result = run(tiny(tmp_path, addition_model_dir, "trainer.steps=2", "trainer.keep_checkpoints=1"))
    root = result.run_dir / "checkpoints"
    (root / "step_000002").rename(root / ".old-step_000002")  # killed after the first rename of a re-save
    (root / ".tmp-step_000002").mkdir()  # ... and the new copy never finished
    assert resume(result.run_dir, "trainer.steps=3").steps == 3
    assert sorted(p.name for p in root.iterdir()) == ["step_000003"]


def test_failed_save_leaves_no_temporary_files(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="no space left on device.*nothing was lost"):
        save_checkpoint(tmp_path, 5, {"step": 5})
    assert list((tmp_path / "checkpoints").iterdir()) == []
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        save_config(load_config(None, []), tmp_path / "config.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # no config.yaml, no temp file


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_saves_a_checkpoint_and_the_run_continues(tmp_path, addition_model_dir, signum):
    """SIGTERM (`kill`, a scheduler's preemption) and SIGHUP (the terminal closed): the step ends, a checkpoint
    is written, the run resumes."""
    trainer = Trainer(tiny(tmp_path, addition_model_dir, "trainer.steps=50"))
    one_step = trainer._one_step

    def step_then_signal():
        out = one_step()
        if trainer.step == 2:
            os.kill(os.getpid(), signum)
        return out

    trainer._one_step = step_then_signal
    before = signal.getsignal(signum)  # SIG_DFL, or Ray's handler when an earlier test started Ray
    result = trainer.run()
    assert result.steps == 2 and signal.Signals(signum).name in result.stopped
    assert [p.name for p in list_checkpoints(result.run_dir)] == ["step_000002"]
    assert signal.getsignal(signum) is before  # the handler was put back
    assert resume(result.run_dir, "trainer.steps=3").steps == 3
    assert steps_logged(result.run_dir) == [1, 2, 3]


@pytest.mark.slow
def test_kill_9_at_many_moments_never_loses_a_run(tmp_path, addition_model_dir):
    """kill -9 a real `rollcorr train` process after 1..N metric lines; resume each time; nothing lost."""
    out = tmp_path / "run"
    args = [*TINY, f"model.path={addition_model_dir}", "trainer.steps=8", "trainer.checkpoint_every=1"]
    cmd = [sys.executable, "-m", "rollcorr.cli", "train", "--out", str(out), *args]
    for attempt in range(6):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        target = attempt + 1
        while proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len(steps_logged(out)) >= target:
                proc.kill()
                break
        proc.wait()
        cmd = [sys.executable, "-m", "rollcorr.cli", "train", "--resume", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert steps_logged(out) == list(range(1, 9))


# ---------------------------------------------------------------- analyze: a bad file is a line, never a traceback


def _row(**extra):
    return {"rollout_log_probs": [-0.5, -1.0], "old_log_probs": [-0.4, -1.1], **extra}


def _write(path: Path, rows: list, raw: bytes = b"") -> Path:
    path.write_bytes(raw + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    return path


def test_dump_byte_order_mark_is_not_a_bad_row(tmp_path):
    dump = read_dump(_write(tmp_path / "d.jsonl", [_row(), _row()], raw=b"\xef\xbb\xbf"))
    assert len(dump) == 2 and dump.malformed == []


def test_dump_gzip_faults(tmp_path):
    torch.manual_seed(0)
    rows = [{"rollout_log_probs": (-torch.rand(20)).tolist(), "old_log_probs": (-torch.rand(20)).tolist()}
            for _ in range(200)]
    good = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    dump = read_dump(tmp_path / "cut.jsonl.gz")
    assert 0 < len(dump) < 200 and "ends early" in dump.malformed[-1].reason
    _write(tmp_path / "plain.jsonl.gz", [_row()])
    with pytest.raises(ValueError, match="not a gzip file"):
        read_dump(tmp_path / "plain.jsonl.gz")


def test_dump_unreadable_inputs_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is a directory"):
        read_dump(tmp_path)
    path = _write(tmp_path / "d.jsonl", [_row()])

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(ValueError, match="cannot read .Permission denied"):
        read_dump(path)


def test_dump_rows_with_bad_bytes_or_numbers_are_skipped_with_their_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        json.dumps(_row()).encode() + b"\n"
        + b'{"rollout_log_probs": [-0.5], "old_log_probs": [-0.4], "response_text": "\xff\xfe"}\n'
        + json.dumps(_row(responses=[1, 2**63])).encode() + b"\n"
        + b'{"rollout_log_probs": [-0.5, -1.0], "old_log_probs": [-0.4, -1' + b"0" * 400 + b"]}\n"
        + json.dumps(_row()).encode() + b"\n"
    )
    dump = read_dump(path)
    assert dump.line_numbers == [1, 5]
    reasons = {m.line: m.reason for m in dump.malformed}
    assert "UTF-8" in reasons[2] and "int64" in reasons[3] and "too large" in reasons[4]


def test_dump_optional_fields_row_by_row(tmp_path):
    rows = [_row(response_mask=[1, 0], advantages=1.0), _row(), _row(advantages=[0.5, 0.5])]
    dump = read_dump(_write(tmp_path / "d.jsonl", rows))
    assert len(dump) == 3  # a row without a mask is all valid (the mask is optional), not skipped
    assert dump.response_mask.tolist() == [[True, False], [True, True], [True, True]]
    assert dump.advantages is None and dump.partial["advantages"] == [2]
    code = main(["analyze", str(tmp_path / "d.jsonl"), "--set", "opsm_delta=0.1"])
    assert code == 2  # and the message says which rows lack advantages (checked below)


def test_partial_advantages_message_names_the_rows(tmp_path, capsys):
    _write(tmp_path / "d.jsonl", [_row(advantages=1.0), _row()])
    assert main(["analyze", str(tmp_path / "d.jsonl"), "--set", "opsm_delta=0.1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "1 of 2 rows" in err and "line 2" in err


def test_analyze_vllm_minus_9999_sentinel_is_reported_not_a_crash(tmp_path, capsys):
    rows = [_row(), {"rollout_log_probs": [-9999.0, -1.0], "old_log_probs": [-0.1, -1.0]}]
    _write(tmp_path / "d.jsonl", rows)
    assert main(["analyze", str(tmp_path / "d.jsonl"), "--json", str(tmp_path / "a.json")]) == 0
    assert "inf" in capsys.readouterr().out  # ρ = e^9998.9 shown as inf in the token table
    json.loads((tmp_path / "a.json").read_text())
    for preset in ("decoupled_geo_rs", "decoupled_seq_is_rs"):
        assert main(["analyze", str(tmp_path / "d.jsonl"), "--preset", preset]) == 0


def test_analyze_json_into_a_directory_fails_before_the_report(tmp_path, capsys):
    _write(tmp_path / "d.jsonl", [_row()])
    assert main(["analyze", str(tmp_path / "d.jsonl"), "--json", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "is a directory" in captured.err and captured.out == ""


def test_openrlhf_bare_and_prefixed_keys_that_disagree_are_refused():
    from rollcorr.config.dialects import from_openrlhf

    with pytest.raises(ValueError, match="disagree"):
        from_openrlhf({"is_correction_enable": True, "algo.advantage.is_correction_enable": False})
    same = {"is_correction_enable": True, "algo.advantage.is_correction_enable": True}
    assert from_openrlhf(same) == from_openrlhf({"is_correction_enable": True})


# ---------------------------------------------------------------- library edges


def _loss_batch(dtype, log_ratio=30.0):
    torch.manual_seed(0)
    old = -torch.rand(4, 5, dtype=torch.float64) - 0.1
    log_prob = (old + log_ratio * (torch.arange(5) == 2)).clamp(max=-0.01).to(dtype)
    old = (old - log_ratio * (torch.arange(5) == 3)).to(dtype)
    return log_prob.requires_grad_(True), old, torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_loss_is_finite_for_low_precision_inputs_with_huge_log_ratios(dtype):
    from rollcorr.losses import LOSS_NAMES, LossConfig, policy_loss

    for name in LOSS_NAMES:
        log_prob, old, adv = _loss_batch(dtype)
        mask = torch.ones(4, 5, dtype=torch.bool)
        kwargs = dict(rollout_log_prob=old - 0.01) if name in ("ppo_is", "vanilla_is", "tis", "areal") else {}
        if name == "oapl":
            kwargs = dict(rollout_log_prob=old, rewards=adv, group_ids=torch.tensor([0, 0, 1, 1]))
        loss, _ = policy_loss(LossConfig(name=name), log_prob, old, adv, mask, **kwargs)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all(), name


def test_infinite_log_prob_on_a_valid_token_is_refused():
    from rollcorr.losses import LossConfig, policy_loss

    log_prob, old, adv = _loss_batch(torch.float32, 0.0)
    for bad in (-math.inf, math.inf):
        x = log_prob.detach().clone()
        x[1, 2] = bad
        with pytest.raises(ValueError, match="log_prob has NaN or ±inf"):
            policy_loss(LossConfig(name="dro"), x, old, adv, torch.ones(4, 5))


def test_wrong_length_advantages_name_the_argument():
    from rollcorr.losses import LossConfig, policy_loss

    log_prob, old, _ = _loss_batch(torch.float32, 0.0)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), expected \(4,\)"):
        policy_loss(LossConfig(name="ppo_clip"), log_prob, old, torch.ones(3), torch.ones(4, 5))


def test_fractional_mask_has_one_rule_in_both_entry_points():
    from rollcorr.config.presets import preset
    from rollcorr.correction import compute_correction
    from rollcorr.losses import LossConfig, policy_loss

    log_prob, old, adv = _loss_batch(torch.float32, 0.0)
    mask = torch.ones(4, 5)
    mask[0, 1] = 0.5
    with pytest.raises(ValueError, match="kept_mask has values other than 0 and 1"):  # the loss's argument
        policy_loss(LossConfig(name="ppo_clip"), log_prob, old, adv, mask)
    with pytest.raises(ValueError, match="response_mask has values other than 0 and 1"):
        compute_correction(old, old.detach() - 0.1, mask, preset("decoupled_token_is"))


def test_negative_staleness_is_refused():
    from rollcorr.config.presets import preset
    from rollcorr.correction import compute_correction

    _, old, _ = _loss_batch(torch.float32, 0.0)
    version = torch.full((4, 5), 3)
    version[2, 4] = 6  # a token from weights newer than the learner's
    with pytest.raises(ValueError, match=r"version is above current_version \(5\).*row 2, pos 4"):
        compute_correction(old, old - 0.1, torch.ones(4, 5), preset("decoupled_token_is"),
                           version=version, current_version=5)


def test_ess_is_finite_when_every_weight_is_zero():
    from rollcorr.config.correction import CorrectionConfig
    from rollcorr.correction import compute_correction

    _, old, _ = _loss_batch(torch.float32, 0.0)
    # IcePop-style mask mode with a band no token falls in: every weight is 0
    config = CorrectionConfig(is_level="token", is_mode="mask", is_lower=5.0, is_upper=6.0)
    res = compute_correction(old, old - 0.1, torch.ones(4, 5), config)
    ess = float(res.metrics["rollout_corr/rollout_is_eff_sample_size"])
    assert math.isfinite(ess) and ess == 0.0


def test_a_new_run_that_cannot_load_its_model_leaves_no_folder(tmp_path):
    out = tmp_path / "run"
    config = load_config(None, [*TINY, f"model.path={tmp_path / 'no_such_model'}", f"trainer.out={out}"])
    with pytest.raises(Exception):  # noqa: B017 (which error is the model loader's business)
        Trainer(config)
    assert not out.exists()


def test_diverged_weights_are_named_not_a_bare_torch_error(tmp_path, addition_model_dir, capsys):
    """A learning rate large enough to blow the logits up (finite but huge weights pass the step guard) ends
    the run with one line naming the cause: the sampler's NaN distribution, not torch.multinomial's message."""
    from rollcorr.cli import main

    out = tmp_path / "run"
    code = main(["train", f"model.path={addition_model_dir}", "model.sampler=hf:fp32", "optim.lr=1e10",
                 "trainer.steps=4", "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false",
                 "trainer.tensorboard=false", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "weights have diverged" in err and "optim.lr" in err and "Traceback" not in err


def test_nan_log_probs_in_the_learner_are_a_bad_step(tmp_path, addition_model_dir):
    """Learner log-probs that are NaN (diverged weights) make a bad step the run counts and stops on, not a
    ValueError from the loss's input check."""
    trainer = Trainer(
        tiny(
            tmp_path,
            addition_model_dir,
            "trainer.steps=3",
            "trainer.max_bad_steps=1",
            "algorithm.proximal.name=bypass",
        )
    )  # π_old = the sampler's log-probs (finite)
    nan_out = lambda module, inputs, output: output * float("nan")  # noqa: E731
    trainer.learner.model.model.norm.register_forward_hook(nan_out)  # the learner's forward only
    result = trainer.run()
    assert result.stopped and "non-finite log-prob" in result.stopped and "optim.lr=" in result.stopped
    assert result.steps == 1 and lines(result.run_dir)[-1]["train/skipped_updates"] == 1.0


def test_resuming_from_a_step_0_checkpoint_logs_step_0_once(tmp_path, addition_model_dir):
    """A SIGTERM during the first evaluation: a step-0 checkpoint and a step-0 metrics line. Resuming runs that
    evaluation again, so the kept line would be written twice: one step-0 line after the resume."""
    trainer = Trainer(tiny(tmp_path, addition_model_dir, "trainer.steps=50", "trainer.eval_every=10",
                           "task.eval_prompts=4"))
    evaluate = trainer._evaluate

    def evaluate_then_signal():
        out = evaluate()
        os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer._evaluate = evaluate_then_signal
    result = trainer.run()
    assert result.steps == 0 and [p.name for p in list_checkpoints(result.run_dir)] == ["step_000000"]
    assert [r["step"] for r in lines(result.run_dir)] == [0]
    assert resume(result.run_dir, "trainer.steps=2").steps == 2
    assert [r["step"] for r in lines(result.run_dir)].count(0) == 1


def test_guarded_step_limits_follow_each_weights_dtype():
    """Unusable means |w| > √max of the weight's own dtype: 1e20 is fine in float64 (limit 1.3e154) and not in
    float32 (limit 1.8e19); an empty tensor (a shard when N > rows) is nothing to check."""
    from rollcorr.train.step import GuardedStep

    wide = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    narrow, empty = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(0))
    opt = torch.optim.SGD([wide, narrow, empty], lr=1.0)
    step = GuardedStep(opt, [wide, narrow, empty])
    wide.grad, narrow.grad, empty.grad = torch.full((2,), -1e20, dtype=torch.float64), torch.zeros(2), torch.zeros(0)
    assert step() and float(wide[0]) == 1e20
    narrow.grad, wide.grad = torch.full((2,), -1e20), torch.zeros(2, dtype=torch.float64)
    assert not step() and torch.equal(narrow.detach(), torch.zeros(2))  # undone
    narrow.grad = torch.tensor([0.0, float("nan")])
    assert not step() and torch.equal(narrow.detach(), torch.zeros(2))
