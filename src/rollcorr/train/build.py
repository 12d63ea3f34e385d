"""Building a run's parts from a ``TrainConfig``: the one place that knows which class serves which setting.

``make_executor(config)`` picks the executor (``trainer.executor`` × ``trainer.mode``) and builds the sample
source where the sampler runs. Nothing here trains: the loop (``rollcorr.train.loop``) receives the parts.
"""

from __future__ import annotations

from typing import Any

from rollcorr.train.executors import AsyncExecutor, Executor, LaggedExecutor
from rollcorr.train.ray_executor import RayExecutor
from rollcorr.train.sampler_process import ProcessSource
from rollcorr.train.source import SourceSpec, mode_lag


def executor_class(config) -> type[Executor]:
    """The executor class ``make_executor`` builds for ``config`` (its capabilities can be asked before any
    sampler is built, e.g. ``local_listeners``)."""
    if config.trainer.executor == "ray":
        return RayExecutor
    return LaggedExecutor if mode_lag(config.trainer.mode, config.trainer.lag) is not None else AsyncExecutor


def make_executor(config, spec: SourceSpec | None = None, **ray_options: Any) -> Executor:
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
        ray_options.setdefault("workers", t.ray_workers)
        ray_options.setdefault("address", t.ray_address)
        return RayExecutor(spec, max_staleness=t.max_staleness, queue_size=t.queue_size, lag=lag,
                           partial_rollouts=t.partial_rollouts, chunk_tokens=t.partial_chunk_tokens,
                           **ray_options)  # fmt: skip
    if ray_options:
        raise TypeError(f"{sorted(ray_options)}: options of trainer.executor=ray, not {t.executor!r}")
    if lag is None:
        return AsyncExecutor(ProcessSource(spec), t.max_staleness, t.queue_size, t.partial_rollouts,
                             t.partial_chunk_tokens)  # fmt: skip
    return LaggedExecutor(spec.build(), lag)
