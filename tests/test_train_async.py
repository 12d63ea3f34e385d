"""trainer.mode=async with the sampler in its own process: the executor factory, the staleness bound, errors
from the sampler process, and shutdown without orphans (close, Ctrl-C, kill -9 of the trainer).

The "learner" of the executor-level tests is simulated as in tests/test_train_ray.py: version v's weights are
the built-in model's plus v times a fixed perturbation. Nothing here depends on which tokens a CPU samples or
on timing: the bound must hold for every interleaving of sampler and learner.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollcorr.engines import SamplingParams
from rollcorr.train.build import make_executor
from rollcorr.train.config import load_config
from rollcorr.train.executors import AsyncExecutor, LaggedExecutor
from rollcorr.train.sampler_process import ProcessSource, SamplerProcessError
from rollcorr.train.source import SourceSpec

PROMPTS = 2
SPEC = SourceSpec(
    sampler="hf:fp32",
    model_path=None,
    task="addition:1",
    # hot sampling rarely picks <eos>: responses run long, so weight updates land between chunks
    params=SamplingParams(max_new_tokens=12, temperature=3.0, seed=0),
    prompts_per_step=PROMPTS,
    group_size=2,
    seed=3,
    threads=1,
)
TINY = ["task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "optim.lr=1e-3", "trainer.mini_batches=1", "trainer.mode=async", "trainer.max_staleness=1"]


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for a parent that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def children(pid: int) -> list[int]:
    """Child processes of ``pid`` (from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_factory_builds_the_sampler_once_where_it_runs(monkeypatch, tmp_path):
    """sync / simulated_async: in this process; async: in a sampler process, started with the executor;
    Ray: in the actors. The trainer itself builds no sampler for the last two (with vLLM: a whole engine)."""
    import rollcorr.engines as engines
    from rollcorr.train.loop import Trainer
    from rollcorr.train.ray_executor import RayExecutor

    built = []
    real = engines.make_sampler
    monkeypatch.setattr(engines, "make_sampler", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    config = lambda *o: load_config(None, [*TINY, *o])  # noqa: E731

    sync = make_executor(config("trainer.mode=sync"))
    assert isinstance(sync, LaggedExecutor) and sync.lag == 0 and built == ["hf:bf16"]
    assert make_executor(config("trainer.mode=simulated_async", "trainer.lag=1")).lag == 1
    built.clear()
    async_ = make_executor(config("trainer.partial_rollouts=true", "trainer.partial_chunk_tokens=3"))
    assert isinstance(async_, AsyncExecutor) and isinstance(async_.source, ProcessSource)
    assert async_.partial_rollouts and async_.chunk_tokens == 3 and async_.max_staleness == 1
    assert not async_.source.alive and built == []  # nothing runs before start()
    ray = make_executor(config("trainer.executor=ray", "trainer.ray_workers=3"))
    assert isinstance(ray, RayExecutor) and ray.num_workers == 3 and ray.lag is None and built == []
    with pytest.raises(TypeError, match="trainer.executor=ray"):
        make_executor(config(), workers=2)

    for executor in ("local", "ray"):
        trainer = Trainer(config(f"trainer.executor={executor}", f"trainer.out={tmp_path / executor}"))
        trainer.lock.release()
        assert built == [], executor


@pytest.mark.parametrize("partial", [False, True])
def test_process_executor_never_trains_above_max_staleness(versions, partial):
    """The learner takes batches at every pace (at once, or after a pause); every batch comes in index
    order, none is dropped, and no token is older than max_staleness versions when trained."""
    max_staleness = 1
    executor = AsyncExecutor(ProcessSource(SPEC), max_staleness, queue_size=2, partial_rollouts=partial,
                             chunk_tokens=1)
    executor.start(versions(0), 0)
    try:
        for step in range(8):
            rollout, metrics = executor.next_rollout(step, step)
            assert int(rollout.group_ids[0]) // PROMPTS == step
            assert rollout.rewards is not None
            assert rollout.max_lag(step) <= max_staleness
            mask = rollout.response_mask.bool()
            for row, keep in zip(rollout.version, mask):
                tokens = row[keep].tolist()
                assert tokens == sorted(tokens) and tokens[-1] <= step  # never newer than the learner
            assert metrics["async/dropped_total"] == 0 and metrics["time/generate_s"] > 0
            time.sleep(0.2 if step % 3 == 1 else 0.0)  # the sampler runs ahead; the bound must hold anyway
            executor.publish(versions(step + 1), step + 1)
    finally:
        pid = executor.source.pid
        executor.close()
    assert gone(pid)


def test_sampler_construction_error_is_raised_in_the_trainer():
    bad = SourceSpec("hf:fp32", None, "no_such_task", SPEC.params, 1, 2, 0)
    source = ProcessSource(bad)
    executor = AsyncExecutor(source, max_staleness=1)
    with pytest.raises(SamplerProcessError, match=r"^ValueError: unknown task.*in the sampler process"):
        executor.start({}, 0)
    assert wait_until(lambda: gone(source.pid))
    executor.close()


def test_sampler_errors_and_death_reach_the_learner(versions):
    """Weights that do not fit, a failure inside the sampler process (NaN weights: no distribution to sample
    from) and a killed sampler process: the next batch the learner asks for raises, naming the cause."""
    nan = {k: v * float("nan") for k, v in versions(1).items()}
    for weights, message in [({"not_a_weight": nan["model.norm.weight"]}, "ValueError: weights do not fit"),
                             (nan, r"SamplerProcessError: FloatingPointError: sampler: .* is NaN .*weights have diverged.*in the sampler process")]:
        executor = AsyncExecutor(ProcessSource(SPEC), max_staleness=1, queue_size=1)
        executor.start(versions(0), 0)
        try:
            executor.publish(weights, 1)
            with pytest.raises(RuntimeError, match=f"^the sampler failed: .*{message}"):
                for step in range(3):
                    executor.next_rollout(step, step)
        finally:
            executor.close()
        assert gone(executor.source.pid)

    executor = AsyncExecutor(ProcessSource(SPEC), max_staleness=1, queue_size=1)
    executor.start(versions(0), 0)
    try:
        executor.next_rollout(0, 0)
        os.kill(executor.source.pid, signal.SIGKILL)
        executor.publish(versions(1), 1)
        with pytest.raises(RuntimeError, match=r"the sampler process \(pid \d+\) died .*exit code -9"):
            for step in range(1, 4):
                executor.next_rollout(step, step)
    finally:
        executor.close()


def test_sampler_process_exits_when_its_trainer_is_killed(tmp_path):
    """kill -9 of the trainer (no close, no atexit): the sampler process sees its socket close and exits."""
    script = tmp_path / "trainer.py"  # no __main__ guard on purpose: the sampler process never runs it
    script.write_text(
        "import time\n"
        "from rollcorr.engines import make_sampler\n"
        "from test_train_async import SPEC\n"
        "from rollcorr.train.executors import AsyncExecutor\n"
        "from rollcorr.train.sampler_process import ProcessSource\n"
        "executor = AsyncExecutor(ProcessSource(SPEC), max_staleness=1)\n"
        "executor.start(make_sampler('hf:fp32').float_model.state_dict(), 0)\n"
        "executor.next_rollout(0, 0)\n"
        "print(executor.source.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = trainer.stdout.readline()
        assert line.strip().isdigit(), line
        sampler = int(line)
        assert children(trainer.pid) == [sampler]  # one sampler process, and the script did not run twice
        trainer.kill()
        trainer.wait()
        assert wait_until(lambda: gone(sampler), timeout_s=60)
    finally:
        trainer.kill()
        trainer.wait()


def test_ctrl_c_stops_after_a_step_with_a_checkpoint_and_the_run_resumes(tmp_path, addition_model_dir):
    """Ctrl-C at the terminal (SIGINT to the whole foreground process group) while `rollcorr train` runs in
    async mode: the step ends, a checkpoint is written, the sampler process is closed (it never saw the
    signal), exit status 1; --resume continues the run from that checkpoint, again in async mode."""
    out = tmp_path / "run"
    args = [*TINY, f"model.path={addition_model_dir}", "trainer.steps=500", "trainer.checkpoint_every=0"]
    trainer = subprocess.Popen([sys.executable, "-m", "rollcorr.cli", "train", "--out", str(out), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_until(lambda: (out / "metrics.jsonl").exists()
                          and len((out / "metrics.jsonl").read_text().splitlines()) >= 3, timeout_s=300)
        samplers = children(trainer.pid)
        assert len(samplers) == 1
        os.killpg(trainer.pid, signal.SIGINT)
        _, err = trainer.communicate(timeout=120)
    finally:
        trainer.kill()
        trainer.wait()
    assert trainer.returncode == 1, err[-2000:]
    assert "SIGINT" in err and "--resume" in err
    assert gone(samplers[0])
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    stopped_at = steps[-1]
    assert stopped_at < 500 and (out / "checkpoints" / f"step_{stopped_at:06d}").is_dir()

    from rollcorr.train.loop import run

    result = run(load_config(out / "config.yaml", [f"trainer.steps={stopped_at + 2}"]), resume=out)
    assert result.steps == stopped_at + 2 and result.stopped is None
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r][-2:] == [stopped_at + 1, stopped_at + 2]
    assert all(r["staleness/lag_max"] <= 1 for r in records if "reward/mean" in r)
