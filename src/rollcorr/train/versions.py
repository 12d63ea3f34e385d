"""Which weights a batch gets: the version arithmetic every executor shares (``executors.py``, ``ray_executor.py``).

    mode_lag(mode, lag)          trainer.mode → the sampler's version lag (0, a fixed lag, or None: the freshest)
    trained_version(i, dropped)  the learner version batch i is trained at (one batch per step)
    admissible(...)              the staleness bound: may batch i be sampled with these weights?
    lagged_version(...)          the fixed-lag rule: which published weights a batch is sampled with

Written once, read by every executor, so sync, simulated-async, async and Ray agree on what a lag is.
"""

from __future__ import annotations

from collections.abc import Iterable


def mode_lag(mode: str, lag: int) -> int | None:
    """``trainer.mode`` → the sampler's version lag: ``sync`` 0, ``simulated_async`` ``lag`` (fixed,
    deterministic), ``async`` None (the freshest weights the sampler can get, within ``max_staleness``)."""
    from rollcorr.train.config import MODES

    lags = dict(zip(MODES, (0, lag, None)))
    if mode not in lags:
        raise ValueError(f"trainer.mode: unknown mode {mode!r}; use one of {sorted(lags)}")
    return lags[mode]


def trained_version(index: int, dropped: int) -> int:
    """The learner version batch ``index`` is trained at (one batch per step; dropped batches take none)."""
    return index - dropped


def admissible(index: int, dropped: int, sampler_version: int, max_staleness: int) -> bool:
    """May batch ``index`` be sampled with weights ``sampler_version``? (no token trained at lag > bound)"""
    return trained_version(index, dropped) - sampler_version <= max_staleness


def lagged_version(published: Iterable[int], trained: int, lag: int) -> int:
    """The weights a batch trained at learner version ``trained`` is sampled with under a fixed lag ``lag``:
    the newest published version ≤ trained − lag, or the oldest published one while none is that old (the
    first ``lag`` steps of a run sample with the initial weights)."""
    versions = list(published)
    if not versions:
        raise ValueError("no weights published yet")
    eligible = [v for v in versions if v <= trained - lag]
    return max(eligible) if eligible else min(versions)
