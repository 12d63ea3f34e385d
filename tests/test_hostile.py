"""Hostile input, one row per surface: each test builds what an attacker or an accident would hand rollcorr and
checks the one thing that must hold (nothing runs, one line names the problem, the run stops or goes on as said).

The table (a new surface gets its section and its rows here, named ``test_<surface>__<case>``):

    surface                         what must hold
    ------------------------------  ------------------------------------------------------------------------------
    checkpoint (DCP index, values)  a crafted pickle in ``dcp/.metadata`` or a DCP value runs nothing; a resume
                                    falls back to the older checkpoint with a line naming the refused global
    run config (--from-run,         a reward module named by a run folder's config.yaml is not imported unless the
      --resume)                     user named or imported it; one line says how
    reward (user code)              a reward that raises, returns None / text / NaN / inf / out of [0, 1], has the
                                    wrong signature or hangs: one line naming it and the row, in every executor;
                                    clipped only with task.reward_clip; SIGTERM while it hangs saves a checkpoint;
                                    an abandoned call is stopped, and one inside torch does not crash the exit
    data (task rows)                an answer a built-in verifier cannot read (list, dict, boolean, NaN) is refused
                                    naming its line; an unknown split value too; an evaluation with no held-out
                                    rows refused at start; held-out rows repeating training prompts counted, said
    analyze                         routing the audit cannot compare (another top-k on each side or on some rows,
                                    routing on half the rows) is said; stdin closed is no traceback
    options                         hf:exact with top-k/top-p refused at the config check; --whatif "," refused;
                                    a truncated run config.yaml names the keys it lacks
    amp, ports                      an fp16 loss scale that flushes every gradient is named; torchrun's busy port
                                    is documented, trainer.ranks=N picks a free one
    src/ (the audit of loaders)     every pickle / torch.load / yaml.load / dynamic import / eval / exec in src/ is
                                    listed, with why it is safe, in docs/security.md
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rollcorr.checkpoint import (
    DCP_DIR,
    DCP_INDEX,
    STATE_FILE,
    CheckpointError,
    check_shard_files,
    checkpoint_dir,
    read_dcp_index,
    write_manifest,
)
from rollcorr.cli import main
from rollcorr.train.config import load_config, save_config
from rollcorr.train.loop import run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.mini_batches=1", "optim.lr=1e-3"]


class Marker:
    """A pickle that, when loaded by a plain unpickler, creates ``path`` (the proof that code ran)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').write('ran')",))


def _dcp_folder(folder: Path) -> Path:
    """A real DCP checkpoint (``dcp.save`` in one process) of a small model and its AdamW state, in ``folder/dcp``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / DCP_DIR))
    return folder


# ---------------------------------------------------------------- checkpoint: DCP's index and values


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, addition_model_dir):
    """A finished 2-step run (checkpoints at 1 and 2), kept pristine beside its path."""
    base = tmp_path_factory.mktemp("hostile")
    config = load_config(None, [*TINY, f"model.path={addition_model_dir}", f"trainer.out={base / 'run'}",
                                "trainer.steps=2", "trainer.checkpoint_every=1"])
    result = run(config)
    return result.run_dir, result.run_dir.rename(base / "pristine")


@pytest.fixture
def run_copy(two_checkpoints):
    folder, pristine = two_checkpoints
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(pristine, folder, ignore=shutil.ignore_patterns(".lock"))
    return folder


@pytest.mark.usefixtures("alternating_rewards")
def test_checkpoint__crafted_dcp_index_runs_nothing_on_resume(run_copy, tmp_path, capsys):
    """The newest checkpoint says its weights are in dcp/ and dcp/.metadata is a pickle whose loading runs code
    (torch's reader would ``pickle.load`` it): the resume refuses that checkpoint in one line naming the global,
    nothing runs, and the run continues from the older one — the checksum manifest rewritten to match."""
    marker = tmp_path / "ran"
    newest = checkpoint_dir(run_copy, 2)
    state = torch.load(newest / STATE_FILE, weights_only=True)
    state["model"] = state["optimizer"] = "dcp"
    torch.save(state, newest / STATE_FILE)
    (newest / DCP_DIR).mkdir()
    (newest / DCP_DIR / DCP_INDEX).write_bytes(pickle.dumps(Marker(marker)))
    write_manifest(newest)
    capsys.readouterr()
    result = run(load_config(run_copy / "config.yaml", ["trainer.steps=3"], inside_run=True), resume=run_copy)
    out = capsys.readouterr().out
    assert not marker.exists()
    assert result.steps == 3 and "from step_000001" in out
    said = [line for line in out.splitlines() if "skipped checkpoint step_000002" in line]
    assert len(said) == 1 and "refused: it names builtins.exec" in said[0], out


def test_checkpoint__crafted_dcp_value_runs_nothing(tmp_path):
    """A non-tensor value of a DCP checkpoint (the optimizer's lr: DCP's "bytes" items, which torch loads with
    ``weights_only=False``) replaced by a pickle that runs code: refused with the value named, nothing runs."""
    marker = tmp_path / "ran"
    folder = _dcp_folder(tmp_path / "ckpt")
    check_shard_files(folder)  # the real one passes
    metadata = read_dcp_index(folder / DCP_DIR / DCP_INDEX)
    key = next(k for k in metadata.storage_data if k.fqn.endswith("param_groups.0.lr"))
    info = metadata.storage_data[key]
    shard = folder / DCP_DIR / info.relative_path
    payload = io.BytesIO()
    torch.save(Marker(marker), payload)
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with shard.open("ab") as f:
        f.write(payload.getvalue())
    (folder / DCP_DIR / DCP_INDEX).write_bytes(pickle.dumps(metadata))  # a well-formed index pointing at it
    with pytest.raises(CheckpointError, match=r"the value of 'optimizer.param_groups.0.lr': refused to load"):
        check_shard_files(folder)
    assert not marker.exists()


def test_checkpoint__dcp_index_naming_a_file_outside_is_refused(tmp_path):
    folder = _dcp_folder(tmp_path / "ckpt")
    metadata = read_dcp_index(folder / DCP_DIR / DCP_INDEX)
    next(iter(metadata.storage_data.values())).relative_path = "../../etc/passwd"
    (folder / DCP_DIR / DCP_INDEX).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="names a file outside the checkpoint"):
        check_shard_files(folder)


def test_checkpoint__a_real_dcp_checkpoint_loads_through_the_restricted_reader(tmp_path):
    """The allow-list is the one torch's DCP writes today: a checkpoint saved now loads back, values equal."""
    from rollcorr.checkpoint import load_sharded

    folder = _dcp_folder(tmp_path / "ckpt")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    load_sharded(folder, model, optimizer)
    assert optimizer.param_groups[0]["lr"] == 1e-3  # AdamW's default, as saved


# ---------------------------------------------------------------- run config: modules a run folder names


def _run_naming(tmp_path: Path, reward: str) -> Path:
    """A run folder whose config.yaml trains a data set scored by ``reward`` (no checkpoint: the starting model)."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 10)
    folder = tmp_path / "run"
    folder.mkdir()
    save_config(load_config(None, [f"task.name={data}"]), folder / "config.yaml")
    text = (folder / "config.yaml").read_text().replace("reward: null", f"reward: {reward}")
    (folder / "config.yaml").write_text(text)
    return folder


def test_run_config__from_run_imports_no_module_the_run_names(tmp_path, monkeypatch, capsys):
    """``audit --from-run RUN`` whose config.yaml names ``sidefx:score``, a module whose import writes a file:
    one line says the run names it and how to import it yourself; the module was never imported."""
    marker = tmp_path / "imported"
    (tmp_path / "sidefx_hostile.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                                "def score(item, text):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = _run_naming(tmp_path, "sidefx_hostile:score")
    assert main(["audit", "--from-run", str(run_dir), "-n", "2", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert len(err.strip().splitlines()) == 1 and "names the reward module 'sidefx_hostile'" in err, err
    assert "rollcorr audit --plugins sidefx_hostile --from-run" in err


def test_run_config__resume_imports_no_module_the_run_names(tmp_path, monkeypatch, capsys):
    """``train --resume RUN`` whose config.yaml names a side-effect module: one line saying how to name it, nothing
    imported; named again on the command line (``task.reward=...``), the run goes on with it."""
    marker = tmp_path / "imported"
    (tmp_path / "sidefx_resume.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                               "def score(item, text):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = _run_naming(tmp_path, "sidefx_resume:score")
    small = ["trainer.steps=1", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false"]
    assert main(["train", "--resume", str(run_dir), *small]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert len(err.strip().splitlines()) == 1 and "names the reward module 'sidefx_resume'" in err, err
    assert f"rollcorr train --resume {run_dir} task.reward=sidefx_resume:score" in err
    assert main(["train", "--resume", str(run_dir), "task.reward=sidefx_resume:score", *small]) == 0
    assert marker.exists()


def test_run_config__a_reward_list_imports_no_module_the_run_names(tmp_path, monkeypatch, capsys):
    """A run whose config.yaml names a reward *list* with a side-effect module among its names: --from-run and
    --resume refuse it in one line, nothing imported; the resume's advice is one shell word that runs as pasted."""
    marker = tmp_path / "imported"
    (tmp_path / "sidefx_list.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                             "def score(item, text):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = _run_naming(tmp_path, "[exact, sidefx_list:score]")
    assert main(["audit", "--from-run", str(run_dir), "-n", "2", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "names the reward module 'sidefx_list'" in err, err
    small = ["trainer.steps=1", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false"]
    assert main(["train", "--resume", str(run_dir), *small]) == 2
    err = capsys.readouterr().err
    assert not marker.exists() and len(err.strip().splitlines()) == 1, err
    again = "'task.reward=[exact,sidefx_list:score]'"
    assert f"rollcorr train --resume {run_dir} {again}" in err, err
    assert main(["train", "--resume", str(run_dir), shlex.split(again)[0], *small]) == 0
    assert marker.exists()


def test_run_config__from_run_takes_a_module_the_user_imported(tmp_path, monkeypatch, capsys):
    """The same run once the user imported the module (``python -c 'import mod; ...'``, a plugin): accepted."""
    (tmp_path / "mine_hostile.py").write_text("def score(item, text):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mine_hostile  # noqa: F401 — the user's own import

    run_dir = _run_naming(tmp_path, "mine_hostile:score")
    assert main(["audit", "--from-run", str(run_dir), "-n", "2", "--max-new-tokens", "2", "--out",
                 str(tmp_path / "a")]) == 0


def test_run_config__the_docs_line_audits_a_run_with_your_reward(tmp_path):
    """docs/security.md's command, as written, on a run folder naming a reward module of the test's."""
    line = next(b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "docs/security.md").read_text(), re.S)
                if "--from-run" in b).strip()
    (tmp_path / "my_rewards.py").write_text("def score(item, text):\n    return float(item['answer'] in text)\n")
    run_dir = _run_naming(tmp_path, "my_rewards:score")
    (tmp_path / "runs").mkdir()
    run_dir.rename(tmp_path / "runs" / "x")
    argv = [sys.executable, "-m", *shlex.split(line)]  # rollcorr as python -m rollcorr (this checkout's)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)])}
    done = subprocess.run([*argv, "--max-new-tokens", "2", "--out", str(tmp_path / "audit")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "audit" / "report.html").is_file()


# ---------------------------------------------------------------- reward: user code that fails is contained

BAD_REWARDS = '''import math
import time


def raises(item, text):
    raise ValueError("no answer in " + repr(text[:0]))


def exits(item, text):
    raise SystemExit(3)


def nan(item, text):
    return math.nan


def inf(item, text):
    return math.inf


def none(item, text):
    return None


def text(item, text):
    return "1"


def two(item, text):
    return 2.0


def minus(item, text):
    return -5.0


def hangs(item, text):
    time.sleep(3600)


def one_arg(item):
    return 1.0


def half(item, text):
    return 0.5
'''


@pytest.fixture
def bad_rewards(tmp_path, monkeypatch):
    """A module of broken rewards on the path of this process and of the processes it starts; its data set."""
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = [str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n' for a in range(4) for b in range(3)))
    return data


# (function, task.reward_clip, what the one line says)
REWARD_CASES = [
    ("raises", False, r"failed: ValueError: no answer in '' \(bad_rewards.py:\d+\)"),
    ("exits", False, r"failed: SystemExit: 3"),
    ("nan", False, r"returned nan; a reward is a finite number in \[0, 1\]"),
    ("inf", False, r"returned inf; a reward is a finite number"),
    ("none", False, r"returned None \(NoneType\); a reward is a number in \[0, 1\]"),
    ("text", False, r"returned '1' \(str\)"),
    ("two", False, r"returned 2, outside \[0, 1\]; .* task.reward_clip=true"),
    ("minus", False, r"returned -5, outside \[0, 1\]"),
]


@pytest.mark.parametrize(("name", "clip", "said"), REWARD_CASES)
def test_reward__a_bad_value_or_exception_is_one_line_naming_the_reward_and_row(bad_rewards, name, clip, said):
    from rollcorr.tasks import DataTask
    from rollcorr.tasks.base import rewards
    from rollcorr.user_code import UserCodeError

    task = DataTask(bad_rewards, f"bad_rewards:{name}")
    items = task.sample(3, seed=0)
    with pytest.raises(UserCodeError) as caught:
        rewards(task, items, ["7", "8", "9"], timeout=60.0, clip=clip)
    line = str(caught.value)
    assert "\n" not in line and re.search(said, line), line
    assert line.startswith(f"reward 'bad_rewards:{name}' on row 0 of the batch (prompt ")


def test_reward__clip_when_the_config_says_so(bad_rewards):
    from rollcorr.tasks import DataTask
    from rollcorr.tasks.base import rewards

    item = [{"prompt": "p", "answer": "1"}]
    assert rewards(DataTask(bad_rewards, "bad_rewards:two"), item, ["x"], clip=True) == [1.0]
    assert rewards(DataTask(bad_rewards, "bad_rewards:minus"), item, ["x"], clip=True) == [0.0]
    assert rewards(DataTask(bad_rewards, "bad_rewards:half"), item, ["x"]) == [0.5]


def test_reward__a_call_past_its_time_limit_is_abandoned_with_a_line(bad_rewards):
    from rollcorr.tasks import DataTask
    from rollcorr.tasks.base import rewards
    from rollcorr.user_code import UserCodeError

    task = DataTask(bad_rewards, "bad_rewards:hangs")
    with pytest.raises(UserCodeError, match=r"on row 0 of the batch .* gave no answer in 0.2 s "
                                            r"\(task.reward_timeout=0.2\); it was abandoned"):
        rewards(task, task.sample(2, seed=0), ["1", "2"], timeout=0.2)
    half = DataTask(bad_rewards, "bad_rewards:half")  # the next call gets a fresh worker
    assert rewards(half, task.sample(2, seed=0), ["1", "2"], timeout=0.2) == [0.5, 0.5]


def test_reward__an_abandoned_call_is_stopped_at_its_next_line():
    """A call past its time limit gets ``Abandoned`` raised inside it (it stops; its thread ends) instead of
    running on for the rest of the process; ``except Exception`` in the user's code lets it pass."""
    from rollcorr.user_code import Abandoned, UserCodeError, call_user

    seen: list[tuple[threading.Thread, BaseException]] = []

    def spins() -> None:
        try:
            while True:
                try:
                    sum(range(100))
                except Exception:  # noqa: BLE001 — a user's catch-all must not keep the call alive
                    pass
        except BaseException as err:
            seen.append((threading.current_thread(), err))
            raise

    with pytest.raises(UserCodeError, match=r"^reward 'spins' gave no answer in 0.2 s; it was abandoned$"):
        call_user(spins, what="reward 'spins'", timeout=0.2)
    while not seen:  # no time bound: it must come (a hang fails the suite's own timeout, not this assert)
        time.sleep(0.01)
    thread, err = seen[0]
    thread.join()
    assert isinstance(err, Abandoned) and not thread.is_alive()
    assert call_user(lambda: 7, what="reward 'seven'", timeout=0.2) == 7  # a fresh worker


def test_reward__an_abandoned_call_inside_torch_leaves_the_exit_code_alone(tmp_path):
    """A reward that runs torch past its time limit: the process exits with its own code (1 here). Without the
    stop at exit, torch's C++ teardown ran under the thread still inside it: "terminate called without an
    active exception" and exit code 134 (or 139), every time."""
    script = (
        "import torch\n"
        "from rollcorr.user_code import UserCodeError, call_user\n"
        "def spins():\n"
        "    a = torch.randn(64, 64)\n"
        "    while True:\n"
        "        a = (a @ a).tanh()\n"
        "try:\n"
        "    call_user(spins, what=\"reward 'spins'\", timeout=0.2)\n"
        "except UserCodeError as err:\n"
        "    print(err)\n"
        "    raise SystemExit(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and done.stderr == "", (done.returncode, done.stderr[-3000:])
    assert done.stdout == "reward 'spins' gave no answer in 0.2 s; it was abandoned\n"


def test_reward__a_wrong_signature_is_refused_before_any_model_loads(bad_rewards, capsys):
    assert main(["train", f"task.name={bad_rewards}", "task.reward=bad_rewards:one_arg", "trainer.steps=1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "task.reward" in err and "one_arg(item) cannot be called as one_arg(item, response_text)" in err, err


SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=3", "task.eval_prompts=0",
         "trainer.steps=2", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false"]


def _train(tmp_path: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollcorr", "train", *SMALL, f"trainer.out={tmp_path / 'run'}",
                           *overrides], capture_output=True, text=True, timeout=timeout)


def _one_line(done, *expected: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("rollcorr train:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and all(e in lines[0] for e in expected), done.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("mode", ["sync", "simulated_async", "async"])
def test_reward__a_raising_reward_stops_every_executor_in_one_line(bad_rewards, tmp_path, mode):
    """The same line whether the reward ran here (sync, simulated_async) or in the sampler process (async)."""
    done = _train(tmp_path, f"task.name={bad_rewards}", "task.reward=bad_rewards:raises", f"trainer.mode={mode}")
    _one_line(done, "reward 'bad_rewards:raises' on row 0 of the batch", "failed: ValueError: no answer in ''")


@pytest.mark.slow
@pytest.mark.ray
def test_reward__a_raising_reward_on_a_ray_worker_is_the_same_line(bad_rewards, tmp_path):
    done = _train(tmp_path, f"task.name={bad_rewards}", "task.reward=bad_rewards:raises", "trainer.executor=ray",
                  "trainer.ray_workers=1")
    _one_line(done, "reward 'bad_rewards:raises' on row 0 of the batch", "failed: ValueError: no answer in ''")


def test_reward__a_reward_that_hangs_stops_the_run_at_its_time_limit(bad_rewards, tmp_path):
    done = _train(tmp_path, f"task.name={bad_rewards}", "task.reward=bad_rewards:hangs", "task.reward_timeout=0.5")
    _one_line(done, "reward 'bad_rewards:hangs' on row 0", "gave no answer in 0.5 s (task.reward_timeout=0.5)")


def test_reward__sigterm_while_a_reward_hangs_saves_a_checkpoint(tmp_path, monkeypatch):
    """A reward that never returns from the second step on, no time limit: SIGTERM stops the run at once with a
    line naming the reward, and the checkpoint of step 1 is saved (the run saves none until its end otherwise)."""
    started = tmp_path / "hanging"
    (tmp_path / "late_hang.py").write_text(
        "import time\n"
        "calls = 0\n"
        "def score(item, text):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 4:  # the second step's batch\n"
        f"        open({str(started)!r}, 'w').close()\n"
        "        time.sleep(3600)\n"
        "    return float(calls % 2)\n"
    )
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n' * 12)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}
    proc = subprocess.Popen([sys.executable, "-m", "rollcorr", "train", *SMALL, f"trainer.out={tmp_path / 'run'}",
                             f"task.name={data}", "task.reward=late_hang:score", "task.reward_timeout=null",
                             "trainer.checkpoint_every=0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        while not started.exists() and proc.poll() is None:
            time.sleep(0.2)
        assert started.exists(), proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "SIGTERM at step 1 (while reward 'late_hang:score' on row 0 of the batch" in err, err[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / STATE_FILE).is_file()


# ---------------------------------------------------------------- data: rows that cannot mean what they say


def _jsonl(tmp_path: Path, rows: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(row + "\n" for row in rows))
    return path


@pytest.mark.parametrize(("answer", "reward", "said"), [
    ("[1, 2]", "exact", "is a list ([1, 2]); reward 'exact' reads the answer as text, '[1, 2]'"),
    ('{"a": 1}', "exact", "is a dict"),
    ("true", "last_number", "is a boolean (True); reward 'last_number' reads the answer as text, 'True'"),
    ("NaN", "exact", "is nan (not a finite number): no response can equal it"),
    ("-Infinity", "last_number", "is -inf (not a finite number)"),
])
def test_data__an_answer_a_builtin_verifier_cannot_read_is_refused_naming_its_line(tmp_path, answer, reward, said):
    from rollcorr.tasks import DataError, DataTask

    rows = ['{"prompt": "1+1=", "answer": "2"}'] * 2 + [f'{{"prompt": "2+2=", "answer": {answer}}}']
    with pytest.raises(DataError) as caught:
        DataTask(_jsonl(tmp_path, rows), reward)
    assert str(caught.value).startswith(f"{tmp_path / 'data.jsonl'}, line 3: field 'answer' ") and said in str(caught.value)
    assert caught.value.field == "answer_key"


def test_data__your_own_reward_gets_the_answer_as_it_is(tmp_path, monkeypatch):
    """The documented rule: a module:function reward reads the value itself (a list of accepted answers here)."""
    (tmp_path / "any_of.py").write_text("def score(item, text):\n    return float(text in item['answer'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from rollcorr.tasks import DataTask
    from rollcorr.tasks.base import rewards

    task = DataTask(_jsonl(tmp_path, ['{"prompt": "a square root of 4?", "answer": ["2", "-2"]}'] * 3), "any_of:score")
    assert rewards(task, task.sample(2, seed=0), ["-2", "3"]) == [1.0, 0.0]


def test_data__an_unknown_split_is_refused_listing_the_known_ones(tmp_path, capsys):
    rows = ['{"prompt": "1+1=", "answer": "2", "split": "train"}', '{"prompt": "2+2=", "answer": "4", "split": "validation"}']
    data = _jsonl(tmp_path, rows)
    assert main(["train", f"task.name={data}", "trainer.steps=1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"{data}, line 2: split 'validation' is none of 'train', 'test'" in err, err


def test_data__an_evaluation_with_no_rows_is_refused_at_start(tmp_path, capsys):
    """Rows that all train and an evaluation asked for (the default 200 prompts): refused before any model loads,
    instead of a run that ends "n/a -> n/a"; task.eval_prompts=0 trains without evaluation."""
    data = _jsonl(tmp_path, ['{"prompt": "1+1=", "answer": "2"}'] * 9)  # every 10th row is held out: none of 9
    assert main(["train", f"task.name={data}", "trainer.steps=1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "task.eval_prompts: 200 held-out prompts asked, but" in err and "has no held-out rows (every 10th row is " \
        "held out, and it has 9 rows)" in err, err


def test_data__held_out_rows_that_repeat_training_prompts_are_counted_and_said(tmp_path, capsys):
    from rollcorr.tasks import DataTask

    rows = [f'{{"prompt": "{a}+1=", "answer": "{a + 1}"}}' for a in range(9)] + ['{"prompt": "3+1=", "answer": "4"}']
    rows += [f'{{"prompt": "{a}+2=", "answer": "{a + 2}"}}' for a in range(9)] + ['{"prompt": "9+9=", "answer": "18"}']
    data = _jsonl(tmp_path, rows)
    assert DataTask(data).notes == [f"{data}: 1 of 2 held-out rows repeat a training prompt (greedy accuracy on them "
                                    "measures what the model saw in training)"]
    assert main(["train", f"task.name={data}", *SMALL, "trainer.steps=1", f"trainer.out={tmp_path / 'run'}"]) == 0
    assert "1 of 2 held-out rows repeat a training prompt" in capsys.readouterr().out


# ---------------------------------------------------------------- analyze: what the audit says, analyze says


def _routing_dump(tmp_path: Path, make_row, n: int = 6) -> Path:
    import json

    rows = []
    for i in range(n):
        row = {"rollout_log_probs": [-1.0, -0.5], "old_log_probs": [-1.1, -0.4], "response_mask": [1, 1]}
        rows.append(json.dumps({**row, **make_row(i)}))
    path = tmp_path / "dump.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


K2, K3 = [[[1, 2]], [[0, 3]]], [[[1, 2, 3]], [[0, 3, 4]]]


@pytest.mark.parametrize(("make_row", "note"), [
    (lambda i: {"routed_experts": K2, "learner_routed_experts": K3},
     "routing not compared: the sampler's routing has (layers, top-k) (1, 2) and the learner's (1, 3)"),
    (lambda i: {"routed_experts": K2, **({"learner_routed_experts": K2} if i % 2 else {})},
     "routing not compared: the learner's are on 3 of 6 rows"),
    (lambda i: {"routed_experts": K2 if i % 2 else K3, "learner_routed_experts": K2 if i % 2 else K3},
     "the sampler's routed experts have several (layers, top-k) shapes"),
])
def test_analyze__routing_that_cannot_be_compared_is_said(tmp_path, capsys, make_row, note):
    import json

    out = tmp_path / "analysis.json"
    assert main(["analyze", str(_routing_dump(tmp_path, make_row)), "--json", str(out)]) == 0
    assert any(note in line for line in json.loads(out.read_text())["notes"]), json.loads(out.read_text())["notes"]
    assert note in capsys.readouterr().out.replace("\n", " ")


def test_analyze__standard_input_closed_is_no_traceback(tmp_path):
    """``rollcorr analyze F 0<&-`` reads F; ``rollcorr analyze - 0<&-`` says there is nothing to read."""
    dump = _routing_dump(tmp_path, lambda i: {})
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for argv, code in (([str(dump)], 0), (["-"], 2)):
        command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "rollcorr", "analyze", *argv])
        done = subprocess.run(["bash", "-c", f"exec {command} 0<&-"], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == code and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip() == ("rollcorr analyze: -: standard input is closed, so there is no dump to read; give "
                                   "the dump's path")


# ---------------------------------------------------------------- options checked before anything loads


def test_options__exact_pair_with_top_k_is_refused_at_the_config_check(tmp_path, capsys):
    argv = ["train", "model.sampler=hf:exact", "model.learner=hf:exact", "rollout.top_k=5", "trainer.steps=1",
            f"trainer.out={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollcorr train: config error: rollout.top_k: 5 asks hf:exact to truncate its distribution")
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()
    assert main(["audit", "--sampler", "hf:exact", "--learner", "hf:exact", "--top-p", "0.9", "--out",
                 str(tmp_path / "a")]) == 2
    assert "--top-p: 0.9 asks hf:exact to truncate" in capsys.readouterr().err


def test_options__an_empty_whatif_list_is_refused(tmp_path, capsys):
    for text in (",", " , ,"):
        assert main(["audit", "--whatif", text, "--out", str(tmp_path / "a")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--whatif {text!r}: names no change; give some of fp32" in err, err


def test_run_config__a_truncated_config_says_which_keys_it_lacks(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config(None, []), run_dir / "config.yaml")
    lines = (run_dir / "config.yaml").read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith("rollout:"))
    (run_dir / "config.yaml").write_text("\n".join(lines[:cut]) + "\n")  # model and task: the rest is gone
    assert main(["audit", "--from-run", str(run_dir), "-n", "2", "--max-new-tokens", "2", "--out",
                 str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert f"note: --from-run {run_dir}: its config.yaml has no rollout.prompts_per_step, rollout.group_size" in out
    assert "cut short, edited or written by an older rollcorr; their defaults are used" in out


# ---------------------------------------------------------------- the trainer's words: fp16 underflow, ports


@pytest.mark.usefixtures("alternating_rewards")
def test_amp__a_loss_scale_that_underflows_every_gradient_is_named(tmp_path, addition_model_dir, capsys):
    """An fp16 loss scale of 2^-100 flushes every gradient to 0: the zero-gradient warning names the scale, not
    "loss terms cancel"."""
    from rollcorr.train.loop import Trainer

    out = tmp_path / "run"
    config = load_config(None, [*TINY, f"model.path={addition_model_dir}", "model.learner=hf:amp-fp16",
                                "model.sampler=hf:fp16", "trainer.steps=1", f"trainer.out={out}"])
    trainer = Trainer(config, run_dir=out)
    trainer.loss_scaler.scale = 2.0**-100
    trainer.run()
    said = [line for line in capsys.readouterr().out.replace("\n", " ").split("warning: ") if "gradient was" in line]
    assert said and "the fp16 loss scale has fallen to 7.88861e-31" in said[0], said
    assert "cancel or are all clipped" not in said[0]


def test_ports__torchrun_on_a_busy_port_fails_as_the_docs_say_and_ranks_pick_a_free_one(monkeypatch):
    """docs/distributed.md: torchrun --master-port P with P taken ends in torch's EADDRINUSE line before rollcorr
    runs; ``trainer.ranks=N`` rendezvouses on port 0 (the system picks a free one)."""
    import socket

    from rollcorr.distributed import launch

    page = (ROOT / "docs" / "distributed.md").read_text().replace("\n", " ")
    assert "name: EADDRINUSE, message: address already in use" in page
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "rollcorr", "train"],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "name: EADDRINUSE, message: address already in use" in done.stderr.strip().splitlines()[-1]
    seen = {}

    def fake_launch(config, entrypoint):
        seen["endpoint"] = config.rdzv_endpoint
        return lambda *args: None

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", fake_launch)
    assert launch.launch(["trainer.steps=1"], 2) == 0 and seen["endpoint"].endswith(":0")


# ---------------------------------------------------------------- src/: every loader and dynamic import listed

# what can run code from the bytes or the names it is given: deserialisers and imports by name (matched on the
# call's dotted name as written; a method by its last part)
LOADERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "marshal.loads", "torch.load", "torch.jit.load",
           "np.load", "numpy.load", "yaml.load", "yaml.unsafe_load", "yaml.full_load", "importlib.import_module",
           "import_module", "__import__", "eval", "exec", "runpy.run_path", "runpy.run_module"}
METHODS = {"from_pretrained", "load_from_disk"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _calls_in_src() -> set[tuple[str, str]]:
    """(file under src/, call) for every call of ``LOADERS`` / ``METHODS`` and every class built on one."""
    found = set()
    for path in sorted((ROOT / "src" / "rollcorr").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            named = [node.func] if isinstance(node, ast.Call) else getattr(node, "bases", [])
            for target in named:
                name = _dotted(target)
                if name in LOADERS or name.rpartition(".")[2] in METHODS:
                    call = name if name in LOADERS else name.rpartition(".")[2]
                    found.add((path.relative_to(ROOT / "src").as_posix(), call))
    return found


def test_src__every_deserialisation_and_dynamic_import_is_in_security_md():
    """docs/security.md lists each (file, call) pair of src/ that reads code-capable data or imports by name,
    with why it is safe; a new one fails here until the page says why it is safe, and a row whose call is gone
    fails too (the page stays true)."""
    page = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \| `([\w.]+)` \|", page, flags=re.M))
    found = _calls_in_src()
    assert found, "the pattern finds nothing: it is broken"
    assert sorted(found - listed) == [], "calls in src/ that docs/security.md does not list"
    assert sorted(listed - found) == [], "rows of docs/security.md whose call is no longer in src/"
