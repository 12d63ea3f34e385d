"""Executors: *when* and *with which weights* the sample source runs, behind one ``Executor`` protocol.

  LaggedExecutor(lag=0)   synchronous: generate, train, publish, repeat (sampler in this process)
  LaggedExecutor(lag=k)   simulated asynchronous: the sampler holds the newest published weights at least k
                          versions old — deterministic and reproducible, for experiments
  AsyncExecutor           truly asynchronous: a producer thread drives a sampler in its own process
                          (``ProcessSource``) concurrently with the learner, behind a bounded queue, with
                          admission control (a batch is started only if it cannot be trained on at a lag above
                          ``max_staleness``) and optional partial rollouts (a response interrupted by a weight
                          update resumes with the new weights)
  RayExecutor             sampler workers as Ray actors, for any mode (``rollcorr.train.ray_executor``)

The sampler side they drive — ``RolloutSource``, ``SourceSpec``, ``sample_batch`` and the rules for which
weights a batch may use — is ``rollcorr.train.source``; ``make_executor`` (``rollcorr.train.build``) picks one.

Timings every executor reports with a batch: ``time/generate_s`` (the sampler's time on this batch; in
``async`` it overlaps the learner's previous steps) and ``time/wait_s`` (how long the learner waited for it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, ClassVar, Protocol

from rollcorr.engines.base import StateDict
from rollcorr.rollout import Rollout
from rollcorr.train.source import Source, copy_weights, finished, sample_batch
from rollcorr.train.versions import admissible, lagged_version
from rollcorr.user_code import UserCodeError


class Executor(Protocol):
    """What the training loop drives; every executor implements it (subclass it to inherit the defaults).

    Weights come before their version everywhere, as in ``Sampler.load_weights(state_dict, version)``; weight
    versions count learner steps and batch ``step`` is trained on at learner version ``step``. In a
    data-parallel learner one process (rank 0) owns the executor: it calls these methods and hands each rank
    its share of the rollout; the other ranks never touch it.

    local_listeners  True when the sampler's chunk and weight-load listeners run in this process
                     (``source.listeners`` / ``source.load_listeners``), which strategies that follow the
                     sampler need (``ProximalStrategy.follows_sampler``); False for remote workers (Ray)
    source           the sample source the listeners attach to (``local_listeners``), else None
    """

    local_listeners: ClassVar[bool] = True
    source: Source | None

    def start(self, weights: StateDict, version: int) -> None:
        """Begin sampling with the learner's initial weights (a new run; a resumed one calls
        ``load_state_dict`` instead)."""
        ...

    def next_rollout(self, step: int, version: int) -> tuple[Rollout, dict[str, float]]:
        """The rewarded batch for ``step`` — no valid token more than ``max_staleness`` versions behind the
        learner's ``version`` — and the executor's metrics (``time/generate_s``, ``time/wait_s``, ...)."""
        ...

    def publish(self, weights: StateDict, version: int) -> None:
        """The learner's new weights; the executor copies what it keeps (the learner goes on training them)."""
        ...

    def pause(self) -> list[Rollout]:
        """Stop the sampler at its next chunk boundary; returns the rollouts generated but not yet trained
        (``ProximalStrategy.pauses_sampler``). Default: nothing is in flight between steps."""
        return []

    def resume(self) -> None:
        """Undo ``pause``. Default: nothing to do."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue exactly (queued batches, counters, weights still needed)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output and start sampling (instead of ``start``)."""
        ...

    def close(self) -> None:
        """Stop the sampler and release it; ``state_dict()`` still works afterwards."""
        ...


LEARNER_WEIGHTS = "<the learner's weights>"  # in an executor's checkpoint state: weights the checkpoint holds anyway


def with_learner_weights(state: Any, weights: StateDict) -> Any:
    """An executor's checkpoint state with every ``LEARNER_WEIGHTS`` replaced by ``weights`` (the learner's,
    restored from the same checkpoint)."""
    if isinstance(state, str) and state == LEARNER_WEIGHTS:
        return weights
    if isinstance(state, dict):
        return {k: with_learner_weights(v, weights) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(with_learner_weights(v, weights) for v in state)
    return state


class LaggedExecutor(Executor):
    """Synchronous (lag 0) or simulated-asynchronous (lag k) execution, fully deterministic.

    Batch ``step`` is generated on demand with the newest *published* weights of version ≤ step − lag. Only
    the versions still needed are kept (``history``), and they are part of the checkpoint, so a resumed run
    samples with exactly the weights an uninterrupted one would have.

    What it holds of published weights: at lag 0, with a publish after every update (``publish_every`` 1), nothing
    — a version is loaded into the sampler from the learner's own tensors as it is published, and until the next
    publish the learner holds those same weights, so ``history`` marks it ``LEARNER_WEIGHTS`` and a checkpoint
    refers to the learner's weights instead of repeating them (the trainer hands them back on resume). Otherwise
    (lag k, or publishes every N updates) a version is read after the learner has moved on, so it is copied as
    the sampler loads it (``Source.keep``: a bf16 sampler's copy in bf16, a tied tensor once).
    """

    def __init__(self, source: Source, lag: int = 0, publish_every: int = 1):
        if lag < 0 or publish_every < 1:
            raise ValueError(f"lag must be >= 0 and publish_every >= 1, got {lag} and {publish_every}")
        self.source, self.lag = source, lag
        self.copies = lag > 0 or publish_every > 1  # a version is read after the learner's next update
        self.history: dict[int, StateDict | str] = {}
        self.sampler_version: int | None = None
        self._latest = 0

    def start(self, weights: StateDict, version: int) -> None:
        self.history = {}
        self.publish(weights, version)

    def _sync(self, version: int) -> None:
        """Load the newest published weights of version ≤ ``version`` − lag; forget older ones."""
        target = lagged_version(self.history, version, self.lag)
        if target != self.sampler_version:
            self.source.load_weights(self.history[target], target)
            self.sampler_version = target
        self.history = {v: w for v, w in self.history.items() if v >= target}

    def next_rollout(self, step: int, version: int) -> tuple[Rollout, dict[str, float]]:
        start = time.perf_counter()
        self._sync(version)
        generating = time.perf_counter()
        rollout = sample_batch(self.source, step)
        end = time.perf_counter()
        return rollout, {
            "time/generate_s": end - generating,
            "time/wait_s": end - start,  # the learner waits for the whole generation
            "sampler/version": float(self.sampler_version),
        }

    def publish(self, weights: StateDict, version: int) -> None:
        self.history[version] = self.source.keep(weights) if self.copies else weights
        self._latest = version
        self._sync(version)
        if not self.copies:  # loaded (lag 0): the learner holds these weights until the next publish
            self.history[version] = LEARNER_WEIGHTS

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "lagged", "lag": self.lag, "history": self.history, "sampler_version": self.sampler_version,
                "latest": self._latest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state`` with ``LEARNER_WEIGHTS`` replaced by the learner's weights (``Trainer._restore`` does)."""
        if state.get("kind") != "lagged":
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} executor state, not 'lagged'")
        self.history = {int(v): w for v, w in state["history"].items()}
        self._latest = int(state["latest"])
        version = int(state["sampler_version"])
        self.source.load_weights(self.history[version], version)
        self.sampler_version = version
        if not self.copies:
            self.history = {v: LEARNER_WEIGHTS for v in self.history}

    def close(self) -> None:
        self.source.close()


class AsyncExecutor(Executor):
    """A producer thread drives the sampler while the learner trains; batches wait in a bounded queue.

    With ``ProcessSource`` (what ``make_executor`` builds for ``trainer.mode=async``) the sampler computes in
    its own process, so sampling and training run in parallel on two cores; the producer thread only sends
    requests and weights and waits for the answers, without holding the interpreter lock. With an in-process
    ``RolloutSource`` the same logic runs the sampler in the thread itself (tests, debugging).

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
        source: Source,
        max_staleness: int,
        queue_size: int = 2,
        partial_rollouts: bool = False,
        chunk_tokens: int = 2,
    ):
        if max_staleness < 0 or queue_size < 1 or chunk_tokens < 1:
            raise ValueError("max_staleness must be >= 0, queue_size >= 1, chunk_tokens >= 1")
        self.source, self.max_staleness, self.queue_size = source, max_staleness, queue_size
        self.partial_rollouts, self.chunk_tokens = partial_rollouts, chunk_tokens
        self.queue: deque[tuple[int, Rollout, float]] = deque()  # (index, rollout, seconds generating it)
        self.cond = threading.Condition()
        self.mailbox: tuple[StateDict, int] | None = None  # newest published weights not yet loaded
        self.published: tuple[StateDict, int] | None = None  # newest published weights (for checkpoints)
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
    def start(self, weights: StateDict, version: int) -> None:
        self.published = (copy_weights(weights), version)
        self.source.load_weights(*self.published)
        self._launch()

    def _launch(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._produce, name="rollcorr-sampler", daemon=True)
        self._thread.start()

    def publish(self, weights: StateDict, version: int) -> None:
        copied = copy_weights(weights)
        with self.cond:
            self.mailbox = self.published = (copied, version)
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
                    err = self.error
                    if isinstance(err, UserCodeError):  # a reward that failed: said as it is
                        raise UserCodeError(str(err)) from None
                    raise RuntimeError(f"the sampler failed: {type(err).__name__}: {err}") from err
                _index, rollout, generate_s = self.queue.popleft()
                self.cond.notify_all()
            if rollout.max_lag(version) <= self.max_staleness:
                break
            with self.cond:  # defensive: admission control should make this unreachable
                self.dropped += 1
                dropped_now += 1
        metrics = {
            "time/wait_s": time.perf_counter() - start,
            "time/generate_s": generate_s,
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
            rollouts = [r for _, r, _ in self.queue]
            if self.in_flight is not None:
                rollouts.append(self.in_flight)
            return rollouts

    def resume(self) -> None:
        with self.cond:
            self._pause_requested = False
            self.cond.notify_all()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the producer (it finishes the chunk it is sampling), then the sampler (its process, if any)."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        deadline = time.monotonic() + timeout_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            if not self.source.responsive():  # a stopped sampler process finishes no chunk: do not wait on it
                break
            self._thread.join(timeout=0.5)
        self.source.close()  # a producer still stuck in a request gets an error from it, and ends
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
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
            self.source.load_weights(*update)

    def _admissible(self, index: int) -> bool:
        if self.mailbox is not None and self.mailbox[1] > self.source.version:
            return True  # newer weights are waiting: load them, then decide
        return admissible(index, self.dropped, self.source.version, self.max_staleness)

    def _between_chunks(self, rollout: Rollout) -> bool:
        """Between two chunks: a pause request holds the producer here; newer weights are loaded."""
        with self.cond:
            self.in_flight = rollout
        if not self._wait(lambda: True):
            return False
        self._pull_weights()
        return True

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
                start, paused = time.perf_counter(), self.producer_wait_s
                chunk = self.chunk_tokens if self.partial_rollouts else None
                rollout = sample_batch(self.source, index, chunk, between_chunks=self._between_chunks)
                generate_s = time.perf_counter() - start - (self.producer_wait_s - paused)  # pauses excluded
                if not finished(rollout):
                    return  # stopped between chunks
                if not self._wait(lambda: len(self.queue) < self.queue_size):
                    return
                with self.cond:
                    self.queue.append((index, rollout, generate_s))
                    self.in_flight = None
                    self.next_index = index + 1
                    self.cond.notify_all()
        except BaseException as err:  # surfaced to the learner by next_rollout
            with self.cond:
                self.error = err
                self.cond.notify_all()

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Queued batches and counters (the batch being generated is regenerated after a resume)."""
        with self.cond:
            return {
                "kind": "async",
                "queue": [(i, r) for i, r, _ in self.queue],
                "next_index": (self.queue[0][0] if self.queue else self.next_index),
                "dropped": self.dropped,
                "published": self.published,  # (weights, version)
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore queue and counters, load the last published weights and start the producer."""
        if state.get("kind") != "async":
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} executor state, not 'async'")
        self.queue = deque((int(i), r, 0.0) for i, r in state["queue"])
        self.next_index = (self.queue[-1][0] + 1) if self.queue else int(state["next_index"])
        self.dropped = int(state["dropped"])
        weights, version = state["published"]
        self.published = (weights, int(version))
        self.source.load_weights(*self.published)
        self._launch()
