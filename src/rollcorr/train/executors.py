"""Where rollouts come from: a sampler worker behind an executor.

``RolloutSource`` is the sampler-side worker: for batch ``index`` it draws prompts (deterministic in the
seed and the index), samples G responses per prompt, and scores them. An executor decides *when* and *with
which weights* the worker runs:

  LaggedExecutor(lag=0)   synchronous: generate, train, publish, repeat
  LaggedExecutor(lag=k)   simulated asynchronous: the sampler holds the newest published weights at least k
                          versions old — deterministic and reproducible, for experiments
  AsyncExecutor           truly asynchronous: a producer thread runs the sampler concurrently with the
                          learner, behind a bounded queue, with admission control (a batch is started only if
                          it cannot be trained on at a lag above ``max_staleness``) and optional partial
                          rollouts (a response interrupted by a weight update resumes with the new weights)

Every executor has the same surface, so a Ray executor (sampler workers in other processes feeding the same
bounded queue) can slot in: ``start(version, weights)``, ``next_rollout(step, version) -> (Rollout, metrics)``,
``publish(version, weights)``, ``pause() -> in-flight rollouts`` / ``resume()``, ``state_dict()`` /
``load_state_dict()``, ``close()``. Weight versions count learner steps; batch ``step`` is trained on at
learner version ``step`` (one batch per step).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch
from torch import Tensor

from rollcorr.rollout import Rollout

StateDict = dict[str, Tensor]


def copy_weights(state_dict: StateDict) -> StateDict:
    """A detached CPU copy (the learner keeps training its own tensors)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


class RolloutSource:
    """The sampler worker: prompts for batch ``index`` → G sampled responses each → rewards.

    Owned by one thread at a time. ``seed`` and ``index`` fix the prompts and the sampling seed, so the same
    weights give the same batch.
    """

    def __init__(self, sampler, task, tokenizer, params, prompts_per_step: int, group_size: int, seed: int):
        self.sampler, self.task, self.tokenizer = sampler, task, tokenizer
        self.params, self.prompts_per_step, self.group_size = params, prompts_per_step, group_size
        self.seed = seed
        # called with every generated chunk, before any newer weights are loaded (e.g. the old-logit model)
        self.listeners: list = []
        # called as (version, weights) whenever the sampler loads weights, from the sampler's thread
        self.load_listeners: list = []

    def _notify(self, rollout: Rollout) -> Rollout:
        for listener in self.listeners:
            listener(rollout)
        return rollout

    def _batch_seed(self, index: int) -> int:
        return (self.seed * 1_000_003 + index) % (2**31 - 1)

    def _request(self, index: int) -> tuple[list[str], Any, list[dict], list[int]]:
        from dataclasses import replace

        items = self.task.sample(self.prompts_per_step, seed=self._batch_seed(index), split="train")
        params = replace(self.params, seed=self._batch_seed(index))
        group_ids = [index * self.prompts_per_step + j for j in range(self.prompts_per_step)]
        return [it["prompt"] for it in items], params, items, group_ids

    def generate(self, index: int, max_steps: int | None = None) -> Rollout:
        """Start batch ``index`` (complete unless ``max_steps`` stops decoding first)."""
        prompts, params, items, group_ids = self._request(index)
        rollout = self.sampler.generate(
            prompts, params, n=self.group_size, meta=items, group_ids=group_ids, max_steps=max_steps
        )
        return self._notify(rollout)

    def resume(self, index: int, partial: Rollout, max_steps: int | None = None) -> Rollout:
        """Continue the unfinished rows of ``partial`` with the sampler's current weights."""
        prompts, params, items, group_ids = self._request(index)
        rollout = self.sampler.generate(
            prompts,
            params,
            n=self.group_size,
            meta=items,
            group_ids=group_ids,
            resume=partial,
            max_steps=max_steps,
        )
        return self._notify(rollout)

    @staticmethod
    def finished(rollout: Rollout) -> bool:
        return all(m.get("finished", True) for m in rollout.meta)

    def reward(self, rollout: Rollout) -> Rollout:
        """Decode each response (special tokens removed) and score it with the task."""
        ids = [row[mask].tolist() for row, mask in zip(rollout.response_ids, rollout.response_mask.bool())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        rewards = [float(self.task.reward(item, text)) for item, text in zip(rollout.meta, texts)]
        return rollout.replace(rewards=torch.tensor(rewards, dtype=torch.float32))

    def load_weights(self, weights: StateDict, version: int) -> None:
        self.sampler.load_weights(weights, version)
        for listener in self.load_listeners:
            listener(version, weights)

    @property
    def version(self) -> int:
        return int(self.sampler.version)


class LaggedExecutor:
    """Synchronous (lag 0) or simulated-asynchronous (lag k) execution, fully deterministic.

    Batch ``step`` is generated on demand with the newest *published* weights of version ≤ step − lag. Only
    the versions still needed are kept (``history``), and they are part of the checkpoint, so a resumed run
    samples with exactly the weights an uninterrupted one would have.
    """

    def __init__(self, source: RolloutSource, lag: int = 0):
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.source, self.lag = source, lag
        self.history: dict[int, StateDict] = {}
        self.sampler_version: int | None = None
        self._latest = 0

    def start(self, version: int, weights: StateDict) -> None:
        self.history = {version: copy_weights(weights)}
        self._latest = version
        self._sync(version)

    def _sync(self, version: int) -> None:
        """Load the newest published weights of version ≤ ``version`` − lag; forget older ones."""
        eligible = [v for v in self.history if v <= version - self.lag] or [min(self.history)]
        target = max(eligible)
        if target != self.sampler_version:
            self.source.load_weights(self.history[target], target)
            self.sampler_version = target
        self.history = {v: w for v, w in self.history.items() if v >= target}

    def next_rollout(self, step: int, version: int) -> tuple[Rollout, dict[str, float]]:
        self._sync(version)
        start = time.perf_counter()
        rollout = self.source.reward(self.source.generate(step))
        return rollout, {
            "time/generate_s": time.perf_counter() - start,
            "sampler/version": float(self.sampler_version),
        }

    def publish(self, version: int, weights: StateDict) -> None:
        self.history[version] = copy_weights(weights)
        self._latest = version
        self._sync(version)

    def pause(self) -> list[Rollout]:
        return []  # nothing is in flight between steps

    def resume(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "lagged", "lag": self.lag, "history": self.history, "sampler_version": self.sampler_version,
                "latest": self._latest}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "lagged":
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} executor state, not 'lagged'")
        self.history = {int(v): w for v, w in state["history"].items()}
        self._latest = int(state["latest"])
        version = int(state["sampler_version"])
        self.source.load_weights(self.history[version], version)
        self.sampler_version = version

    def close(self) -> None:
        pass


def trained_version(index: int, dropped: int) -> int:
    """The learner version batch ``index`` is trained at (one batch per step; dropped batches take none)."""
    return index - dropped


def admissible(index: int, dropped: int, sampler_version: int, max_staleness: int) -> bool:
    """May batch ``index`` be sampled with weights ``sampler_version``? (no token trained at lag > bound)"""
    return trained_version(index, dropped) - sampler_version <= max_staleness


def lag_of(rollout: Rollout, version: int) -> int:
    """Versions between the learner (``version``) and the oldest valid token of ``rollout``."""
    mask = rollout.response_mask.bool()
    return version - int(rollout.version[mask].min()) if mask.any() else 0


class AsyncExecutor:
    """A producer thread samples while the learner trains; batches wait in a bounded queue.

    Admission control (AReaL-style, not drop-after-generation): batch ``i`` is trained on at learner version
    ``i − dropped`` (``dropped`` counts batches dropped so far), so the producer starts it only once its
    sampler holds a version ≥ i − dropped − max_staleness. Every token of the batch is generated at that version or a
    newer one, so no token is ever trained on at a lag above ``max_staleness``; ``next_rollout`` re-checks the
    bound and drops (and counts) a batch that would break it.

    Partial rollouts: the producer decodes ``chunk_tokens`` tokens at a time; between chunks it loads newly
    published weights and resumes the unfinished responses with them (each token keeps its own version).
    """

    def __init__(
        self,
        source: RolloutSource,
        max_staleness: int,
        queue_size: int = 2,
        partial_rollouts: bool = False,
        chunk_tokens: int = 2,
    ):
        if max_staleness < 0 or queue_size < 1 or chunk_tokens < 1:
            raise ValueError("max_staleness must be >= 0, queue_size >= 1, chunk_tokens >= 1")
        self.source, self.max_staleness, self.queue_size = source, max_staleness, queue_size
        self.partial_rollouts, self.chunk_tokens = partial_rollouts, chunk_tokens
        self.queue: deque[tuple[int, Rollout]] = deque()
        self.cond = threading.Condition()
        self.mailbox: tuple[int, StateDict] | None = None  # newest published weights not yet loaded
        self.published: tuple[int, StateDict] | None = None  # newest published weights (for checkpoints)
        self.next_index = 0
        self.dropped = 0
        self.in_flight: Rollout | None = None
        self.error: BaseException | None = None
        self._stop = False
        self._pause_requested = False
        self._paused = False
        self._thread: threading.Thread | None = None
        self.producer_wait_s = 0.0

    # ---- learner side -------------------------------------------------------------------------------
    def start(self, version: int, weights: StateDict) -> None:
        self.published = (version, copy_weights(weights))
        self.source.load_weights(self.published[1], version)
        self._launch()

    def _launch(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._produce, name="rollcorr-sampler", daemon=True)
        self._thread.start()

    def publish(self, version: int, weights: StateDict) -> None:
        copied = copy_weights(weights)
        with self.cond:
            self.mailbox = self.published = (version, copied)
            self.cond.notify_all()

    def next_rollout(self, step: int, version: int) -> tuple[Rollout, dict[str, float]]:
        """The next admissible batch (blocks until the producer has one)."""
        start = time.perf_counter()
        dropped_now = 0
        while True:
            with self.cond:
                while not self.queue and self.error is None:
                    self.cond.wait(timeout=0.5)
                if self.error is not None:
                    raise RuntimeError("the sampler thread failed") from self.error
                _index, rollout = self.queue.popleft()
                self.cond.notify_all()
            if lag_of(rollout, version) <= self.max_staleness:
                break
            with self.cond:  # defensive: admission control should make this unreachable
                self.dropped += 1
                dropped_now += 1
        metrics = {
            "time/queue_wait_s": time.perf_counter() - start,
            "async/queue_size": float(len(self.queue)),
            "async/dropped_total": float(self.dropped),
            "async/dropped_now": float(dropped_now),
            "async/producer_wait_s": self.producer_wait_s,
            "sampler/version": float(self.source.version),  # the producer's weights now
        }
        return rollout, metrics

    def pause(self) -> list[Rollout]:
        """Stop the producer at its next chunk boundary; returns the in-flight rollouts (partial + queued)."""
        with self.cond:
            self._pause_requested = True
            self.cond.notify_all()
            while (
                not self._paused
                and self.error is None
                and self._thread is not None
                and self._thread.is_alive()
            ):
                self.cond.wait(timeout=0.5)
            rollouts = [r for _, r in self.queue]
            if self.in_flight is not None:
                rollouts.append(self.in_flight)
            return rollouts

    def resume(self) -> None:
        with self.cond:
            self._pause_requested = False
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    # ---- sampler side (the producer thread) ----------------------------------------------------------
    def _wait(self, ready) -> bool:
        """Wait (holding nothing) until ``ready()`` or stop; honours pause requests. Returns False on stop."""
        start = time.perf_counter()
        with self.cond:
            while not self._stop and (self._pause_requested or not ready()):
                self._paused = self._pause_requested
                self.cond.notify_all()
                self.cond.wait(timeout=0.5)
            self._paused = False
        self.producer_wait_s += time.perf_counter() - start
        return not self._stop

    def _pull_weights(self) -> None:
        with self.cond:
            update, self.mailbox = self.mailbox, None
        if update is not None:
            self.source.load_weights(update[1], update[0])

    def _admissible(self, index: int) -> bool:
        if self.mailbox is not None and self.mailbox[0] > self.source.version:
            return True  # newer weights are waiting: load them, then decide
        return admissible(index, self.dropped, self.source.version, self.max_staleness)

    def _produce(self) -> None:
        try:
            while True:
                index = self.next_index
                # admission control: wait for weights fresh enough for the version this batch is trained at
                while True:
                    if not self._wait(lambda index=index: self._admissible(index)):
                        return
                    self._pull_weights()
                    if admissible(index, self.dropped, self.source.version, self.max_staleness):
                        break
                rollout = self._generate(index)
                if rollout is None:
                    return
                rollout = self.source.reward(rollout)
                if not self._wait(lambda: len(self.queue) < self.queue_size):
                    return
                with self.cond:
                    self.queue.append((index, rollout))
                    self.in_flight = None
                    self.next_index = index + 1
                    self.cond.notify_all()
        except BaseException as err:  # surfaced to the learner by next_rollout
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _generate(self, index: int) -> Rollout | None:
        if not self.partial_rollouts:
            return self.source.generate(index)
        rollout = self.source.generate(index, max_steps=self.chunk_tokens)
        while not self.source.finished(rollout):
            with self.cond:
                self.in_flight = rollout
            if not self._wait(lambda: True):  # a pause request holds the producer here, between chunks
                return None
            self._pull_weights()
            rollout = self.source.resume(index, rollout, max_steps=self.chunk_tokens)
        return rollout

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Queued batches and counters (the batch being generated is regenerated after a resume)."""
        with self.cond:
            return {
                "kind": "async",
                "queue": [(i, r) for i, r in self.queue],
                "next_index": (self.queue[0][0] if self.queue else self.next_index),
                "dropped": self.dropped,
                "published": self.published,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore queue and counters, load the last published weights and start the producer."""
        if state.get("kind") != "async":
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} executor state, not 'async'")
        self.queue = deque((int(i), r) for i, r in state["queue"])
        self.next_index = (self.queue[-1][0] + 1) if self.queue else int(state["next_index"])
        self.dropped = int(state["dropped"])
        self.published = state["published"]
        self.source.load_weights(self.published[1], self.published[0])
        self._launch()


def make_executor(mode: str, source: RolloutSource, *, lag: int, max_staleness: int, queue_size: int,
                  partial_rollouts: bool, chunk_tokens: int):  # fmt: skip
    """``sync`` | ``simulated_async`` | ``async`` → an executor (see the module docstring)."""
    if mode == "sync":
        return LaggedExecutor(source, lag=0)
    if mode == "simulated_async":
        return LaggedExecutor(source, lag=lag)
    if mode == "async":
        return AsyncExecutor(source, max_staleness, queue_size, partial_rollouts, chunk_tokens)
    raise ValueError(f"unknown trainer.mode {mode!r}")
