"""The Ray executor: sampler workers as Ray actors on a local cluster, the learner in the test process.

One local cluster serves the module (start-up is most of the cost). The "learner" is simulated: version v's
weights are the built-in model's plus v times a fixed perturbation, so every version samples differently and
a batch shows which version produced it.
"""

from __future__ import annotations

import pytest
import torch

from rollcorr.engines import SamplingParams
from rollcorr.train.build import make_executor
from rollcorr.train.executors import LaggedExecutor
from rollcorr.train.ray_executor import RayExecutor
from rollcorr.train.source import SourceSpec

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

PROMPTS = 2
SPEC = SourceSpec(
    sampler="hf:fp32",
    model_path=None,
    task="addition:1",
    params=SamplingParams(max_new_tokens=4, temperature=1.0, seed=0),
    prompts_per_step=PROMPTS,
    group_size=2,
    seed=3,
    threads=1,
)


def batch_index(rollout) -> int:
    return int(rollout.group_ids[0]) // PROMPTS


def drive(executor, weights, steps: int, after_publish=None):
    """The trainer's calls: next_rollout at version == step, then publish version step + 1."""
    executor.start(weights(0), 0)
    out = []
    try:
        for step in range(steps):
            rollout, metrics = executor.next_rollout(step, step)
            out.append((rollout, metrics))
            executor.publish(weights(step + 1), step + 1)
            if after_publish is not None:
                after_publish(step)
    finally:
        executor.close()
    return out


def test_killed_worker_is_replaced_and_batches_match_the_in_process_executor(ray_cluster, versions):
    """Two workers sampling ahead with lag 1; one dies with a batch in flight. Every index is trained exactly
    once, in order, and each batch equals LaggedExecutor(lag=1)'s bit for bit (the lost batch is generated
    again with the same weights)."""
    steps = 6
    executor = RayExecutor(SPEC, workers=2, max_staleness=1, lag=1)
    killed = []

    def kill_busy_worker(step: int) -> None:
        if step == 0:  # publishing version 1 started batch 2 (batch 1 may still run too): a busy worker dies
            index, slot = next(iter(executor.pending.values()))
            killed.append(index)
            ray.kill(executor.actors[slot])

    got = drive(executor, versions, steps, after_publish=kill_busy_worker)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers, so the floating-point sums match
    try:
        want = drive(LaggedExecutor(SPEC.build(), lag=1), versions, steps)
    finally:
        torch.set_num_threads(threads)

    assert killed in ([1], [2])
    assert [batch_index(r) for r, _ in got] == list(range(steps))
    assert got[-1][1]["ray/restarts_total"] == 1.0
    assert [m["sampler/version"] for _, m in got] == [0, 0, 1, 2, 3, 4]
    for (a, ma), (b, mb) in zip(got, want, strict=True):
        assert ma["sampler/version"] == mb["sampler/version"]
        for name in ("prompt_ids", "response_ids", "response_mask", "rollout_log_prob", "version", "rewards"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert [m["answer"] for m in a.meta] == [m["answer"] for m in b.meta]
    # the versions differ enough to matter: the samples are not all the same
    assert not all(torch.equal(got[0][0].response_ids, r.response_ids) for r, _ in got[1:])


@pytest.mark.slow
def test_freshest_weights_keep_the_staleness_bound_through_a_worker_death(ray_cluster, versions):
    steps, max_staleness = 8, 2
    executor = RayExecutor(SPEC, workers=2, max_staleness=max_staleness, queue_size=2)
    killed = []

    def kill_busy_worker(step: int) -> None:
        if step == 2:
            index, slot = next(iter(executor.pending.values()))
            killed.append(index)
            ray.kill(executor.actors[slot])

    got = drive(executor, versions, steps, after_publish=kill_busy_worker)
    assert killed and killed[0] > 2
    assert [batch_index(r) for r, _ in got] == list(range(steps))  # every index exactly once, in order
    assert got[-1][1]["ray/restarts_total"] == 1.0
    assert all(m["async/dropped_total"] == 0.0 for _, m in got)
    for step, (rollout, _) in enumerate(got):
        assert rollout.max_lag(step) <= max_staleness
        assert rollout.rewards is not None and rollout.rewards.shape == (rollout.batch_size,)


@pytest.mark.slow
def test_pause_returns_untrained_batches_and_checkpoint_resumes(ray_cluster, versions):
    executor = RayExecutor(SPEC, workers=2, max_staleness=2, lag=1)
    executor.start(versions(0), 0)
    try:
        first, _ = executor.next_rollout(0, 0)
        executor.publish(versions(1), 1)
        in_flight = executor.pause()
        assert not executor.pending and [batch_index(r) for r in in_flight] == sorted(executor.done)
        assert in_flight and batch_index(in_flight[0]) == 1
        state = executor.state_dict()
        executor.resume()
        second, _ = executor.next_rollout(1, 1)
    finally:
        executor.close()

    assert state["kind"] == "ray" and state["next_index"] == 1
    resumed = RayExecutor(SPEC, workers=1, max_staleness=2, lag=1)
    resumed.load_state_dict(state)
    try:
        again, _ = resumed.next_rollout(1, 1)
        resumed.publish(versions(2), 2)
        third, _ = resumed.next_rollout(2, 2)
    finally:
        resumed.close()
    assert torch.equal(again.response_ids, second.response_ids) and batch_index(third) == 2
    assert int(third.version.max()) == 1  # lag 1: batch 2 sampled with version 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="workers"):
        RayExecutor(SPEC, workers=0)
    with pytest.raises(ValueError, match="lag"):
        RayExecutor(SPEC, max_staleness=1, lag=2)
    with pytest.raises(RuntimeError, match="before start"):
        RayExecutor(SPEC).publish({}, 0)


def test_make_executor_maps_trainer_modes_to_ray_lags():
    from rollcorr.train.config import load_config

    def build(*overrides):
        fixed = ["trainer.executor=ray", "rollout.max_new_tokens=5", "model.sampler=hf:fp32", "trainer.max_staleness=4"]
        return make_executor(load_config(None, [*fixed, *overrides]), workers=3)

    assert build("trainer.mode=sync").lag == 0
    ex = build("trainer.mode=simulated_async", "trainer.lag=2", "trainer.max_staleness=3")
    assert ex.lag == 2 and ex.max_staleness == 3 and ex.num_workers == 3
    assert build("trainer.mode=async").lag is None
    assert ex.spec.params.max_new_tokens == 5 and ex.spec.sampler == "hf:fp32" and ex.spec.model_path == "builtin"
    assert build("trainer.mode=async", "trainer.partial_rollouts=true").partial_rollouts


@pytest.mark.slow
def test_trainer_runs_end_to_end_on_ray_workers(ray_cluster, tmp_path):
    """The real training loop with trainer.executor=ray (on the module's cluster: Ray is already initialised)."""
    import json

    from rollcorr.checkpoint import latest_checkpoint, load_checkpoint
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import Trainer

    config = load_config(None, [
        "task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.mode=async", "trainer.max_staleness=2", "trainer.steps=4", f"trainer.out={tmp_path / 'run'}",
        "trainer.executor=ray", "trainer.ray_workers=2",
    ])
    trainer = Trainer(config)
    assert trainer.executor.num_workers == 2 and not trainer.executor.actors  # built, no worker started yet
    result = trainer.run()

    assert result.steps == 4 and result.stopped is None
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["staleness/lag_max"] <= 2 and r["ray/restarts_total"] == 0 for r in steps)
    state = load_checkpoint(latest_checkpoint(result.run_dir))["executor"]
    assert state["kind"] == "ray" and state["next_index"] == 4 and state["published"]


def test_admission_rule_and_lag():
    from rollcorr.rollout import Rollout
    from rollcorr.train.versions import admissible

    assert admissible(5, dropped=0, sampler_version=3, max_staleness=2)
    assert not admissible(5, dropped=0, sampler_version=2, max_staleness=2)
    assert admissible(5, dropped=1, sampler_version=2, max_staleness=2)  # batch 5 is trained at version 4
    rollout = Rollout(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        response_ids=torch.zeros(2, 3, dtype=torch.long),
        response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
        rollout_log_prob=None,
        version=torch.tensor([[4, 5, 0], [3, 5, 6]]),  # padding holds version 0: ignored
        group_ids=torch.tensor([0, 0]),
    )
    assert rollout.max_lag(7) == 4


@pytest.mark.slow
def test_worker_construction_error_reaches_the_driver(ray_cluster):
    bad = SourceSpec("hf:fp32", None, "no_such_task", SPEC.params, 1, 2, 0)
    executor = RayExecutor(bad, workers=1)
    with pytest.raises(ray.exceptions.RayActorError, match="unknown task"):
        executor.start({}, 0)
    executor.close()


@pytest.mark.slow
def test_joins_an_existing_cluster_by_address(ray_cluster, tmp_path):
    """Another process joins this test's cluster by address, samples two batches and leaves it running."""
    import subprocess
    import sys

    address = ray.get_runtime_context().gcs_address
    script = tmp_path / "join.py"
    script.write_text(
        "import sys, torch\n"
        "from rollcorr.engines import make_sampler\n"
        "from test_train_ray import SPEC\n"
        "from rollcorr.train.ray_executor import RayExecutor\n"
        "ex = RayExecutor(SPEC, workers=1, address=sys.argv[1])\n"
        "ex.start(make_sampler('hf:fp32').float_model.state_dict(), 0)\n"
        "r0, _ = ex.next_rollout(0, 0)\n"
        "ex.publish(make_sampler('hf:fp32').float_model.state_dict(), 1)\n"
        "r1, _ = ex.next_rollout(1, 1)\n"
        "ex.close()\n"
        "print('batches', int(r0.group_ids[0]), int(r1.group_ids[0]))\n"
    )
    os = __import__("os")
    paths = [str(__import__("pathlib").Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # this checkout's rollcorr, and SPEC
    out = subprocess.run([sys.executable, str(script), address], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"batches 0 {PROMPTS}" in out.stdout
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2.0  # our cluster still runs


@pytest.mark.slow
def test_cli_train_with_ray_executor(tmp_path):
    """``rollcorr train trainer.executor=ray ...`` end to end (its own local cluster, in a subprocess)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    args = ["trainer.executor=ray", "trainer.ray_workers=2", "trainer.mode=async", "trainer.max_staleness=2",
            "trainer.steps=3", "task.name=addition:1", "task.eval_prompts=0", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=4", "trainer.progress=false", "trainer.plot=false",
            "trainer.tensorboard=false", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "rollcorr.cli", "train", *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/lag_max"] <= 2 and "ray/restarts_total" in r for r in steps)
