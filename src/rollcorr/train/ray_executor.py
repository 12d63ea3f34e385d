"""Sampler workers as Ray actors; the learner stays in the driver.

``RayExecutor`` implements the ``Executor`` protocol of ``rollcorr.train.executors`` (``start``, ``next_rollout``,
``publish``, ``pause`` / ``resume``, ``state_dict`` / ``load_state_dict``, ``close``):

    driver (learner)                                    Ray actors (SamplerWorker × W)
    publish(weights, v) ──ray.put once──▶ object ref ──▶ run(index, [ref], v): load_weights if v is new,
    next_rollout(step)  ◀──reorder buffer by index◀───   generate batch `index`, reward it

The driver builds no sampler: each worker builds its own ``RolloutSource`` from a ``SourceSpec``. Every batch
``index`` is produced by ``sample_batch(source, index)`` on some worker, so its prompts and
sampling seed depend only on (seed, index); the driver hands batches to the learner strictly in index order.
Which weights a batch is sampled with:

  lag=None  freshest: the newest published version when the batch is dispatched (asynchronous, like
            ``AsyncExecutor``; timing decides the version, so runs are reproducible only up to that)
  lag=k     fixed: the newest published version ≤ (trained version − k), exactly as ``LaggedExecutor(lag=k)``,
            so the batches equal the in-process executor's bit for bit, with k batches sampled ahead

Admission control (the AsyncExecutor rule): batch ``i`` is trained at learner version ``i − dropped`` (one
batch per step, version == step), so it is dispatched only with weights of version v where
``(i − dropped) − v ≤ max_staleness``; ``next_rollout`` re-checks the oldest token of the batch against the
learner's real version and drops (and counts) a batch that would break the bound.

Partial rollouts (lag=None only): a worker decodes ``chunk_tokens`` tokens at a time. ``publish`` offers the
new version to every busy worker (``offer``, a second thread of the actor); between chunks (the ``sample_batch``
loop every executor shares) the worker loads the newest offered weights and continues the unfinished responses
with them, so each token keeps the version that
produced it. Tokens only get newer than the version the batch was admitted with, so the bound holds. ``pause``
asks busy workers to stop at their next chunk boundary (``interrupt``) and returns their unfinished batches;
``resume`` continues them, with the newest weights, before anything else.

Bounded queue: at most ``queue_size + workers`` batches are ahead of the learner (generated or generating).
A worker that dies (``ray.kill``, OOM, node loss) is replaced by a fresh actor; its batch goes back to the
front of the queue and is generated again from scratch (also when it was partly generated), so every index
is trained exactly once.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from rollcorr.engines.base import StateDict
from rollcorr.rollout import Rollout
from rollcorr.train.executors import Executor
from rollcorr.train.source import SourceSpec, finished, sample_batch
from rollcorr.train.versions import admissible, lagged_version, trained_version
from rollcorr.user_code import UserCodeError

# sane defaults for a local cluster on a small, shared machine (the user's environment wins)
LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report at start-up
    "RAY_prestart_worker_first_driver": "0",  # no idle Python workers competing for the CPUs at start-up
    "RAY_memory_monitor_refresh_ms": "0",  # other tenants' memory must not get our workers OOM-killed
}


class SamplerWorker:
    """The Ray actor: one sampler, one RolloutSource, the weight version it holds.

    With partial rollouts (``chunk_tokens``) the actor is threaded (``max_concurrency=2``): while ``run``
    decodes a batch chunk by chunk, ``offer`` drops newer weights into a mailbox and ``interrupt`` asks ``run``
    to return at the next chunk boundary; both are only looked at between chunks.
    """

    def __init__(self, spec: SourceSpec, chunk_tokens: int | None = None):
        if spec.threads > 0:
            torch.set_num_threads(spec.threads)
        self.source = spec.build()
        self.threads, self.chunk_tokens = spec.threads, chunk_tokens
        self.loaded: int | None = None  # version of the weights in the sampler (None: the checkpoint file's)
        self.lock = threading.Lock()
        self.mailbox: tuple[list, int] | None = None  # newest offered ([object ref], version) not yet loaded
        self.stop: int | None = None  # index of the batch asked to stop at its next chunk boundary

    def ready(self) -> int:
        return os.getpid()

    def offer(self, weights: list, version: int) -> None:
        """Newer weights published while ``run`` decodes: loaded at its next chunk boundary."""
        with self.lock:
            if self.mailbox is None or version > self.mailbox[1]:
                self.mailbox = (weights, version)

    def interrupt(self, index: int) -> None:
        """Make ``run(index, ...)`` return its unfinished batch at the next chunk boundary (a pause). Keyed by
        index, so a request that arrives after the batch finished cannot stop another one."""
        self.stop = index

    def _load(self, weights: list, version: int) -> float:
        """Load ``version`` (``weights`` = [object ref]) unless the sampler holds it; returns the seconds spent."""
        import ray

        if version == self.loaded:
            return 0.0
        start = time.perf_counter()
        self.source.load_weights(ray.get(weights[0]), version)
        self.loaded = version
        return time.perf_counter() - start

    def _load_offered(self) -> float:
        """Load the mailbox's weights if they are newer than the sampler's; returns the seconds spent."""
        with self.lock:
            offered, self.mailbox = self.mailbox, None
        if offered is None or (self.loaded is not None and offered[1] <= self.loaded):
            return 0.0
        return self._load(*offered)

    def run(
        self, index: int, weights: list, version: int, partial: Rollout | None = None
    ) -> tuple[Rollout, dict[str, float]]:
        """Batch ``index`` with weights ``version`` (``weights`` = [object ref], fetched only if new).

        Whole batches without ``chunk_tokens``. With it: decode ``chunk_tokens`` tokens at a time (continuing
        ``partial`` if given), load newer offered weights between chunks, and return early, unfinished and
        without rewards, if interrupted. A finished batch is rewarded.
        """
        start = time.perf_counter()
        load_s = self._load(weights, version)
        if self.chunk_tokens is not None:
            if self.threads > 0:
                torch.set_num_threads(self.threads)  # run may execute in a thread of the actor's pool
            load_s += self._load_offered()

        def between_chunks(_rollout: Rollout) -> bool:  # newer weights continue the responses
            nonlocal load_s
            if self.stop == index:
                return False
            load_s += self._load_offered()
            return True

        rollout = sample_batch(self.source, index, self.chunk_tokens, partial, between_chunks)
        if self.stop == index:
            self.stop = None
        return rollout, {"load_s": load_s, "generate_s": time.perf_counter() - start - load_s,
                         "pid": float(os.getpid())}


class RayExecutor(Executor):
    """``workers`` Ray actors sample batches; the driver orders them by index and enforces the staleness bound.

    spec           how each worker builds its RolloutSource
    workers        number of sampler actors
    max_staleness  no batch is trained at a lag above this (admission control + a re-check)
    queue_size     batches allowed to wait for the learner (plus one generating per worker)
    lag            None = freshest weights (asynchronous); k = the LaggedExecutor(lag=k) weights (deterministic)
    address        None: start a local cluster (``num_cpus``); "auto" or "ray://host:port": join that cluster
    worker_cpus    CPUs each actor reserves; worker_gpus likewise (a vLLM sampler on a GPU node: 1)
    max_restarts   worker deaths tolerated over the run before giving up
    partial_rollouts  workers decode ``chunk_tokens`` tokens at a time and continue unfinished responses with
                   weights published meanwhile (freshest-weights mode only, as ``AsyncExecutor``)
    """

    local_listeners = False  # the samplers live in Ray actors: no listener of this process sees their chunks
    source = None

    def __init__(
        self,
        spec: SourceSpec,
        workers: int = 2,
        max_staleness: int = 4,
        queue_size: int = 2,
        lag: int | None = None,
        address: str | None = None,
        num_cpus: int | None = None,
        worker_cpus: float = 1.0,
        worker_gpus: float = 0.0,
        max_restarts: int = 8,
        ready_timeout_s: float = 300.0,
        partial_rollouts: bool = False,
        chunk_tokens: int = 2,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if max_staleness < 0 or queue_size < 1 or max_restarts < 0:
            raise ValueError(
                f"need max_staleness >= 0, queue_size >= 1, max_restarts >= 0; got {max_staleness}, "
                f"{queue_size}, {max_restarts}"
            )
        if lag is not None and not 0 <= lag <= max_staleness:
            raise ValueError(f"lag must be in [0, max_staleness={max_staleness}], got {lag}")
        if partial_rollouts and lag is not None:
            raise ValueError(
                f"partial rollouts take the freshest weights between chunks: they need lag=None "
                f"(trainer.mode=async), got lag={lag}"
            )
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.spec, self.num_workers, self.max_staleness = spec, workers, max_staleness
        self.queue_size, self.lag, self.address = queue_size, lag, address
        self.num_cpus = num_cpus
        self.worker_cpus, self.worker_gpus = worker_cpus, worker_gpus
        self.max_restarts, self.ready_timeout_s = max_restarts, ready_timeout_s
        self.partial_rollouts, self.chunk_tokens = partial_rollouts, chunk_tokens
        self.actors: list = []  # slot → actor handle
        self.busy: set[int] = set()  # slots with a task in flight
        self.pending: dict = {}  # object ref → (index, slot)
        self.done: dict[int, tuple[Rollout, dict[str, float]]] = {}  # reorder buffer
        self.retry: set[int] = set()  # indices whose worker died: generated again (from scratch) first
        self.partial: dict[int, Rollout] = {}  # unfinished batches handed back by a pause: continued first
        self.published: dict[int, Any] = {}  # version → object ref of its weights
        self.latest = -1  # newest published version
        self.learner_version = 0  # newest learner version the driver has told us about
        self.next_index = 0  # next batch index never dispatched
        self.next_train = 0  # next batch index the learner gets
        self.dropped = 0
        self.restarts = 0
        self._paused = False
        self._next_slot = 0
        self._owns_ray = False
        self._ray = None
        self._closed_weights: dict[int, StateDict] = {}

    # ---- cluster and workers -------------------------------------------------------------------------
    def _connect(self):
        import ray

        if not ray.is_initialized():
            if self.address is None:
                for key, value in LOCAL_RAY_ENV.items():
                    os.environ.setdefault(key, value)
                cpus = self.num_cpus or max(1, int(self.num_workers * self.worker_cpus))
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            self._owns_ray = True
        self._ray = ray
        return ray

    def _spawn(self, slot: int):
        ray = self._ray
        # partial rollouts: a second thread takes `offer` / `interrupt` while `run` decodes
        concurrency = 2 if self.partial_rollouts else 1
        actor_cls = ray.remote(num_cpus=self.worker_cpus, num_gpus=self.worker_gpus, max_restarts=0,
                               max_concurrency=concurrency)(SamplerWorker)
        actor = actor_cls.remote(self.spec, self.chunk_tokens if self.partial_rollouts else None)
        if slot < len(self.actors):
            self.actors[slot] = actor
        else:
            self.actors.append(actor)
        return actor

    def _start_workers(self) -> None:
        ray = self._connect()
        self.actors = []
        for slot in range(self.num_workers):
            self._spawn(slot)
        pings = [a.ready.remote() for a in self.actors]
        ready, waiting = ray.wait(pings, num_returns=len(pings), timeout=self.ready_timeout_s)
        if waiting:
            raise RuntimeError(
                f"{len(waiting)} of {self.num_workers} sampler workers not ready after {self.ready_timeout_s:.0f} s; "
                f"each needs {self.worker_cpus} CPU and {self.worker_gpus} GPU, the cluster has "
                f"{ray.cluster_resources()}"
            )
        ray.get(ready)  # surfaces a worker's construction error (bad model path, unknown engine, ...)

    def _restart(self, slot: int, err: BaseException) -> None:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RuntimeError(
                f"sampler workers died {self.restarts} times (max_restarts={self.max_restarts})"
            ) from err
        self._ray.kill(self.actors[slot], no_restart=True)
        self._spawn(slot)

    # ---- dispatch and collect ------------------------------------------------------------------------
    def _weights_for(self, index: int) -> int | None:
        """The version batch ``index`` is sampled with, or None if it may not start yet (admission control)."""
        trained = trained_version(index, self.dropped)
        if self.lag is None:
            version = self.latest
        else:
            if self.learner_version < trained - self.lag:
                return None  # the version it must use is not trained yet
            version = lagged_version(self.published, trained, self.lag)
        return version if admissible(index, self.dropped, version, self.max_staleness) else None

    def _pump(self) -> None:
        """Give work to idle workers (round-robin, so every worker is used and a dead one is noticed):
        unfinished batches and retries first (lowest index first), then new indices inside the queue bound."""
        if self._paused or not self.actors:
            return
        first = self._next_slot
        for turn in range(self.num_workers):
            slot = (first + turn) % self.num_workers
            if slot in self.busy:
                continue
            partial = None
            if self.retry or self.partial:
                index = min(self.retry | set(self.partial))
                partial = self.partial.get(index)
            elif self.next_index < self.next_train + self.queue_size + self.num_workers:
                index = self.next_index
            else:
                return
            # an unfinished batch was admitted when it started; newer weights only shorten its lag
            version = self.latest if partial is not None else self._weights_for(index)
            if version is None:
                return
            ref = self.actors[slot].run.remote(index, [self.published[version]], version, partial)
            self.pending[ref] = (index, slot)
            self.busy.add(slot)
            self._next_slot = (slot + 1) % self.num_workers
            if partial is not None:
                del self.partial[index]
            elif index in self.retry:
                self.retry.discard(index)
            else:
                self.next_index += 1

    def _collect(self, timeout: float | None) -> None:
        """Wait for at least one finished task (up to ``timeout``) and file its batch or handle its death."""
        ray = self._ray
        from ray.exceptions import RayActorError

        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        for ref in ready:
            index, slot = self.pending.pop(ref)
            self.busy.discard(slot)
            try:
                rollout, info = ray.get(ref)
            except RayActorError as err:  # the worker died: replace it, generate the batch again
                self._restart(slot, err)
                self.retry.add(index)
                continue
            except ray.exceptions.RayTaskError as err:
                if isinstance(getattr(err, "cause", None), UserCodeError):  # a reward that failed: said as it is
                    raise UserCodeError(str(err.cause)) from None
                raise RuntimeError(f"sampler worker failed on batch {index}: {err}") from err
            if finished(rollout):
                self.done[index] = (rollout, info)
            else:  # interrupted by a pause
                self.partial[index] = rollout

    def _prune(self) -> None:
        """Forget weights no future batch can use (in-flight tasks hold their own references)."""
        if self.lag is None:
            keep = self.latest
        else:
            keep = lagged_version(self.published, trained_version(self.next_train, self.dropped), self.lag)
        self.published = {v: ref for v, ref in self.published.items() if v >= keep}

    # ---- learner side --------------------------------------------------------------------------------
    def start(self, weights: StateDict, version: int) -> None:
        self._start_workers()
        self.learner_version = version
        self.publish(weights, version)

    def publish(self, weights: StateDict, version: int) -> None:
        """One ``ray.put`` per version (serialised now, so the learner may keep training its tensors)."""
        if self._ray is None:
            raise RuntimeError("RayExecutor.publish before start() / load_state_dict()")
        self.published[version] = self._ray.put({k: v.detach().cpu() for k, v in weights.items()})
        self.latest = max(self.latest, version)
        self.learner_version = max(self.learner_version, version)
        if self.partial_rollouts and version == self.latest:  # busy workers load it at their next chunk
            for slot in self.busy:
                self.actors[slot].offer.remote([self.published[version]], version)
        self._prune()
        self._pump()

    def next_rollout(self, step: int, version: int) -> tuple[Rollout, dict[str, float]]:
        """Batch ``next_train`` (blocks until a worker has it); drops a batch above ``max_staleness``."""
        if self._paused:
            raise RuntimeError("RayExecutor.next_rollout while paused: call resume() first")
        start = time.perf_counter()
        self.learner_version = max(self.learner_version, version)
        dropped_now = 0
        while True:
            index = self.next_train
            self._pump()
            while index not in self.done:
                if not self.pending:
                    raise RuntimeError(
                        f"batch {index} cannot start: it is trained at version {version} and the newest "
                        f"published weights are version {self.latest}, above max_staleness={self.max_staleness}"
                    )
                self._collect(timeout=1.0)
                self._pump()
            rollout, info = self.done.pop(index)
            self.next_train += 1
            if rollout.max_lag(version) <= self.max_staleness:
                break
            self.dropped += 1  # defensive: admission control should make this unreachable
            dropped_now += 1
        self._prune()
        self._pump()
        return rollout, {
            "time/wait_s": time.perf_counter() - start,
            "time/generate_s": info["generate_s"],
            "sampler/version": float(version - rollout.max_lag(version)),  # oldest weights in the batch
            "async/queue_size": float(len(self.done)),
            "async/dropped_total": float(self.dropped),
            "async/dropped_now": float(dropped_now),
            "ray/in_flight": float(len(self.pending)),
            "ray/restarts_total": float(self.restarts),
        }

    def pause(self) -> list[Rollout]:
        """Stop dispatching; partial rollouts: workers stop at their next chunk boundary, else in-flight
        batches finish. Returns every batch not yet trained: generated ones, then unfinished ones."""
        self._paused = True
        if self.partial_rollouts:
            for index, slot in self.pending.values():
                self.actors[slot].interrupt.remote(index)
        while self.pending:
            self._collect(timeout=1.0)
        return [self.done[i][0] for i in sorted(self.done)] + [self.partial[i] for i in sorted(self.partial)]

    def resume(self) -> None:
        self._paused = False
        self._pump()

    def close(self) -> None:
        """Stop the workers (in-flight batches are discarded) and, if this executor started Ray, Ray itself.
        ``state_dict()`` still works afterwards (the trainer checkpoints after closing)."""
        ray = self._ray
        if ray is None:
            return
        self._closed_weights = {v: ray.get(ref) for v, ref in self.published.items()}
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.pending, self.busy, self.partial = [], {}, set(), {}
        if self._owns_ray:
            ray.shutdown()
        self._ray = None

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Generated-but-untrained batches, counters and the weights still needed (in-flight batches are
        generated again after a resume)."""
        if self._ray is not None:
            weights = {v: self._ray.get(ref) for v, ref in self.published.items()}
        else:
            weights = self._closed_weights
        return {
            "kind": "ray",
            "lag": self.lag,
            "next_index": self.next_train,
            "done": {i: r for i, r in self.done.items()},
            "dropped": self.dropped,
            "restarts": self.restarts,
            "latest": self.latest,
            "learner_version": self.learner_version,
            "published": weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters, buffered batches and weights, then start the workers."""
        if state.get("kind") != "ray":
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} executor state, not 'ray'")
        if state["lag"] != self.lag:
            raise ValueError(
                f"checkpoint was written with lag={state['lag']}, this executor has lag={self.lag}"
            )
        self._start_workers()
        self.next_train = int(state["next_index"])
        self.done = {int(i): r for i, r in state["done"].items()}
        self.next_index = max([self.next_train, *(i + 1 for i in self.done)])
        self.retry = set(range(self.next_train, self.next_index)) - set(self.done)
        self.dropped, self.restarts = int(state["dropped"]), int(state["restarts"])
        self.latest, self.learner_version = int(state["latest"]), int(state["learner_version"])
        self.published = {int(v): self._ray.put(w) for v, w in state["published"].items()}
        self._pump()

