"""What each rank plays in a data-parallel run: rank 0 leads, the others follow — or every rank samples its share.

    rank 0      the executor (sync / async sampler process / Ray samplers), the evaluator, the run folder (lock,
                config, metrics, checkpoints' state.pt); each rollout it gets is broadcast to every rank
    rank > 0    ``FollowerExecutor`` receives that rollout; ``SilentLogger``, ``NoLock``: no files written
    every rank  ``ShareExecutor`` (a replicated learner with an in-process sampler, sync or simulated_async):
                each rank samples its 1/N of every batch's prompts with its own sampler and its own copy of the
                weights, and the ranks exchange their shares, so the sampler's work is not serialised on rank 0

A run of one process is rank 0 of a group of one: it leads, and its broadcasts return what they are given.

The model work is split (``train/step.py``); everything that talks to the sampler or the disk stays on rank 0,
so the executors and the π_old strategies need no notion of a rank: every rank gets the same rollouts (and,
when a strategy pauses the sampler, the same in-flight ones) and calls the strategy's hooks alike.
"""

from __future__ import annotations

from typing import Any

from rollcorr.distributed.ranks import Ranks


class LeaderExecutor:
    """Rank 0's executor, unchanged, plus a broadcast of every rollout (and its sampler metrics)."""

    def __init__(self, executor, ranks: Ranks) -> None:
        self.inner, self.ranks = executor, ranks

    def __getattr__(self, name: str) -> Any:  # start, publish, pause, resume, state_dict, close, source, ...
        return getattr(self.inner, name)

    def next_rollout(self, step: int, version: int):
        rollout, metrics = self.inner.next_rollout(step, version)
        self.ranks.broadcast((rollout, metrics))
        return rollout, metrics

    def pause(self) -> list:
        """Pause the sampler; its in-flight rollouts go to every rank (a strategy that ``pauses_sampler``
        scores them split over the ranks and gathers the scores, ``proximal.scoring.score_split``)."""
        in_flight = self.inner.pause()
        self.ranks.broadcast(in_flight)
        return in_flight


class ShareExecutor:
    """Every rank's executor, sampling this rank's share of each batch (``SourceSpec.share``), plus the exchange
    of the shares: each rank gets the whole batch, rank 0's prompts first (the order one source samples them in).
    Each rank publishes its own learner's weights to its own sampler (they are equal on every rank). Its
    metrics are this rank's; the sampler's version is the same on every rank."""

    def __init__(self, executor, ranks: Ranks) -> None:
        self.inner, self.ranks = executor, ranks

    def __getattr__(self, name: str) -> Any:  # start, publish, pause, resume, state_dict, close, source, ...
        return getattr(self.inner, name)

    def next_rollout(self, step: int, version: int):
        from rollcorr.rollout import Rollout

        part, metrics = self.inner.next_rollout(step, version)
        return Rollout.concat(self.ranks.all_gather_object(part)), metrics


class FollowerExecutor:
    """A rank > 0's stand-in for the executor: rollouts arrive from rank 0; weights go nowhere."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def next_rollout(self, step: int, version: int):
        return self.ranks.broadcast(None)

    def start(self, weights, version: int) -> None:
        pass

    def publish(self, weights, version: int) -> None:
        pass

    def pause(self) -> list:
        return self.ranks.broadcast(None)  # rank 0's in-flight rollouts

    def resume(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class SilentLogger:
    """``RunLogger``'s interface, writing nothing (ranks > 0)."""

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class NoLock:
    """``RunLock``'s interface for ranks > 0 (rank 0 holds the run folder's lock)."""

    def release(self) -> None:
        pass
