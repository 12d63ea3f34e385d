"""Where rollouts come from: a sampler worker behind an executor, and the one factory that builds them.

``RolloutSource`` is the sampler-side worker: for batch ``index`` it draws prompts (deterministic in the
seed and the index), samples G responses per prompt, and scores them. ``SourceSpec`` says how to build one
(picklable), so it can be built where the sampler runs: in this process, in a sampler process
(``rollcorr.train.sampler_process``) or in a Ray actor (``rollcorr.train.ray_executor``). An executor decides
*when* and *with which weights* the worker runs:

  LaggedExecutor(lag=0)   synchronous: generate, train, publish, repeat (sampler in this process)
  LaggedExecutor(lag=k)   simulated asynchronous: the sampler holds the newest published weights at least k
                          versions old — deterministic and reproducible, for experiments
  AsyncExecutor           truly asynchronous: a producer thread drives a sampler in its own process
                          (``ProcessSource``) concurrently with the learner, behind a bounded queue, with
                          admission control (a batch is started only if it cannot be trained on at a lag above
                          ``max_staleness``) and optional partial rollouts (a response interrupted by a weight
                          update resumes with the new weights)
  RayExecutor             sampler workers as Ray actors, for any mode

Every executor has the same surface: ``start(weights, version)``, ``next_rollout(step, version) -> (Rollout,
metrics)``, ``publish(weights, version)``, ``pause() -> in-flight rollouts`` / ``resume()``, ``state_dict()`` /
``load_state_dict()``, ``close()``. Weights come before their version everywhere, as in
``Sampler.load_weights(state_dict, version)``. Weight versions count learner steps; batch ``step`` is trained
on at learner version ``step`` (one batch per step).

Timings every executor reports with a batch: ``time/generate_s`` (the sampler's time on this batch; in
``async`` it overlaps the learner's previous steps) and ``time/wait_s`` (how long the learner waited for it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from rollcorr.engines import SamplingParams
from rollcorr.rollout import Rollout

StateDict = dict[str, Tensor]


def copy_weights(state_dict: StateDict) -> StateDict:
    """A detached CPU copy (the learner keeps training its own tensors)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


def finished(rollout: Rollout) -> bool:
    """Every row complete (EOS or token cap); False for a batch stopped at a chunk boundary."""
    return all(m.get("finished", True) for m in rollout.meta)


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
        self.listeners: list[Callable[[Rollout], Any]] = []
        # called as (weights, version) whenever the sampler loads weights, from the thread that loads them
        self.load_listeners: list[Callable[[StateDict, int], Any]] = []

    def _batch_seed(self, index: int) -> int:
        return (self.seed * 1_000_003 + index) % (2**31 - 1)

    def _request(self, index: int) -> tuple[list[str], Any, list[dict], list[int]]:
        items = self.task.sample(self.prompts_per_step, seed=self._batch_seed(index), split="train")
        params = replace(self.params, seed=self._batch_seed(index))
        group_ids = [index * self.prompts_per_step + j for j in range(self.prompts_per_step)]
        return [it["prompt"] for it in items], params, items, group_ids

    def sample(self, index: int, partial: Rollout | None = None, max_steps: int | None = None) -> Rollout:
        """Batch ``index`` — started, or ``partial``'s unfinished rows continued with the current weights —
        for at most ``max_steps`` decode steps (None: to the end); rewarded once every row is finished."""
        prompts, params, items, group_ids = self._request(index)
        rollout = self.sampler.generate(
            prompts, params, n=self.group_size, meta=items, group_ids=group_ids, resume=partial,
            max_steps=max_steps,
        )  # fmt: skip
        for listener in self.listeners:
            listener(rollout)
        return self.reward(rollout) if finished(rollout) else rollout

    def reward(self, rollout: Rollout) -> Rollout:
        """Decode each response (special tokens removed) and score it with the task."""
        ids = [row[mask].tolist() for row, mask in zip(rollout.response_ids, rollout.response_mask.bool())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        rewards = [float(self.task.reward(item, text)) for item, text in zip(rollout.meta, texts)]
        return rollout.replace(rewards=torch.tensor(rewards, dtype=torch.float32))

    def load_weights(self, weights: StateDict, version: int) -> None:
        self.sampler.load_weights(weights, version)
        for listener in self.load_listeners:
            listener(weights, version)

    @property
    def version(self) -> int:
        return int(self.sampler.version)

    def close(self) -> None:
        """Nothing to release: the sampler lives as long as this process."""


class Source(Protocol):
    """What an executor drives: ``RolloutSource`` here, or ``ProcessSource`` (the same, in a sampler process)."""

    listeners: list[Callable[[Rollout], Any]]
    load_listeners: list[Callable[[StateDict, int], Any]]

    def sample(self, index: int, partial: Rollout | None = None, max_steps: int | None = None) -> Rollout: ...

    def load_weights(self, weights: StateDict, version: int) -> None: ...

    @property
    def version(self) -> int: ...

    def close(self) -> None: ...


def sample_batch(source: Source, index: int, chunk_tokens: int | None = None, partial: Rollout | None = None,
                 between_chunks: Callable[[Rollout], bool] | None = None) -> Rollout:  # fmt: skip
    """Batch ``index`` (or ``partial`` continued): whole when ``chunk_tokens`` is None, else ``chunk_tokens``
    decode steps at a time — the partial-rollout loop, written once for every executor.

    Between chunks ``between_chunks(rollout)`` runs (load newer weights, so the rest of each response is
    sampled with them; honour a pause) and returns False to stop early: the batch comes back unfinished and
    unrewarded, to be continued later with ``partial=``.
    """
    rollout = source.sample(index, partial, chunk_tokens)
    while not finished(rollout) and (between_chunks is None or between_chunks(rollout)):
        rollout = source.sample(index, rollout, chunk_tokens)
    return rollout


@dataclass(frozen=True)
class SourceSpec:
    """Everything needed to build a ``RolloutSource`` where the sampler runs (picklable; paths absolute)."""

    sampler: str  # engine spec for make_sampler, e.g. "hf:bf16"
    model_path: str | None  # None = the built-in model
    task: str  # make_task name or .jsonl path
    params: SamplingParams
    prompts_per_step: int
    group_size: int
    seed: int
    threads: int = 1  # CPU threads where the sampler runs: torch's pool, llama.cpp's (0 = their default)
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config) -> SourceSpec:
        """The sampler side of a ``TrainConfig`` (the one place its sampling parameters are read)."""
        r, t = config.rollout, config.trainer
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                                top_p=r.top_p, seed=t.seed)  # fmt: skip
        model_path = None if config.model.path == "builtin" else _absolute(config.model.path)
        return cls(config.model.sampler, model_path, _absolute(config.task.name), params, r.prompts_per_step,
                   r.group_size, t.seed, t.threads)  # fmt: skip

    def build(self) -> RolloutSource:
        from rollcorr.engines import make_sampler
        from rollcorr.tasks import make_task

        sampler = make_sampler(self.sampler, self.model_path, threads=self.threads, **self.sampler_kwargs)
        tokenizer = getattr(sampler, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"sampler {self.sampler!r} exposes no tokenizer to decode responses for rewards")
        task = make_task(self.task)
        return RolloutSource(sampler, task, tokenizer, self.params, self.prompts_per_step, self.group_size,
                             self.seed)  # fmt: skip


def _absolute(path: str) -> str:
    """A sampler process may run in another directory: make existing local paths absolute."""
    return str(Path(path).resolve()) if Path(path).exists() else path


def mode_lag(mode: str, lag: int) -> int | None:
    """``trainer.mode`` → the sampler's version lag: ``sync`` 0, ``simulated_async`` ``lag`` (fixed,
    deterministic), ``async`` None (the freshest weights the sampler can get, within ``max_staleness``)."""
    lags = {"sync": 0, "simulated_async": lag, "async": None}
    if mode not in lags:
        raise ValueError(f"trainer.mode: unknown mode {mode!r}; use one of {sorted(lags)}")
    return lags[mode]


class LaggedExecutor:
    """Synchronous (lag 0) or simulated-asynchronous (lag k) execution, fully deterministic.

    Batch ``step`` is generated on demand with the newest *published* weights of version ≤ step − lag. Only
    the versions still needed are kept (``history``), and they are part of the checkpoint, so a resumed run
    samples with exactly the weights an uninterrupted one would have.
    """

    def __init__(self, source: Source, lag: int = 0):
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.source, self.lag = source, lag
        self.history: dict[int, StateDict] = {}
        self.sampler_version: int | None = None
        self._latest = 0

    def start(self, weights: StateDict, version: int) -> None:
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
        self.source.close()


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
                    raise RuntimeError(f"the sampler failed: {type(err).__name__}: {err}") from err
                _index, rollout, generate_s = self.queue.popleft()
                self.cond.notify_all()
            if lag_of(rollout, version) <= self.max_staleness:
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
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
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


def make_executor(config, spec: SourceSpec | None = None, **ray_options: Any):
    """The one executor factory: ``trainer.executor`` × ``trainer.mode`` of a ``TrainConfig`` → an executor.

    The sampler is built once, where it runs: in this process for ``sync`` / ``simulated_async`` (deterministic,
    nothing to overlap), in a sampler process for ``async`` (``ProcessSource``), in Ray actors for
    ``trainer.executor=ray`` — never in the driver for the last two. ``spec`` defaults to
    ``SourceSpec.from_config(config)``; ``ray_options`` go to ``RayExecutor`` (``workers``, ``address``,
    ``worker_cpus``, ``num_cpus``, ``max_restarts``, ...; ``workers`` / ``address`` default to
    ``trainer.ray_workers`` / ``trainer.ray_address``).
    """
    t = config.trainer
    spec = spec or SourceSpec.from_config(config)
    lag = mode_lag(t.mode, t.lag)
    if t.executor == "ray":
        from rollcorr.train.ray_executor import RayExecutor

        ray_options.setdefault("workers", t.ray_workers)
        ray_options.setdefault("address", t.ray_address)
        return RayExecutor(spec, max_staleness=t.max_staleness, queue_size=t.queue_size, lag=lag,
                           partial_rollouts=t.partial_rollouts, chunk_tokens=t.partial_chunk_tokens,
                           **ray_options)  # fmt: skip
    if ray_options:
        raise TypeError(f"{sorted(ray_options)}: options of trainer.executor=ray, not {t.executor!r}")
    if lag is None:
        from rollcorr.train.sampler_process import ProcessSource

        return AsyncExecutor(ProcessSource(spec), t.max_staleness, t.queue_size, t.partial_rollouts,
                             t.partial_chunk_tokens)  # fmt: skip
    return LaggedExecutor(spec.build(), lag)
