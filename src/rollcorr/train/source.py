"""The sample source: what the sampler side of training is, wherever it runs.

``RolloutSource`` is the sampler-side worker: for batch ``index`` it draws prompts (deterministic in the seed
and the index), samples G responses per prompt, and scores them. ``SourceSpec`` says how to build one
(picklable), so it can be built where the sampler runs: in this process, in a sampler process
(``rollcorr.train.sampler_process``) or in a Ray actor (``rollcorr.train.ray_executor``). ``sample_batch`` is the
one loop that produces a batch, whole or chunk by chunk (partial rollouts).

Which weights a batch gets, written once for every executor:

  trained_version(i, dropped) = i − dropped          batch i is trained at this learner version
  admissible(i, dropped, v, S) ⇔ trained − v ≤ S     may batch i be sampled with weights v (max_staleness S)
  lagged_version(published, trained, k)               lag k: the newest published v ≤ trained − k
                                                      (the oldest published one while none is that old)

Weight versions count learner steps; batch ``step`` is trained on at learner version ``step`` (one batch per
step). The executors (``rollcorr.train.executors``, ``rollcorr.train.ray_executor``) decide *when* the source
runs; this module decides nothing about time.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from rollcorr.engines import backend_of
from rollcorr.engines.base import SamplingParams, StateDict, copy_weights
from rollcorr.envs import Episodes, Limits, Renderer, as_environment
from rollcorr.models.builtin import model_location
from rollcorr.rollout import Rollout


def finished(rollout: Rollout) -> bool:
    """Every row complete (EOS or token cap); False for a batch stopped at a chunk boundary."""
    return all(m.get("finished", True) for m in rollout.meta)


class RolloutSource:
    """The sampler worker: prompts for batch ``index`` → G trajectories each, played with the environment →
    rewards (a task is a one-turn environment: ``envs.SingleTurn``).

    Owned by one thread at a time. ``seed`` and ``index`` fix the prompts and the sampling seed, so the same
    weights give the same batch. A batch sampled chunk by chunk keeps its episodes here between calls
    (``live``); a partial batch whose episodes are not here (handed to another Ray worker, or restored from
    a checkpoint: an environment's state is not saved) is played again from its start.
    """

    def __init__(self, sampler, env, tokenizer, params, prompts_per_step: int, group_size: int, seed: int,
                 chat: bool = False, share: tuple[int, int] = (0, 1), limits: Limits = Limits()):
        self.sampler, self.env, self.tokenizer = sampler, as_environment(env), tokenizer
        self.params, self.prompts_per_step, self.group_size = params, prompts_per_step, group_size
        self.seed = seed
        # (r, N): this source samples the r-th of N equal slices of each batch's prompts (data-parallel ranks
        # that each sample their share, ``distributed.roles.ShareExecutor``), with a sampling stream of its own
        self.share = share
        self.chat = chat  # prompts through the tokenizer's chat template (rollcorr.tasks.chat)
        self.renderer = Renderer(tokenizer, chat)
        self.limits = limits  # trajectories' turns and tokens; user code's time limit, rewards' clipping
        self.live: dict[int, tuple[Episodes, str]] = {}  # batch index → its episodes, and the key its rows carry
        # called with every generated chunk, before any newer weights are loaded (e.g. the old-logit model)
        self.listeners: list[Callable[[Rollout], Any]] = []
        # called as (weights, version) whenever the sampler loads weights, from the thread that loads them
        self.load_listeners: list[Callable[[StateDict, int], Any]] = []

    def _batch_seed(self, index: int) -> int:
        return (self.seed * 1_000_003 + index) % (2**31 - 1)

    def _request(self, index: int) -> tuple[list[dict], Any, list[int]]:
        """Batch ``index``'s rows (this source's share of its prompts, each repeated G times), sampling parameters
        and group ids. The prompts are drawn for the whole batch, so the N shares together are the batch one
        source would sample."""
        items = self.env.sample(self.prompts_per_step, seed=self._batch_seed(index), split="train")
        rank, world = self.share
        size = self.prompts_per_step // world
        first = rank * size
        seed = self._batch_seed(index) if world == 1 else (self._batch_seed(index) * world + rank) % (2**31 - 1)
        params = replace(self.params, seed=seed)
        group_ids = [index * self.prompts_per_step + j for j in range(first, first + size)]
        items = items[first : first + size]
        g = self.group_size
        return [it for it in items for _ in range(g)], params, [gid for gid in group_ids for _ in range(g)]

    def sample(self, index: int, partial: Rollout | None = None, max_steps: int | None = None) -> Rollout:
        """Batch ``index`` — started, or ``partial``'s unfinished rows continued with the current weights —
        for at most ``max_steps`` decode steps (None: every episode to its end); rewarded once every episode
        is over."""
        rows, params, group_ids = self._request(index)
        key = partial.meta[0].get("episodes") if partial is not None and partial.meta else None
        if partial is not None and self.live.get(index, (None, None))[1] != key:
            partial = None  # its episodes are elsewhere: played again from the start
        if partial is None:
            episodes = Episodes(self.env, rows, self.renderer, self.limits, params.max_new_tokens)
            key = uuid.uuid4().hex
            self.live[index] = (episodes, key)
            meta = [{**item, "episodes": key} for item in rows]
            rollout = self.sampler.generate(episodes.prompts(), params, meta=meta, group_ids=group_ids,
                                            max_steps=max_steps)
        else:
            episodes = self.live[index][0]
            rollout = self.sampler.generate(None, params, resume=partial, max_steps=max_steps)
        for listener in self.listeners:
            listener(rollout)
        rollout = episodes.advance(rollout, self.version)
        while max_steps is None and not finished(rollout):
            rollout = self.sampler.generate(None, params, resume=rollout)
            for listener in self.listeners:
                listener(rollout)
            rollout = episodes.advance(rollout, self.version)
        if not finished(rollout):
            return rollout
        del self.live[index]
        return self.reward(rollout, episodes)

    def reward(self, rollout: Rollout, episodes: Episodes) -> Rollout:
        """A finished batch with its rewards: each trajectory's sum over its turns (``Episodes.rewarded``); each row
        marked when its last model token is not EOS, cut at the token cap (``meta[i]["truncated"]``, TRL's rule)."""
        rollout = episodes.rewarded(rollout)
        for meta, ids, mask in zip(rollout.meta, rollout.response_ids, rollout.response_mask.bool()):
            last = ids[mask]
            meta["truncated"] = bool(len(last)) and int(last[-1]) != self.tokenizer.eos_token_id
        return rollout

    def keep(self, weights: StateDict) -> StateDict:
        """A copy of published weights to load later (simulated async), in the smallest form the sampler loads to
        the same state: its ``kept_weights`` (``HFSampler``: each tensor in the dtype it holds it, so half the
        bytes for a bf16 sampler), or an fp32 CPU copy for a sampler without one."""
        own = getattr(self.sampler, "kept_weights", None)
        return own(weights) if own is not None else copy_weights(weights)

    def load_weights(self, weights: StateDict, version: int) -> None:
        self.sampler.load_weights(weights, version)
        for listener in self.load_listeners:
            listener(weights, version)

    @property
    def version(self) -> int:
        return int(self.sampler.version)

    def responsive(self) -> bool:
        """Whether a request in progress can still finish: always, in this process."""
        return True

    def close(self) -> None:
        """Nothing to release: the sampler lives as long as this process."""


class Source(Protocol):
    """What an executor drives: ``RolloutSource`` here, or ``ProcessSource`` (the same, in a sampler process)."""

    listeners: list[Callable[[Rollout], Any]]
    load_listeners: list[Callable[[StateDict, int], Any]]

    def sample(self, index: int, partial: Rollout | None = None, max_steps: int | None = None) -> Rollout: ...

    def load_weights(self, weights: StateDict, version: int) -> None: ...

    def keep(self, weights: StateDict) -> StateDict: ...

    @property
    def version(self) -> int: ...

    def responsive(self) -> bool: ...

    def close(self) -> None: ...


def sample_batch(source: Source, index: int, chunk_tokens: int | None = None, partial: Rollout | None = None,
                 between_chunks: Callable[[Rollout], bool] | None = None) -> Rollout:
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


def sampling_params(config) -> SamplingParams:
    """A ``TrainConfig``'s sampling parameters (``rollout.*``, seeded with ``trainer.seed``): the one place they
    are read, by the run's sampler, its checks and ``--measure-engines``."""
    r = config.rollout
    keep_mask = config.algorithm.correction.sampler_distribution == "keep_mask"  # the kept sets, for the learner
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                          seed=config.trainer.seed, record_kept_ids=keep_mask)


@dataclass(frozen=True)
class SourceSpec:
    """Everything needed to build a ``RolloutSource`` where the sampler runs (picklable; paths absolute)."""

    sampler: str  # engine spec for make_sampler, e.g. "hf:bf16"
    model_path: str | None  # the model as the engines take it: models.builtin.model_location (None: built-in)
    task: Any  # the run's TaskConfig (paths absolute), or a task name: built where the sampler runs
    params: SamplingParams
    prompts_per_step: int
    group_size: int
    seed: int
    threads: int = 1  # CPU threads where the sampler runs: torch's pool, llama.cpp's (0 = their default)
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    backend_module: str | None = None  # imported where the sampler is built: it registers the sampler's backend
    share: tuple[int, int] = (0, 1)  # (r, N): sample the r-th of N slices of each batch's prompts (RolloutSource)
    plugins: tuple[str, ...] = ()  # the run's plugins (rollcorr.plugins), imported where the source is built

    def __post_init__(self) -> None:
        if isinstance(self.task, str):  # a task name alone: a built-in task or a data set with its defaults
            from rollcorr.train.config import TaskConfig

            object.__setattr__(self, "task", TaskConfig(name=self.task))

    @classmethod
    def from_config(cls, config) -> SourceSpec:
        """The sampler side of a ``TrainConfig`` (the one place its sampling parameters are read)."""
        r, t = config.rollout, config.trainer
        params = sampling_params(config)
        model_path = model_location(config.model.path)
        task = replace(config.task, name=_absolute(config.task.name),
                       eval_file=config.task.eval_file and _absolute(config.task.eval_file))
        backend = backend_of(config.model.sampler)
        kwargs = {"device": config.model.device} if backend.in_process and config.model.device is not None else {}
        return cls(config.model.sampler, model_path, task, params, r.prompts_per_step, r.group_size, t.seed,
                   t.threads, kwargs, backend.module, plugins=tuple(config.plugins))

    def build(self) -> RolloutSource:
        """The source, built where it runs (this process, a sampler process or a Ray worker). The run's plugins
        and the installed ones are imported first (``rollcorr.plugins``: the sampler, the task and its reward may
        be theirs), and so is the module that registered the sampler's backend (``backend_module``; one defined
        in a script, ``__main__``, cannot be, there)."""
        import importlib

        from rollcorr.engines import make_sampler
        from rollcorr.plugins import load_plugins
        from rollcorr.tasks.chat import uses_chat

        load_plugins(self.plugins)
        if self.backend_module not in (None, "__main__"):
            importlib.import_module(self.backend_module)
        sampler = make_sampler(self.sampler, self.model_path, threads=self.threads, **self.sampler_kwargs)
        tokenizer = getattr(sampler, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"sampler {self.sampler!r} exposes no tokenizer to decode responses for rewards")
        return RolloutSource(sampler, self.task.environment(), tokenizer, self.params, self.prompts_per_step,
                             self.group_size, self.seed, chat=uses_chat(tokenizer, self.task.chat),
                             share=self.share, limits=self.task.limits())


def _absolute(path: str) -> str:
    """A sampler process may run in another directory: make existing local paths absolute."""
    return str(Path(path).resolve()) if Path(path).exists() else path
