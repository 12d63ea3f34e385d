"""Building a run's parts from a ``TrainConfig``: the one place that knows which class serves which setting.

    check_components(config)   everything checkable before a model loads; returns what it built to check it
                               (the step's settings, the π_old strategy, the task), used by the run as is
    build_step_config(config)  the settings of one training step (loss, correction, advantages, batches)
    build_proximal(config)     the π_old strategy
    build_learner(config, ranks)  the learner (this rank's: sharded over a process group) and its optimizer
    make_executor(config)      the executor (``trainer.executor`` × ``trainer.mode``), its sampler built where
                               it runs; ``follow_sampler`` connects a strategy that follows the sampler to it;
                               ``rank_executor`` puts it on rank 0 (the leader of any group, one process too)
    build_evaluator(config)    greedy evaluation on held-out prompts (None without any)

Nothing here trains: the loop (``rollcorr.train.loop``) receives the parts.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from rollcorr.distributed.ranks import ONE_PROCESS, Ranks
from rollcorr.distributed.roles import FollowerExecutor, LeaderExecutor, ShareExecutor
from rollcorr.engines import backend_of, make_learner, make_sampler, parse_spec, sampler_class
from rollcorr.engines.preflight import PreflightError, preflight
from rollcorr.engines.spec import check_kept_ids, check_kept_mass, check_truncation
from rollcorr.losses import LossConfig
from rollcorr.losses.oapl import value_temperature
from rollcorr.proximal import ProximalStrategy, make_proximal
from rollcorr.tasks import Task
from rollcorr.tasks.chat import uses_chat
from rollcorr.train.config import ConfigError, TrainConfig, learner_processes
from rollcorr.train.eval import GreedyEvaluator
from rollcorr.train.executors import AsyncExecutor, Executor, LaggedExecutor
from rollcorr.train.ray_executor import RayExecutor
from rollcorr.train.sampler_process import ProcessSource
from rollcorr.train.source import SourceSpec, sampling_params
from rollcorr.train.step import StepConfig
from rollcorr.train.versions import mode_lag


def check_components(config: TrainConfig) -> tuple[StepConfig, ProximalStrategy, Task]:
    """What the config names exists and can do what the config asks, checked without loading a model:
    engine specs, optional packages and the model folder (before any run folder), a trainable learner, the
    task, the sampler's and the executor's capabilities. Returns what it built on the way — the step's
    settings, the π_old strategy and the task — for the run to use (each is built once)."""
    step_config = build_step_config(config)
    proximal = build_proximal(config)
    for key, spec in (("sampler", config.model.sampler), ("learner", config.model.learner)):
        try:
            preflight(spec, config.model.path, role=key)
        except PreflightError as err:
            raise ConfigError(f"model.{'path' if err.field == 'path' else key}: {err}") from None
    check_trainable_learner(config)
    params = sampling_params(config)
    try:
        check_truncation(config.model.sampler, config.rollout.top_k, config.rollout.top_p,
                         ("rollout.top_k", "rollout.top_p"))
        check_kept_mass(config.model.sampler, params.truncated,
                        config.algorithm.correction.sampler_distribution == "full",
                        "algorithm.correction.sampler_distribution=full")
        check_kept_ids(config.model.sampler, params.records_kept_ids, "algorithm.correction.sampler_distribution",
                       "accept the kept-mass offset in every ratio with algorithm.correction.sampler_distribution="
                       "truncated")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    task = build_task(config)
    if config.trainer.partial_rollouts and not sampler_class(config.model.sampler).can_resume:
        raise ConfigError(
            f"trainer.partial_rollouts: sampler {config.model.sampler!r} cannot resume responses"
        )
    if proximal.follows_sampler and not executor_class(config).local_listeners:
        raise ConfigError(f"algorithm.proximal.name: {proximal.name!r} scores chunks as the sampler makes them; "
                          f"that needs trainer.executor=local (an executor whose sampler reports to this process), "
                          f"not {config.trainer.executor!r}")
    if learner_processes(config) > 1 and not proximal.data_parallel:
        raise ConfigError(f"algorithm.proximal.name: {proximal.name!r} cannot run with trainer.ranks > 1: it follows "
                          "the sampler, whose weight loads and chunks reach rank 0 alone and are scored on a "
                          "background thread, while a sharded forward needs every rank; snapshot gives the same "
                          "exact old log-probs at trainer.ranks > 1")
    check_fsdp(config)
    check_device(config)
    return step_config, proximal, task


def check_device(config: TrainConfig) -> None:
    """``model.device`` names a device this machine has (and one an hf engine can use)."""
    device = config.model.device
    if device is None or device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"model.device: {device!r} asked for, but this machine has no CUDA device "
                          "(torch.cuda.is_available() is False); use cpu or leave it null")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"model.device: {device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if learner_processes(config) > 1:
        raise ConfigError("model.device: a data-parallel run puts rank r on cuda:r itself; leave model.device null")


def build_task(config: TrainConfig):
    """The run's environment from ``task.*`` (the task's items, played through ``task.env`` or as one turn);
    ConfigError naming the key at fault (``DataError.field``)."""
    from rollcorr.tasks import DataError

    try:
        task = config.task.build()
    except DataError as err:
        raise ConfigError(f"task.{err.field}: {err}") from None
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"task.name: {err}") from None
    if config.task.eval_prompts > 0 and not task.held_out(1, config.task.eval_seed):  # "n/a -> n/a", said now
        why = getattr(task, "held_out_rule", "")
        raise ConfigError(f"task.eval_prompts: {config.task.eval_prompts} held-out prompts asked, but "
                          f"{config.task.name} has no held-out rows{f' ({why})' if why else ''}; give some (a "
                          "split field of 'test', task.eval_file) or train without evaluation: task.eval_prompts=0")
    try:
        return config.task.environment(task)
    except ValueError as err:
        raise ConfigError(f"task.env: {err}") from None


def check_fsdp(config: TrainConfig) -> None:
    """``trainer.fsdp``: options of a data-parallel learner only; mixed precision only where it can act (CUDA); a
    sharded layout only for a learner that can be sharded (``Backend.can_shard``)."""
    from rollcorr.train.config import FSDPConfig

    fsdp, default = config.trainer.fsdp, FSDPConfig()
    learner, parallel = config.model.learner, learner_processes(config) > 1
    if parallel and config.trainer.data_parallel == "shard" and not backend_of(learner).can_shard(parse_spec(learner)):
        raise ConfigError(f"model.learner: {learner!r} cannot be sharded (FSDP2 gathers the weights outside its "
                          "forward); use trainer.data_parallel=replicate or auto")
    changed = next((f.name for f in dataclasses.fields(fsdp) if getattr(fsdp, f.name) != getattr(default, f.name)), None)
    if changed is not None and not parallel:
        raise ConfigError(f"trainer.fsdp.{changed}: applies to a data-parallel learner only (trainer.ranks > 1 "
                          "or torchrun); this run trains in one process, unsharded")
    if changed is not None and config.trainer.data_parallel == "replicate":
        raise ConfigError(f"trainer.fsdp.{changed}: applies to a sharded learner, and trainer.data_parallel=replicate "
                          "keeps the whole model on every rank (set trainer.data_parallel=shard, or leave it auto: "
                          "an FSDP option then shards)")
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(fsdp, key) is not None and not torch.cuda.is_available():
            raise ConfigError(f"trainer.fsdp.{key}: FSDP2 mixed precision is for CUDA ranks, and this machine has "
                              "no GPU: CPU ranks train in the weights' own dtype (leave it null, or pick the "
                              "learner's dtype with model.learner)")


def check_trainable_learner(config: TrainConfig) -> None:
    """The learner can take optimizer steps (``Backend.check_trainable``: e.g. hf:fp16 cannot, AdamW's eps rounds
    to 0 in fp16 and the weights turn NaN)."""
    try:
        backend_of(config.model.learner).check_trainable(parse_spec(config.model.learner), config.model.learner)
    except ValueError as err:
        raise ConfigError(f"model.learner: {err}") from None


def build_step_config(config: TrainConfig) -> StepConfig:
    """The ``StepConfig`` the step uses: the algorithm's defaults filled in, the loss built."""
    a = config.algorithm
    correction = a.correction
    loss_name = a.resolved("loss")
    try:
        loss = LossConfig(
            name=loss_name,
            clip_low=a.resolved("clip_low"),
            clip_high=a.resolved("clip_high"),
            clip_c=a.dual_clip,
            agg=a.resolved("aggregation"),
            denominator=correction.denominator,
            norm_constant=float(config.rollout.max_new_tokens),
            oapl_beta=a.oapl_beta,
            oapl_beta1=a.oapl_beta1,
            # each input of the loss is checked once per step, where it is made: π_θ by the step (each
            # micro-batch), π_old by its strategy, log μ and the masks by the correction, the rewards by train_step
            check_inputs=False,
            **{key: float(value) for key, value in a.loss_args.items()},  # checked by config.validate
        )
    except ValueError as err:
        raise ConfigError(f"algorithm.loss: {err}") from None
    return StepConfig(
        loss=loss,
        correction=correction,
        advantage=a.resolved("advantage"),
        advantage_level=a.advantage_level,
        norm_std=a.resolved("norm_std"),
        dynamic_sampling=a.resolved("dynamic_sampling"),
        baseline_excludes_rejected=a.baseline_excludes_rejected,
        oapl_beta1=value_temperature(a.oapl_beta, a.oapl_beta1),
        temperature=config.rollout.temperature,
        mini_batches=config.trainer.mini_batches,
        micro_batch_size=config.trainer.micro_batch_size,
        ppo_epochs=config.trainer.ppo_epochs,
        grad_clip=config.optim.grad_clip,
        skip_zero_grad=config.optim.skip_zero_grad,
        publish_every=a.oapl_sync_every if loss.regresses_on_rollout else 1,
        kl_coef=a.kl.coef,
        kl_estimator=a.kl.estimator,
        kl_where=a.kl.where,
        mask_truncated=config.rollout.mask_truncated,
        max_new_tokens=config.rollout.max_new_tokens,
        overlong_buffer=a.overlong_buffer,
        overlong_penalty=a.overlong_penalty,
    )


def build_proximal(config: TrainConfig) -> ProximalStrategy:
    """The π_old strategy of ``algorithm.proximal``: its options over the run's defaults for it."""
    p = config.algorithm.proximal
    run = p.strategy.run_defaults(
        temperature=config.rollout.temperature,
        max_staleness=max(config.trainer.max_staleness, 1),
        steps_per_version=config.trainer.mini_batches * config.trainer.ppo_epochs,
    )
    try:
        return make_proximal(p.name, **{**run, **p.options})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"algorithm.proximal: {err}") from None


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
                           **ray_options)
    if ray_options:
        raise TypeError(f"{sorted(ray_options)}: options of trainer.executor=ray, not {t.executor!r}")
    if lag is None:
        return AsyncExecutor(ProcessSource(spec), t.max_staleness, t.queue_size, t.partial_rollouts,
                             t.partial_chunk_tokens)
    return LaggedExecutor(spec.build(), lag, build_step_config(config).publish_every)


def build_learner(config: TrainConfig, ranks: Ranks = ONE_PROCESS) -> tuple[Any, torch.optim.Optimizer]:
    """This rank's learner (eval mode: no dropout, it scores exactly what it trains) and its AdamW optimizer.
    The learner is laid out over ``ranks`` first (``Ranks.shard``): one process keeps it whole on
    ``model.device``; in a process group it is sharded, so the optimizer holds this rank's 1/N of every weight
    (the DTensor shards), ranks > 0 build the model as a skeleton and get their shards from rank 0, and rank 0
    builds it in host memory (sharding moves each unit to the rank's device)."""
    m = config.model
    try:
        learner = make_learner(m.learner, config.model.path, routing_replay=m.routing_replay,
                               skeleton=not ranks.is_main, device=ranks.learner_device(m.device),
                               gradient_checkpointing=m.gradient_checkpointing, lora=m.lora.learner_kwargs())
    except ValueError as err:
        if str(err).startswith("model.lora"):
            raise ConfigError(str(err)) from None
        if str(err).startswith("routing_replay="):  # r3 on a dense model: the config's key, one line
            raise ConfigError(f"model.routing_replay: {err}") from None
        raise
    learner.model.train(False)
    f = config.trainer.fsdp
    learner = ranks.shard(learner, config.trainer.data_parallel, reshard_after_forward=f.reshard_after_forward,
                          param_dtype=f.param_dtype, reduce_dtype=f.reduce_dtype)
    o = config.optim
    optimizer = torch.optim.AdamW(
        [p for p in learner.model.parameters() if p.requires_grad],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
    )
    return learner, optimizer


def samples_on_every_rank(config: TrainConfig, ranks: Ranks) -> bool:
    """Whether each rank of a data-parallel run samples its share of every batch (``ShareExecutor``): the
    learner is whole on every rank (replicated), so each rank's sampler takes its weights locally, and the sampler
    runs in the learner's process (``trainer.executor=local``, ``sync`` or ``simulated_async``). Otherwise rank 0
    samples every batch (an async sampler process, Ray workers, a sharded learner)."""
    local = config.trainer.executor == "local" and mode_lag(config.trainer.mode, config.trainer.lag) is not None
    return ranks.world > 1 and ranks.holds_whole_model and local


def data_parallel_note(config: TrainConfig, ranks: Ranks, learner) -> str | None:
    """What a data-parallel run chose, in one line (None in one process): the learner's layout and why, who
    samples, and what carries the collectives (shared memory between CPU ranks of one host, else gloo or NCCL)."""
    if ranks.world == 1:
        return None
    from rollcorr.distributed.replicate import training_state_bytes

    state = training_state_bytes(learner.model) / 2**20  # a DTensor counts its whole size
    why = f"trainer.data_parallel={config.trainer.data_parallel}; its training state {state:,.0f} MiB"
    if ranks.holds_whole_model:
        layout = f"replicated on {ranks.world} ranks (one gradient all-reduce per optimizer step; {why})"
    else:
        layout = f"sharded over {ranks.world} ranks by FSDP2 ({why})"
    who = ("every rank samples its share of each batch" if samples_on_every_rank(config, ranks)
           else "rank 0 samples every batch")
    return f"data-parallel learner: {layout}; {who}; the trainer's collectives over {ranks.transport}"


def rank_executor(config: TrainConfig, ranks: Ranks) -> Executor:
    """The executor of one rank: each rank samples its share of each batch and the ranks exchange them
    (``ShareExecutor``, when ``samples_on_every_rank``), or rank 0 runs ``make_executor(config)`` and broadcasts
    each rollout (``LeaderExecutor``; one process is rank 0 of 1, its broadcasts go nowhere) and the other ranks
    receive it (``FollowerExecutor``)."""
    if samples_on_every_rank(config, ranks):
        spec = dataclasses.replace(SourceSpec.from_config(config), share=(ranks.rank, ranks.world))
        return ShareExecutor(make_executor(config, spec), ranks)
    if ranks.is_main:
        return LeaderExecutor(make_executor(config), ranks)
    return FollowerExecutor(ranks)


def follow_sampler(proximal: ProximalStrategy, executor: Executor, learner) -> None:
    """A strategy that follows the *sampler's* weights (``follows_sampler``: they lag the learner's in the async
    modes) gets each version when the sampler loads it (in a scratch copy of the learner's model) and every
    chunk as soon as it is generated. Needs ``executor.local_listeners`` (``check_components`` says so)."""
    scratch = copy.deepcopy(learner.model)
    source = executor.source

    def sampler_loaded(weights, version: int) -> None:
        scratch.load_state_dict(weights)
        proximal.on_sampler_load(version, scratch)

    source.load_listeners.append(sampler_loaded)
    source.listeners.append(lambda rollout: proximal.submit(rollout, learner))


def build_evaluator(config: TrainConfig, task, tokenizer, learner=None) -> GreedyEvaluator | None:
    """Greedy accuracy on at most ``task.eval_prompts`` held-out prompts with an fp32 hf sampler; None for 0.
    The sampler decodes with ``learner``'s own tensors where it lends them (``evaluation_sampler``: a float32
    learner this process holds whole), else it is a model of its own, loaded with the learner's weights at each
    evaluation."""
    if config.task.eval_prompts <= 0:
        return None
    lend = getattr(learner, "evaluation_sampler", None)
    sampler = lend() if lend is not None else None
    if sampler is None:
        sampler = make_sampler("hf:fp32", config.model.path, device=config.model.device)
    return GreedyEvaluator(sampler, task, tokenizer, config.task.eval_prompts, config.rollout.max_new_tokens,
                           config.task.eval_seed, chat=uses_chat(tokenizer, config.task.chat),
                           limits=config.task.limits())
