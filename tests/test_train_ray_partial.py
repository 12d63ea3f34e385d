"""Partial rollouts on the Ray executor: workers decode in chunks and pick up newer weights between chunks.

One local cluster serves the module (start-up is most of the cost). As in ``test_train_ray.py`` the learner is
simulated: version v's weights are the built-in model's plus v times a fixed perturbation, published right
after each ``next_rollout``, so weights change while workers are in the middle of a batch.
"""

from __future__ import annotations

import pytest

import rollcorr
from rollcorr.engines import SamplingParams
from rollcorr.train.ray_executor import RayExecutor
from rollcorr.train.source import SourceSpec

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

PROMPTS = 2
SPEC = SourceSpec(
    sampler="hf:fp32",
    model_path=None,
    task="addition:1",
    # hot sampling rarely picks <eos>, so responses run long and weight updates land mid-batch (at temperature
    # 1 the model answers "a+b=" in ~3 tokens and a batch can finish before the learner publishes: flaky)
    params=SamplingParams(max_new_tokens=32, temperature=3.0, seed=0),
    prompts_per_step=PROMPTS,
    group_size=2,
    seed=3,
    threads=1,
)


def batch_index(rollout) -> int:
    return int(rollout.group_ids[0]) // PROMPTS


def token_versions(rollout) -> list[list[int]]:
    """Per response, the versions of its valid tokens in order."""
    mask = rollout.response_mask.bool()
    return [rollout.version[i][mask[i]].tolist() for i in range(rollout.batch_size)]


def assert_trainable(rollout, step: int, max_staleness: int) -> None:
    """Finished, rewarded, per-token versions monotone, none newer than the learner, none above the bound."""
    assert all(m["finished"] for m in rollout.meta)
    assert rollout.rewards is not None and rollout.rewards.shape == (rollout.batch_size,)
    for row in token_versions(rollout):
        assert row == sorted(row), row
        assert row[-1] <= step, (row, step)
    assert rollout.max_lag(step) <= max_staleness


def died(ref) -> bool:
    """Whether the task behind ``ref`` was lost with its worker (False: it finished before the kill)."""
    try:
        ray.get(ref, timeout=60)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_responses_span_versions_within_the_bound_through_a_worker_death(ray_cluster, versions):
    """Two workers, one token per chunk, freshest weights; a busy worker is killed at step 3. Every index is
    trained once, in order; some responses were continued with newer weights mid-batch; no token is trained
    at a lag above max_staleness; the lost batch is generated again from scratch with the newest weights."""
    steps, max_staleness = 8, 2
    executor = RayExecutor(SPEC, workers=2, max_staleness=max_staleness, queue_size=1, partial_rollouts=True,
                           chunk_tokens=1)
    executor.start(versions(0), 0)
    pids = ray.get([actor.ready.remote() for actor in executor.actors])
    where = ray.get(executor.actors[0].__ray_call__.remote(lambda _: rollcorr.__file__))
    killed: list[tuple[int, int, bool]] = []  # (batch index, newest version at the kill, whether it was lost)
    got = []
    try:
        for step in range(steps):
            rollout, metrics = executor.next_rollout(step, step)
            got.append((rollout, metrics))
            executor.publish(versions(step + 1), step + 1)
            if step >= 3 and not killed and executor.pending:
                ref, (index, slot) = next(iter(executor.pending.items()))
                ray.kill(executor.actors[slot])
                killed.append((index, step + 1, died(ref)))
        pids_after = ray.get([actor.ready.remote() for actor in executor.actors])
    finally:
        executor.close()

    assert where == rollcorr.__file__  # the workers import this checkout's code (PYTHONPATH reached them)
    assert [batch_index(r) for r, _ in got] == list(range(steps))  # every index exactly once, in order
    assert killed and got[-1][1]["ray/restarts_total"] == 1.0
    assert len(set(pids_after) - set(pids)) == 1  # one fresh actor replaced the killed one
    assert all(m["async/dropped_total"] == 0.0 for _, m in got)
    for step, (rollout, _) in enumerate(got):
        assert_trainable(rollout, step, max_staleness)
    spanning = [row for r, _ in got for row in token_versions(r) if row[0] != row[-1]]
    assert spanning, "no response was continued with newer weights"
    index, newest, lost = killed[0]
    if lost:  # (unless it finished just before the kill) the batch was generated again, from scratch
        assert min(min(row) for row in token_versions(got[index][0])) >= newest


def test_pause_stops_at_a_chunk_boundary_and_resume_continues_with_new_weights(ray_cluster, versions):
    """The interrupt-strategy protocol: pause right after dispatch returns unfinished batches (no task left
    running), publish while paused, resume: the same responses are continued, their new tokens at the new
    version."""
    executor = RayExecutor(
        SPEC, workers=1, max_staleness=2, queue_size=1, partial_rollouts=True, chunk_tokens=1
    )
    executor.start(versions(0), 0)
    try:
        in_flight = executor.pause()
        assert not executor.pending and in_flight
        unfinished = [r for r in in_flight if not all(m["finished"] for m in r.meta)]
        assert unfinished, "the pause did not stop the worker between chunks"
        assert all(r.rewards is None for r in unfinished)
        assert all(int(r.version[r.response_mask.bool()].max()) == 0 for r in in_flight)
        executor.publish(versions(1), 1)
        executor.resume()
        got = [executor.next_rollout(step, step + 1)[0] for step in range(2)]
    finally:
        executor.close()

    assert [batch_index(r) for r in got] == [0, 1]
    for step, rollout in enumerate(got):
        assert_trainable(rollout, step + 1, max_staleness=2)
    before = {batch_index(r): r for r in unfinished}
    for rollout in got:
        if batch_index(rollout) not in before:
            continue
        old, mask = before[batch_index(rollout)], before[batch_index(rollout)].response_mask.bool()
        for i, (row_old, row_new) in enumerate(
            zip(token_versions(old), token_versions(rollout), strict=True)
        ):
            n = len(row_old)
            assert rollout.response_ids[i][:n].tolist() == old.response_ids[i][mask[i]].tolist()  # continued
            assert row_new[:n] == row_old and all(v == 1 for v in row_new[n:])


def test_make_executor_takes_partial_rollouts_from_the_config():
    from rollcorr.train.build import make_executor
    from rollcorr.train.config import load_config

    config = load_config(None, ["trainer.executor=ray", "trainer.mode=async", "trainer.partial_rollouts=true",
                                "trainer.partial_chunk_tokens=3", "model.sampler=hf:fp32"])
    executor = make_executor(config, workers=1)
    assert executor.partial_rollouts and executor.chunk_tokens == 3 and executor.lag is None
    with pytest.raises(ValueError, match="lag=None"):
        RayExecutor(SPEC, max_staleness=2, lag=1, partial_rollouts=True)
    with pytest.raises(ValueError, match="chunk_tokens"):
        RayExecutor(SPEC, partial_rollouts=True, chunk_tokens=0)


def test_trainer_with_partial_rollouts_and_the_interrupt_strategy(ray_cluster, tmp_path):
    """The real training loop with trainer.executor=ray and partial rollouts; the ``interrupt`` π_old strategy
    pauses the workers at a chunk boundary before every update and scores the unfinished responses."""
    import json

    from rollcorr.train.config import load_config
    from rollcorr.train.loop import Trainer

    config = load_config(None, [
        "task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=32",
        "rollout.temperature=3.0",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.executor=ray", "trainer.ray_workers=1", "trainer.mode=async", "trainer.max_staleness=2",
        "trainer.partial_rollouts=true", "trainer.partial_chunk_tokens=1", "algorithm.proximal.name=interrupt",
        "trainer.steps=6", "trainer.checkpoint_every=0", f"trainer.out={tmp_path / 'run'}",
    ])
    result = Trainer(config).run()

    assert result.steps == 6 and result.stopped is None
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness/lag_max"] <= 2 and r["ray/restarts_total"] == 0 for r in steps)
    assert any(r["staleness/mixed_version_fraction"] > 0 for r in steps)  # responses continued mid-batch
    assert any(r["proximal/interrupted_token_fraction"] > 0 for r in steps)  # old logits stored at pauses
