"""``rollcorr train trainer.ranks=2`` end to end (two gloo processes under torch's launcher): metrics, sharded
checkpoints resumed at N=1 and back at N=2, and a killed rank that stops the run within a bounded time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "task.eval_prompts=8", "trainer.progress=false",
         "trainer.plot=false", "trainer.tensorboard=false", "trainer.eval_every=0"]


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def _train(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollcorr", "train", *args], capture_output=True, text=True,
                          env=_env(), timeout=timeout)


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["shard", "replicate"])
def test_two_ranks_train_and_resume_at_one_and_back(tmp_path, layout):
    """Sharded: the checkpoint's weights and AdamW state in DCP's format, read by one process. Replicated: one
    process's checkpoint, written by rank 0; every rank sampled its share of each batch. Both resume at N=1 and
    back at N=2."""
    run_dir = tmp_path / "run"
    done = _train("trainer.ranks=2", "trainer.steps=3", "trainer.checkpoint_every=2", f"trainer.data_parallel={layout}",
                  *SMALL, "--out", str(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "greedy accuracy" in done.stdout and done.stdout.count("run folder:") == 1  # rank 0 alone prints
    said = {"shard": "sharded over 2 ranks by FSDP2 (trainer.data_parallel=shard; its training state 15 MiB); rank "
                     "0 samples every batch; the trainer's collectives over shared memory",
            "replicate": "replicated on 2 ranks (one gradient all-reduce per optimizer step; trainer.data_parallel="
                         "replicate; its training state 15 MiB); every rank samples its share of each batch; "
                         "the trainer's collectives over shared memory"}
    assert f"data-parallel learner: {said[layout]}" in done.stdout + done.stderr
    assert [r["learner/ranks"] for r in _steps(run_dir)] == [2.0, 2.0, 2.0]
    last = run_dir / "checkpoints" / "step_000003"
    assert (last / "model" / "config.json").is_file()
    assert (last / "dcp" / ".metadata").is_file() is (layout == "shard")

    from safetensors.torch import load_file

    from rollcorr.checkpoint import load_checkpoint, load_sharded
    from rollcorr.engines import make_learner
    from rollcorr.engines.lora import load_trainable_state_dict

    # the checkpoint read by one process (no group) equals the full weights rank 0 exported
    learner = make_learner("hf:fp32")
    optimizer = torch.optim.AdamW(learner.model.parameters(), lr=1e-3)
    if layout == "shard":
        load_sharded(last, learner.model, optimizer)
    else:
        state = load_checkpoint(last)
        load_trainable_state_dict(learner.model, state["model"])  # model/'s weights: the tied lm-head once
        optimizer.load_state_dict(state["optimizer"])
    exported = load_file(last / "model" / "model.safetensors")
    for name, value in learner.model.state_dict().items():
        if name in exported:
            torch.testing.assert_close(value, exported[name], rtol=0, atol=0)
    assert optimizer.state, "the AdamW state was not restored"

    one = _train("--resume", str(run_dir), "trainer.steps=4", "trainer.ranks=1")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resuming" in one.stdout + one.stderr
    back = _train("--resume", str(run_dir), "trainer.steps=5", "trainer.ranks=2")
    assert back.returncode == 0, back.stderr[-3000:]
    assert [r["learner/ranks"] for r in _steps(run_dir)] == [2.0, 2.0, 2.0, 1.0, 2.0]
    assert [r["step"] for r in _steps(run_dir)] == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("layout", "share"), [("shard", 0.5), ("replicate", 1.0)])
def test_held_weight_strategy_trains_and_resumes_across_rank_counts(tmp_path, layout, share):
    """EWMA on stale tokens (simulated_async) at N=2, resumed at N=1 and back at N=2 by the trainer itself:
    sharded, the average's shards go through the sharded checkpoint and each rank holds about half of one
    process's copy; replicated, each rank holds a whole copy and rank 0 checkpoints it."""
    run_dir = tmp_path / "run"
    args = ["trainer.mode=simulated_async", "algorithm.proximal.name=ewma", "trainer.checkpoint_every=2",
            "trainer.mini_batches=1", f"trainer.data_parallel={layout}", *SMALL]
    done = _train("trainer.ranks=2", "trainer.steps=3", *args, "--out", str(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    one = _train("--resume", str(run_dir), "trainer.steps=4", "trainer.ranks=1")
    assert one.returncode == 0, one.stderr[-3000:]
    back = _train("--resume", str(run_dir), "trainer.steps=5", "trainer.ranks=2")
    assert back.returncode == 0, back.stderr[-3000:]
    steps = _steps(run_dir)
    assert [r["learner/ranks"] for r in steps] == [2.0, 2.0, 2.0, 1.0, 2.0]
    assert steps[-1]["proximal/ewma_beta"] > 0  # the average is not the live weights
    whole = steps[3]["proximal/extra_bytes"]
    assert all((share - 0.05) * whole <= r["proximal/extra_bytes"] <= (share + 0.05) * whole
               for r in steps if r["learner/ranks"] == 2)
    # the resumed runs continue the average (its weight Σβ^j), not a fresh copy of the live weights (weight 1)
    assert steps[4]["proximal/ewma_weight"] >= steps[3]["proximal/ewma_weight"] > 1.0

def _workers(launcher: int) -> dict[int, int]:
    """rank → pid of the launcher's worker processes (from their environment)."""
    found = {}
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        try:
            env = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{child}/environ").read_text().split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(child)
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers through /proc")
def test_killed_rank_stops_every_rank_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # steps enough that the run is still going when a rank is killed (it is, after its first checkpoints)
    args = [sys.executable, "-m", "rollcorr", "train", "trainer.ranks=2", "trainer.steps=5000",
            "trainer.checkpoint_every=1", *SMALL, "--out", str(run_dir)]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 400
        # any committed checkpoint (the run keeps the newest two: step_000001 may be gone by the next look)
        while not list((run_dir / "checkpoints").glob("step_*")):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 400 s"
            time.sleep(0.5)
        workers = _workers(launcher.pid)
        assert sorted(workers) == [0, 1]
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        stopped = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert stopped < 60, f"the run took {stopped:.0f} s to stop after a rank died"
    assert launcher.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("rollcorr train: rank")]
    assert len(lines) == 1 and "rank 1 of 2 failed: killed by SIGKILL" in lines[0], err[-3000:]
    assert f"--resume {run_dir}" in lines[0]
    for pid in workers.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    step = max(r["step"] for r in _steps(run_dir))
    resumed = _train("--resume", str(run_dir), f"trainer.steps={step + 1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max(r["step"] for r in _steps(run_dir)) == step + 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_signal_to_one_rank_stops_every_rank_and_the_launcher_says_which(tmp_path):
    """SIGTERM to rank 1 alone (a scheduler preempting one process): the ranks agree to stop after the same step,
    the checkpoint is written, and the launcher names the signal — not "failed" with an error "printed above"
    that nobody printed."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "rollcorr", "train", "trainer.ranks=2", "trainer.steps=500",
            "trainer.checkpoint_every=0", *SMALL, "--out", str(run_dir)]
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((run_dir / "metrics.jsonl").is_file() and _steps(run_dir)):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            time.sleep(0.5)
        assert _steps(run_dir), "no step was trained"
        os.kill(_workers(launcher.pid)[1], signal.SIGTERM)
        _, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and "printed above" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("rollcorr train: ")]
    assert len(said) == 1 and "SIGTERM: every rank stopped after the same step" in said[0], err
    assert f"--resume {run_dir}" in said[0]
    assert "SIGTERM on another rank at step" in err  # rank 0's own account of why it stopped
    from rollcorr.checkpoint import list_checkpoints

    (checkpoint,) = list_checkpoints(run_dir)
    assert int(checkpoint.name.split("_")[1]) == max(r["step"] for r in _steps(run_dir))


def test_failure_line_names_the_exception_the_signal_or_the_exit_code(tmp_path, monkeypatch):
    """The launcher's one line reads a raising rank's error file as torch's ``record`` writes it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure, record

    from rollcorr.distributed.launch import _cause

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record
    def rank_body():
        raise RuntimeError("rank 1 could not read its shard")

    with pytest.raises(RuntimeError):
        rank_body()
    raised = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))
    assert _cause(raised) == "RuntimeError: rank 1 could not read its shard"
    missing = str(tmp_path / "none.json")
    assert _cause(ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file=missing)) == "killed by SIGKILL"
    assert _cause(ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=missing)).startswith(
        "exited with code 2"
    )


def test_the_rank_named_is_the_one_that_died_not_one_the_agent_stopped(tmp_path):
    """A rank killed (SIGKILL) makes the agent stop the others with SIGTERM, and the others' collectives fail;
    whichever failure it records first, the launcher names the killed rank. Only when every rank was stopped so
    is one of them named."""
    import signal as signals

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from rollcorr.distributed.launch import _root_failure

    missing = str(tmp_path / "none.json")
    stopped = ProcessFailure(local_rank=0, pid=1, exitcode=-int(signals.SIGTERM), error_file=missing)
    killed = ProcessFailure(local_rank=1, pid=2, exitcode=-int(signals.SIGKILL), error_file=missing)
    stopped.timestamp, killed.timestamp = 1, 2  # the agent's SIGTERM recorded first: the race seen in CI
    rank, failure = _root_failure(ChildFailedError("train", {0: stopped, 1: killed}))
    assert rank == 1 and failure is killed
    rank, _ = _root_failure(ChildFailedError("train", {0: stopped}))
    assert rank == 0
    # rank 0's collective failed because rank 1 was killed, both stamped in the same second: the killed one
    failed = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=missing)
    failed.timestamp = killed.timestamp
    rank, failure = _root_failure(ChildFailedError("train", {0: failed, 1: killed}))
    assert rank == 1 and failure is killed
    rank, failure = _root_failure(ChildFailedError("train", {0: failed}))  # an error alone: that rank
    assert rank == 0 and failure is failed


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_launcher_stops_every_rank_with_a_checkpoint_in_one_line(tmp_path, signum):
    """SIGTERM or SIGHUP to `rollcorr train trainer.ranks=2`: the agent asks each rank to stop (each finishes its
    step and the checkpoint is written), and the launcher says so in one line — no torch-elastic traceback."""
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "rollcorr", "train", "trainer.ranks=2", "trainer.steps=500",
                                 "trainer.checkpoint_every=0", *SMALL, f"trainer.out={run_dir}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((run_dir / "metrics.jsonl").is_file() and _steps(run_dir)):
            time.sleep(0.5)
        assert _steps(run_dir), "no step was trained"
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("rollcorr train: ")]
    assert said and f"{signal.Signals(signum).name}: every rank was asked to stop" in said[-1]
    from rollcorr.checkpoint import list_checkpoints

    assert list_checkpoints(run_dir), "no checkpoint written on the way out"


def _torchrun_per_rank(tmp_path: Path, per_rank: dict[int, list[str]], timeout: float = 300):
    """torchrun --nproc-per-node 2 of a script that runs `rollcorr train` with each rank's own arguments (a user
    whose ranks were started differently)."""
    script = tmp_path / "per_rank.py"
    script.write_text("import os, sys\nfrom rollcorr.cli import main\n"
                      f"ARGS = {per_rank!r}\n"
                      "sys.exit(main(['train', *ARGS[int(os.environ['RANK'])]]))\n")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=_env(), timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ranks_started_differently_stop_before_training_naming_the_key(tmp_path):
    """Another learning rate on rank 1, another step count, or --resume on one rank and --out on the other:
    every rank stops before training, and one line names the first key that differs."""
    base = ["trainer.steps=3", *SMALL]
    cases = {
        "optim.lr": ({0: [*base, "optim.lr=0.0003"], 1: [*base, "optim.lr=0.3"]}, "optim.lr is 0.3 there, 0.0003 on rank 0"),
        "trainer.steps": ({0: [*base, "trainer.steps=4"], 1: [*base, "trainer.steps=5"]}, "trainer.steps is 5 there"),
    }
    for name, (per_rank, message) in cases.items():
        out = tmp_path / name
        per_rank = {r: [*args, f"trainer.out={out}"] for r, args in per_rank.items()}
        done = _torchrun_per_rank(tmp_path, per_rank)
        assert done.returncode != 0, name
        said = [line for line in done.stderr.splitlines() if "was started differently from rank 0" in line]
        assert said and message in said[0], done.stderr[-3000:]
        # (torchrun itself reports a failed worker with its own traceback; none comes from rollcorr)
        assert "rollcorr/" not in "".join(line for line in done.stderr.splitlines() if line.strip().startswith("File"))
        assert not (out / "metrics.jsonl").exists() or not _steps(out)  # nothing trained


def test_a_distributed_environment_left_in_the_shell_is_one_line_at_once(tmp_path):
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (or only RANK / WORLD_SIZE / LOCAL_RANK) left in the environment
    of a plain `rollcorr train`: one line naming them, exit 2, within seconds — never a wait for peers."""
    stale = [{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"},
             {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}]
    for extra in stale:
        for ranks in ("1", "2"):
            env = {**_env(), **extra}
            env.pop("TORCHELASTIC_RUN_ID", None)
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "rollcorr", "train", f"trainer.ranks={ranks}",
                                   "trainer.steps=1", *SMALL, f"trainer.out={tmp_path / 'run'}"],
                                  capture_output=True, text=True, env=env, timeout=120)
            assert done.returncode == 2 and time.monotonic() - start < 60
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and "not started by torchrun" in lines[0] and "unset" in lines[0], done.stderr
            assert all(key in lines[0] for key in extra)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_too_few_file_descriptors_for_the_launcher_is_one_line(tmp_path):
    """`ulimit -n` 12 to 24 under `trainer.ranks=2`: the launcher's own store and sockets run out (c10d's
    "Failed to init uv loop", EMFILE): one rollcorr line naming the limit, never the agent's traceback."""
    import resource

    failed = 0
    for n in (12, 14, 16, 20, 24):  # 12-14: c10d retried its connections for minutes (a hang), then a traceback

        def limit(n=n):
            resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

        done = subprocess.run([sys.executable, "-m", "rollcorr", "train", "trainer.ranks=2", "trainer.steps=1", *SMALL,
                               f"trainer.out={tmp_path / f'run{n}'}"], capture_output=True, text=True, env=_env(),
                              preexec_fn=limit, timeout=60)
        if done.returncode == 0:
            continue
        failed += 1
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        said = [line for line in done.stderr.splitlines() if line.startswith("rollcorr train:")]
        assert len(said) == 1 and ("ulimit -n" in said[0] or "too many open files" in said[0].lower()), done.stderr
    assert failed, "no limit was low enough to fail: the case went untested"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_refusal_under_the_launcher_never_ends_in_an_abort_at_exit(tmp_path):
    """A worker leaving with gloo's group alive aborted now and then at exit ("terminate called without an active
    exception", SIGABRT: about one refusal in four here), and the launcher then said "rank 1 of 2 failed: killed by
    SIGABRT ... continue with --resume" after the refusal's own line. Each worker leaves the group at exit."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file\n")
    for _ in range(8):
        done = _train("trainer.ranks=2", "trainer.steps=1", *SMALL, f"trainer.out={out}", timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "terminate called" not in done.stderr and "SIGABRT" not in done.stderr, done.stderr[-3000:]
        said = [line for line in done.stderr.splitlines() if line.startswith("rollcorr train:")]
        assert len(said) == 1 and "holds no run" in said[0] and "--resume" not in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_one_process_weights_reach_a_sharded_model_in_its_own_order_tied_once():
    """A one-process checkpoint's model/ weights (a safetensors file read back: its own key order, which differs
    between processes, and the tied lm-head saved once) are handed to set_model_state_dict in the model's order
    with every name: each rank scatters the same tensors in the same order (a mismatch aborted rank 1)."""
    import random

    from rollcorr.distributed.checkpoint import in_model_order
    from rollcorr.engines import make_learner

    model = make_learner("hf:fp32").model
    full = model.state_dict()
    saved = [name for name in full if name != "lm_head.weight"]  # the tied head, saved once
    random.Random(0).shuffle(saved)
    ordered = in_model_order(model, {name: full[name] for name in saved})
    assert list(ordered) == list(full)
    assert ordered["lm_head.weight"] is full["model.embed_tokens.weight"] or torch.equal(
        ordered["lm_head.weight"], full["lm_head.weight"])
