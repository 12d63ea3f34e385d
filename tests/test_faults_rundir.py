"""Hostile run folders and outputs: nothing in a run folder is followed out of it, a corrupt checkpoint is
caught by its checksums, a run never continues on a lie (issue: run folders and inputs you can trust)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch

from rollcorr.checkpoint import (
    MANIFEST_FILE,
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
from rollcorr.safe_io import UnsafePathError, atomic_write_bytes, open_inside, write_output, writes_in_place
from rollcorr.train.config import load_config
from rollcorr.train.loop import Trainer, run
from rollcorr.train.rundir import RunFolderError, RunLock, new_run_dir

pytestmark = pytest.mark.usefixtures("alternating_rewards")

TINY = ["task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.mini_batches=1", "optim.lr=1e-3"]


def tiny(tmp_path, model_dir, *overrides, name="run"):
    return load_config(None, [*TINY, f"model.path={model_dir}", f"trainer.out={tmp_path / name}", *overrides])


def resume(run_dir: Path, *overrides):
    return run(load_config(run_dir / "config.yaml", list(overrides), inside_run=True), resume=run_dir)


def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory, addition_model_dir):
    """A finished 2-step run (checkpoints at 1 and 2), kept pristine; each test damages a fresh copy at the
    run's own path (``trainer.out`` cannot change on resume)."""
    base = tmp_path_factory.mktemp("finished")
    result = run(tiny(base, addition_model_dir, "trainer.steps=2", "trainer.checkpoint_every=1"))
    return result.run_dir, result.run_dir.rename(base / "pristine")


@pytest.fixture
def run_copy(finished):
    folder, pristine = finished
    shutil.rmtree(folder, ignore_errors=True)
    if folder.is_symlink() or folder.exists():
        folder.unlink()
    shutil.copytree(pristine, folder, symlinks=True, ignore=shutil.ignore_patterns(".lock"))
    return folder


# ---------------------------------------------------------------- nothing is followed out of a run folder


def test_lock_file_link_never_touches_its_target(tmp_path, run_copy, addition_model_dir, capsys):
    target = victim(tmp_path)
    (run_copy / ".lock").symlink_to(target)
    assert main(["train", "--resume", str(run_copy)]) == 2  # finished run: used to truncate the victim
    assert "symbolic link" in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".lock").symlink_to(target)
    assert (
        main(["train", "--out", str(fresh), *TINY, f"model.path={addition_model_dir}", "trainer.steps=1"])
        == 2
    )
    assert "symbolic link" in capsys.readouterr().err
    assert target.read_text() == "precious\n"


def test_lock_file_fifo_or_hard_link_is_refused_without_truncating(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    os.mkfifo(folder / ".lock")
    with pytest.raises(RunFolderError, match="is a FIFO"):  # O_NONBLOCK: never hangs
        RunLock(folder)
    (folder / ".lock").unlink()
    target = victim(tmp_path)
    os.link(target, folder / ".lock")
    with pytest.raises(RunFolderError, match="hard links"):
        RunLock(folder)
    assert target.read_text() == "precious\n"


def test_lock_that_cannot_be_created_is_one_line_without_a_cleanup_error(tmp_path, recwarn):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunFolderError, match="cannot create its lock file"):
        RunLock(tmp_path / "file")  # ENOTDIR here; EROFS on a read-only mount takes the same path
    import gc

    gc.collect()
    assert not [w for w in recwarn if "AttributeError" in str(w.message)]


def test_metrics_link_is_refused_on_resume(tmp_path, run_copy, capsys):
    target = victim(tmp_path)
    (run_copy / "metrics.jsonl").unlink()
    (run_copy / "metrics.jsonl").symlink_to(target)
    assert main(["train", "--resume", str(run_copy), "trainer.steps=3"]) == 2
    assert "metrics.jsonl: is a symbolic link" in capsys.readouterr().err
    assert target.read_text() == "precious\n"


def test_metrics_directory_is_one_line(run_copy, capsys):
    (run_copy / "metrics.jsonl").unlink()
    (run_copy / "metrics.jsonl").mkdir()
    assert main(["train", "--resume", str(run_copy), "trainer.steps=3"]) == 2
    assert "metrics.jsonl: is a directory" in capsys.readouterr().err


def test_checkpoints_link_is_refused_and_its_target_kept(tmp_path, run_copy, capsys):
    outside = tmp_path / "outside"
    shutil.move(run_copy / "checkpoints", outside)
    (run_copy / "checkpoints").symlink_to(outside)
    before = sorted(p.name for p in outside.iterdir())
    assert main(["train", "--resume", str(run_copy), "trainer.steps=6"]) == 2
    assert "checkpoints: is not a directory (a symbolic link)" in capsys.readouterr().err
    assert sorted(p.name for p in outside.iterdir()) == before  # nothing written or pruned there


def test_checkpoint_entry_link_is_refused(tmp_path, run_copy):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (run_copy / "checkpoints" / ".tmp-step_000003").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        save_checkpoint(run_copy, 3, {"step": 3})
    assert list(outside.iterdir()) == []


def test_config_link_is_refused_on_resume(tmp_path, run_copy, capsys):
    real = tmp_path / "elsewhere.yaml"
    shutil.move(run_copy / "config.yaml", real)
    (run_copy / "config.yaml").symlink_to(real)
    assert main(["train", "--resume", str(run_copy)]) == 2
    assert "config.yaml: is a symbolic link" in capsys.readouterr().err


def test_planted_temp_names_are_never_written_through(tmp_path):
    target = victim(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml.tmp").symlink_to(target)  # the old fixed temp name
    (folder / "metrics.jsonl").symlink_to(target)
    atomic_write_bytes(folder / "metrics.jsonl", b"new\n")  # replaces the link, not its target
    assert target.read_text() == "precious\n" and (folder / "metrics.jsonl").read_bytes() == b"new\n"
    with pytest.raises(UnsafePathError, match="symbolic link"):
        open_inside(folder / "config.yaml.tmp", os.O_WRONLY | os.O_TRUNC)
    assert target.read_text() == "precious\n"


def test_outputs_that_are_fifos_or_streams_are_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_output(fifo, b'{"a": 1}\n')
    reader.join(timeout=60)
    assert got == [b'{"a": 1}\n'] and stat.S_ISFIFO(os.stat(fifo).st_mode)  # still a FIFO
    assert (
        writes_in_place("/dev/stdout")
        and writes_in_place("/dev/null")
        and not writes_in_place(tmp_path / "x")
    )


def test_analyze_json_into_a_fifo_keeps_the_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    assert main(["analyze", "--json", str(fifo)]) == 0
    reader.join(timeout=60)
    assert json.loads(got[0])["config_source"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_audit_out_that_is_the_log_file_is_refused_before_work(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text('{"rollout_log_probs": [-1.0], "old_log_probs": [-1.1]}\n')
    assert main(["audit", "--from-log", str(log), "--out", str(log)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert log.read_text().startswith('{"rollout_log_probs"')
    assert main(["audit", "--from-log", str(log), "--out", "/proc/rollcorr-report"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the report" in err and "Traceback" not in err


# ---------------------------------------------------------------- checkpoints prove their integrity


def test_flipped_bit_in_the_newest_checkpoint_falls_back_with_a_line(run_copy, capsys):
    newest = checkpoint_dir(run_copy, 2) / STATE_FILE
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in tensor data: torch.load alone would not notice
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(newest.parent)
    capsys.readouterr()
    assert resume(run_copy, "trainer.steps=3").steps == 3
    out = capsys.readouterr().out
    assert (
        "skipped checkpoint step_000002" in out and "checksum mismatch" in out and "from step_000001" in out
    )


def test_manifest_is_written_with_every_checkpoint(run_copy):
    for path in list_checkpoints(run_copy):
        files = json.loads((path / MANIFEST_FILE).read_text())["files"]
        assert STATE_FILE in files and "model/model.safetensors" in files


def test_nan_weight_in_a_checkpoint_is_caught_at_load(run_copy, capsys):
    path = checkpoint_dir(run_copy, 2)
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model" / "model.safetensors")  # a full learner's weights: model/'s, saved once
    next(iter(weights.values())).view(-1)[0] = float("nan")
    save_file(weights, path / "model" / "model.safetensors", metadata={"format": "pt"})
    write_manifest(path)  # checksums match: the NaN itself is caught
    with pytest.raises(CheckpointError, match="non-finite value"):
        load_checkpoint(path)
    capsys.readouterr()
    assert resume(run_copy, "trainer.steps=3").steps == 3
    assert "non-finite value" in capsys.readouterr().out


def test_full_disk_in_torch_save_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {**dict.fromkeys(STATE_KEYS), "step": 1, "model": {}})

    def inline_container_error(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", inline_container_error)
    with pytest.raises(CheckpointError, match=r"cannot write the checkpoint .*step_000001 kept as it was"):
        save_checkpoint(tmp_path, 2, {"step": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


# ---------------------------------------------------------------- a run never continues on a lie


def test_metrics_without_any_checkpoint_refuse_to_restart(run_copy, capsys):
    before = (run_copy / "metrics.jsonl").read_text()
    shutil.rmtree(run_copy / "checkpoints")
    assert main(["train", "--resume", str(run_copy), "trainer.steps=3"]) == 2
    err = capsys.readouterr().err
    assert "refusing to discard them" in err and "--overwrite" in err
    assert (run_copy / "metrics.jsonl").read_text() == before


def test_run_folder_removed_mid_run_stops(tmp_path, addition_model_dir):
    trainer = Trainer(tiny(tmp_path, addition_model_dir, "trainer.steps=20"))
    one_step = trainer._one_step

    def step_then_remove():
        if trainer.step == 2:
            shutil.rmtree(trainer.run_dir)
        return one_step()

    trainer._one_step = step_then_remove
    with pytest.raises(RunFolderError, match="removed while the run was going"):
        trainer.run()
    assert not trainer.run_dir.exists()  # not recreated (checkpoints/ used to come back)


def test_overflowing_step_in_metrics_is_a_dropped_line_on_resume(run_copy, capsys):
    with (run_copy / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1e400}\n')
    assert resume(run_copy, "trainer.steps=3").steps == 3
    assert "1 unreadable line(s)" in capsys.readouterr().out


def test_out_is_a_path_never_yaml(tmp_path):
    for name in ("run #2", "null", "2024-01-01", "~x"):
        config = load_config(None, [f"trainer.out={tmp_path / name}"])
        assert new_run_dir(config.trainer.out) == tmp_path / name
    assert load_config(None, ["trainer.out=null"]).trainer.out == "null"
    assert new_run_dir("~") == Path.home() and new_run_dir("~/r") == Path.home() / "r"  # ~ is expanded


def test_out_given_on_the_command_line_keeps_its_name(tmp_path, addition_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("run #2", "2024-01-01", "null"):
        assert (
            main(["train", "--out", name, *TINY, f"model.path={addition_model_dir}", "trainer.steps=1"]) == 0
        )
        assert (tmp_path / name / "checkpoints" / "step_000001").is_dir()


def test_file_size_limit_is_one_line_and_keeps_the_last_checkpoint(tmp_path, addition_model_dir):
    """A real EFBIG: `ulimit -f` below the size of a checkpoint; the run stops with one line, nothing lost."""
    import resource
    import signal
    import subprocess
    import sys

    def limit():  # the shell's `ulimit -f 600` (KiB), with SIGXFSZ ignored so the write fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (600 * 1024, 600 * 1024))

    out = tmp_path / "run"
    args = [*TINY, f"model.path={addition_model_dir}", "trainer.steps=2", "trainer.checkpoint_every=1"]
    proc = subprocess.run([sys.executable, "-m", "rollcorr.cli", "train", "--out", str(out), *args],
                          capture_output=True, text=True, preexec_fn=limit, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode in (1, 2), proc.stderr[-2000:]
    assert (
        "file too large" in proc.stderr or "file-size limit" in proc.stderr
    ) and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert not [
        p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")
    ]  # no half-written copy
    saved = list_checkpoints(out)  # the line says what is there, never a checkpoint that is not
    assert saved or "keeps its last checkpoint" not in proc.stderr, proc.stderr


def test_out_that_cannot_be_created_is_one_line(tmp_path, addition_model_dir, capsys):
    assert main(["train", "--out", "/proc/rollcorr-run", *TINY, f"model.path={addition_model_dir}"]) == 2
    assert "cannot create the run folder" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert (
        main(["train", "--out", str(tmp_path / "file" / "run"), *TINY, f"model.path={addition_model_dir}"])
        == 2
    )
    assert "cannot create the run folder" in capsys.readouterr().err


def test_ctrl_c_during_start_up_is_one_line_and_leaves_no_folder(tmp_path, addition_model_dir, capsys,
                                                                  monkeypatch):
    import rollcorr.train.build

    def interrupted(*args, **kwargs):  # what a Ctrl-C raises while the learner loads
        raise KeyboardInterrupt

    monkeypatch.setattr(rollcorr.train.build, "make_learner", interrupted)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, f"model.path={addition_model_dir}"]) == 130
    assert capsys.readouterr().err.strip() == "rollcorr train: interrupted" and not out.exists()


def test_read_only_config_is_never_replaced_by_a_resume(run_copy, capsys):
    config = run_copy / "config.yaml"
    before = config.read_bytes()
    config.chmod(0o444)
    inode = config.stat().st_ino
    assert main(["train", "--resume", str(run_copy), "trainer.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.yaml is read-only" in err[0] and "make it writable" in err[0]
    assert config.read_bytes() == before and config.stat().st_ino == inode  # not replaced by a rename either
    config.chmod(0o644)  # made writable, the same resume runs and records its change
    assert resume(run_copy, "trainer.steps=3").steps == 3
    assert "steps: 3" in config.read_text()


def test_a_resume_that_fails_to_start_leaves_config_yaml_as_it_was(run_copy, monkeypatch):
    config = run_copy / "config.yaml"
    before = config.read_bytes()

    def fail(*args, **kwargs):
        raise RuntimeError("the learner could not be built")  # any failure while building the run

    monkeypatch.setattr("rollcorr.train.loop.Trainer._build", fail)
    with pytest.raises(RuntimeError, match="could not be built"):
        resume(run_copy, "trainer.steps=3")
    assert config.read_bytes() == before


def test_audit_out_of_file_descriptors_is_one_line_and_leaves_no_half_report(tmp_path):
    """`ulimit -n 5` … `8` on `rollcorr audit --from-log`: each either writes the whole report or stops with one
    line and leaves no folder — never a chained traceback, never a stray PNG in a report folder."""
    import resource
    import subprocess
    import sys

    from rollcorr.dumps import write_dump

    dump = tmp_path / "dump.jsonl"
    log_prob = -torch.rand(16, 8, generator=torch.Generator().manual_seed(0))
    write_dump(dump, rollout_log_prob=log_prob, learner_log_prob=log_prob - 0.01, response_mask=torch.ones(16, 8))
    failed = 0
    for n in range(5, 9):
        out = tmp_path / f"report{n}"

        def limit(n=n):
            resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

        proc = subprocess.run([sys.executable, "-m", "rollcorr.cli", "audit", "--from-log", str(dump), "--out",
                               str(out)], capture_output=True, text=True, preexec_fn=limit, timeout=300)
        if proc.returncode == 0:
            assert {"summary.json", "report.html"} <= {p.name for p in out.iterdir()}
            continue
        failed += 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "too many open files" in lines[0], proc.stderr[-2000:]
        assert not out.exists(), sorted(p.name for p in out.iterdir())
    assert failed, "no limit was low enough to fail: the case went untested"


def test_memory_limit_is_one_line_at_any_moment(tmp_path):
    """`ulimit -v` of 0.6, 0.9 and 1.2 GB on `rollcorr train` (they run out while importing torch, while
    building the models, or while training): each is one line saying it ran out of memory, never a
    MemoryError or allocator traceback, and what was written before stays readable."""
    import resource
    import subprocess
    import sys

    failed = 0
    for gib in (0.6, 0.9, 1.2):
        out = tmp_path / f"run{gib}"

        def limit(size=int(gib * 2**30)):
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

        proc = subprocess.run([sys.executable, "-m", "rollcorr.cli", "train", "trainer.steps=2", "trainer.eval_every=0",
                               "trainer.progress=false", "trainer.plot=false", f"trainer.out={out}"],
                              capture_output=True, text=True, preexec_fn=limit, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode == 0:
            continue
        failed += 1
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("rollcorr train: out of memory (") and "Traceback" not in proc.stderr
    assert failed, "no limit was low enough to fail: the case went untested"


def test_a_lost_memory_error_under_a_limit_is_out_of_memory():
    """Under ``ulimit -v`` an allocation can fail without a MemoryError: the loader's "ImportError: ... failed to
    map segment from shared object" (importing safetensors at 0.9 GB). Under an address-space limit that is out
    of memory; without one it is a real import error and is not hidden, nor is a SystemError or RuntimeError far
    from the limit (only at the limit, as inside torch's import at 0.55-0.6 GB, are they the allocation's)."""
    import subprocess
    import sys

    check = ("import resource; from rollcorr.cli import out_of_memory; "
             "errs = [ImportError('x.so: failed to map segment from shared object'), "
             "SystemError('error return without exception set'), RuntimeError('Unable to instantiate PyTypeObject')]; "
             "soft, hard = resource.getrlimit(resource.RLIMIT_AS); "
             "free = [out_of_memory(e) for e in errs] if soft == resource.RLIM_INFINITY else [False] * 3; "
             "resource.setrlimit(resource.RLIMIT_AS, (2**45 if hard == resource.RLIM_INFINITY else hard, hard)); "
             "print(*free, *[out_of_memory(e) for e in errs])")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "False", "True", "False", "False"]


def test_out_of_memory_while_saying_so_still_says_it_in_one_line():
    """At the limit the handler can run out too (the run folder's cleanup raised a second MemoryError; then the
    check or the message did: 2-3 in 10 runs at 0.73 GiB printed a half traceback and "lost sys.stderr"): the
    line made before the command ran is written as it is, and the process leaves with 1."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        import rollcorr.cli as cli
        real_import = cli.importlib.import_module

        class Command:  # analyze, whose run fails at the limit
            add_arguments = staticmethod(lambda parser: real_import("rollcorr.analyze.cli").add_arguments(parser))

            @staticmethod
            def run(args):
                raise MemoryError

        def exhausted(err):  # and so does the handler's own check
            raise MemoryError

        cli.importlib.import_module = lambda name: Command
        cli.out_of_memory = exhausted
        sys.exit(cli.main(["analyze", "dump.jsonl"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == ("rollcorr analyze: out of memory; nothing is half-written (a training run's checkpoints "
                           "are whole: --resume it with more memory)\n")


def test_a_stopped_run_says_what_its_folder_holds(tmp_path, run_copy):
    """The line after a failed write or a dead sampler names the newest checkpoint that is there, says when there
    is none, and names no folder it was not given."""
    import argparse

    from rollcorr.train.cli import _resume_hint

    def hint(resume=None, out=None):
        return _resume_hint(argparse.Namespace(resume=resume, out=out))

    newest = list_checkpoints(run_copy)[-1].name
    assert hint(resume=run_copy) == f"{run_copy} keeps its last checkpoint ({newest}): continue with rollcorr " \
                                    f"train --resume {run_copy}"
    assert hint(out=tmp_path / "new") == f"{tmp_path / 'new'} holds no checkpoint yet"
    started = tmp_path / "started"  # a run that had begun (its config.yaml is written) but saved nothing
    started.mkdir()
    (started / "config.yaml").write_text((run_copy / "config.yaml").read_text())
    assert hint(out=started) == f"{started} holds no checkpoint yet: rollcorr train --resume {started} starts " \
                                "it again from step 0"
    assert "RUN_DIR" in hint() and "keeps" not in hint()


@pytest.mark.slow
def test_memory_limit_swept_finely_through_the_imports_is_one_line(tmp_path):
    """`ulimit -v` from 0.55 to 0.75 GB in 10 MB steps, where the limit lands inside the imports: besides
    MemoryError, a compiled module that cannot be mapped (ImportError "failed to map segment from shared
    object"), the import system's ENOMEM (OSError) and CPython's own "error return without exception set"
    (SystemError) each were a 16-42-line traceback; every one is now the out-of-memory line."""
    import resource
    import subprocess
    import sys

    for mb in range(550, 751, 10):

        def limit(size=mb * 2**20):
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

        proc = subprocess.run([sys.executable, "-m", "rollcorr.cli", "train", "trainer.steps=2", "trainer.eval_every=0",
                               "trainer.progress=false", "trainer.plot=false", f"trainer.out={tmp_path / f'run{mb}'}"],
                              capture_output=True, text=True, preexec_fn=limit, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode in (0, 1) and len(lines) <= 1 and "Traceback" not in proc.stderr, (mb, proc.stderr[-3000:])
        assert proc.returncode == 0 or "out of memory" in lines[0] or "cannot allocate memory" in lines[0], (mb, lines)
