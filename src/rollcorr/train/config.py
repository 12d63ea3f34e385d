"""Training configuration: plain dataclasses, one YAML file, dotted command-line overrides.

``load_config(path, overrides)`` reads ``configs/default.yaml`` (or ``path``), applies overrides such as
``algorithm.correction.preset=decoupled_seq_is_rs trainer.max_staleness=4`` and validates everything before
any model is loaded. Every error names the offending key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from rollcorr.advantages import ESTIMATORS
from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.loss import AGG_MODES
from rollcorr.config.presets import PresetError, resolve
from rollcorr.config.yaml_io import YamlError, excerpt, load_yaml, load_yaml_file
from rollcorr.correction.rejection import check_rules
from rollcorr.distributed.ranks import LAYOUTS
from rollcorr.distributed.split import split_problem
from rollcorr.losses import LOSSES as LOSS_CATALOGUE
from rollcorr.losses import LossConfig, loss_spec
from rollcorr.moe import ROUTING_REPLAY_MODES
from rollcorr.plugins import PluginError, load_plugins, not_loaded, plugin_names

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"

MODES = ("sync", "simulated_async", "async")  # trainer.mode (the sampler's version lag: versions.mode_lag)
SCHEDULES = ("constant", "cosine")
EXECUTORS = ("local", "ray")


def accepted_losses() -> tuple[str, ...]:
    """The losses algorithm.loss accepts: every loss of the catalogue (rollcorr.losses.LOSSES, built-in or
    registered later) but those that build their own train/infer weight (``LossSpec.builds_own_weights``)."""
    return tuple(name for name, spec in LOSS_CATALOGUE.items() if not spec.builds_own_weights)


# The IS losses build their own train/infer weight; in the trainer that weight is the correction's job, so each
# is refused with the settings that give the same loss (ppo_clip times the correction's w).
REFUSED_LOSSES: dict[str, str] = {
    "ppo_is": "algorithm.loss=ppo_clip algorithm.correction.preset=bypass_ppo_clip algorithm.proximal.name=bypass "
              "(the PPO ratio is π_θ/μ)",
    "vanilla_is": "algorithm.loss=ppo_clip algorithm.correction.preset=tis algorithm.correction.is_upper=null "
                  "(untruncated token IS, w = ρ)",
    "tis": "algorithm.loss=ppo_clip algorithm.correction.preset=tis (w = min(ρ, 2); set the cap with "
           "algorithm.correction.is_upper, a floor with algorithm.correction.is_lower)",
    "areal": "algorithm.loss=ppo_clip algorithm.correction.preset=areal_decoupled_cap (w = ρ·1[ρ ≤ 5]; set the cap "
             "with algorithm.correction.is_upper)",
}
# algorithm.loss_args: the losses' own hyper-parameters (their LossSpec.options), the losses that read them.
# The other LossConfig fields come from other keys (clip_low → algorithm.clip_low, clip_c → algorithm.dual_clip,
# agg → algorithm.aggregation, denominator → the correction, oapl_beta → algorithm.oapl_beta, ...).
OWN_KEYS = ("oapl_beta", "oapl_beta1", "clip_cov_seed")  # set by their own algorithm.* key, or the seed


def loss_arg_readers() -> dict[str, tuple[str, ...]]:
    """{LossConfig field: the accepted losses whose spec declares it as an option}, from the catalogue."""
    out: dict[str, tuple[str, ...]] = {}
    for name in accepted_losses():
        for key in loss_spec(name).options:
            if key not in OWN_KEYS:
                out[key] = (*out.get(key, ()), name)
    return out


# Per-algorithm defaults; a field left at None in AlgorithmConfig takes the value from this table. The loss's
# own settings (LOSS_SETTINGS) go with the algorithm's loss only: with another algorithm.loss, an unset clip or
# aggregation is that loss's own default (its rollcorr.losses.LossSpec), never the algorithm's.
ALGORITHMS: dict[str, dict[str, Any]] = {
    # GRPO aggregates token-mean, verl's default loss_agg_mode (the GRPO paper's per-sequence mean is
    # algorithm.aggregation=seq-mean-token-mean; token-mean learned faster on the built-in task, docs/training.md)
    "grpo": dict(loss="ppo_clip", advantage="grpo", norm_std=True, aggregation="token-mean",
                 clip_low=0.2, clip_high=0.2, dynamic_sampling=False),
    "dapo": dict(loss="ppo_clip", advantage="grpo", norm_std=True, aggregation="token-mean",
                 clip_low=0.2, clip_high=0.28, dynamic_sampling=True),
    "drgrpo": dict(loss="ppo_clip", advantage="drgrpo", norm_std=False, aggregation="seq-mean-token-sum-norm",
                   clip_low=0.2, clip_high=0.2, dynamic_sampling=False),
    "rloo": dict(loss="ppo_clip", advantage="rloo", norm_std=False, aggregation="seq-mean-token-mean",
                 clip_low=0.2, clip_high=0.2, dynamic_sampling=False),
    "cispo": dict(loss="cispo", advantage="grpo", norm_std=True, aggregation="token-mean",
                  clip_low=1.0, clip_high=4.0, dynamic_sampling=False),
    "gspo": dict(loss="gspo", advantage="grpo", norm_std=True, aggregation="seq-mean-token-mean",
                 clip_low=3e-4, clip_high=4e-4, dynamic_sampling=False),
    "oapl": dict(loss="oapl", advantage="oapl", norm_std=False, aggregation="seq-mean-token-mean",
                 clip_low=0.2, clip_high=0.2, dynamic_sampling=False),
}
# AlgorithmConfig keys that are the loss's own settings → the LossSpec field holding the loss's default.
LOSS_SETTINGS = {"clip_low": "clip_low", "clip_high": "clip_high", "aggregation": "agg"}


class ConfigError(ValueError):
    """A configuration problem; the message starts with the dotted key at fault (and is one bounded line)."""

    def __init__(self, message: str):
        if len(message) > 600:  # a value quoted from a hostile file never floods the terminal
            message = f"{message[:500]}... ({len(message):,} chars)"
        super().__init__(message)


@dataclass
class LoRAConfig:
    """LoRA adapters on a frozen base (``rollcorr.engines.lora``, PEFT); ``r = 0``: off, every weight trains."""

    r: int = 0  # the adapters' rank; 0 = no LoRA
    alpha: float = 16.0  # the update is (alpha / r) · B A
    dropout: float = 0.0
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def learner_kwargs(self) -> dict[str, Any] | None:
        """``HFLearner(lora=...)``: None when off."""
        if self.r == 0:
            return None
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "target_modules": list(self.target_modules)}


@dataclass
class ModelConfig:
    path: str = "builtin"  # "builtin" or a local Hugging Face directory
    sampler: str = "hf:bf16"  # engine spec for make_sampler
    learner: str = "hf:fp32"  # engine spec for make_learner
    # mixture-of-experts models: "r3" = the learner (π_θ and every π_old) replays the sampler's routed experts
    routing_replay: str | None = None
    device: str | None = None  # cpu | cuda | cuda:N for the learner and the hf samplers; null: CUDA when available
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward pass (less memory)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA adapters (r > 0); the sampler gets merged weights


@dataclass
class TaskConfig:
    """The prompts and the reward (docs/tasks.md): a built-in task, or a data set with its reward."""

    name: str = "addition"  # a built-in task (addition, chain, ...) or a data set: .jsonl, .parquet, a datasets folder
    # data sets: exact | last_number | boxed | gsm8k | math | module:function (null: exact), or a list of them
    # (each per response, fn(item, text), or batched in TRL's fn(completions, **columns)), summed with reward_weights
    reward: str | list[str] | None = None
    reward_weights: list[float] | None = None  # one per reward of a list (TRL's reward_weights); null: 1 each
    chat: bool | None = None  # the chat template on prompts: null = when the model's tokenizer has one
    prompt_key: str = "prompt"  # data sets: the column holding the prompt (text or a list of messages)
    answer_key: str = "answer"  # data sets: the column the reward reads
    eval_file: str | None = None  # data sets: the held-out rows (else the data's split / every 10th row)
    eval_prompts: int = 200  # greedy evaluation: at most this many held-out prompts (each once), 0 = none
    eval_seed: int = 12345
    reward_timeout: float | None = 5.0  # seconds one reward call may take, then the run stops (null: no limit)
    reward_clip: bool = False  # a reward outside [0, 1] is clipped into it instead of stopping the run
    # multi-turn: {name: <registered environment>, <its options>, max_turns: N, max_tokens: N, workers: N} (null:
    # one turn, scored by the task's reward). max_turns caps the model turns, max_tokens the response-side tokens
    # (the model's and the environment's) of a trajectory, workers steps that many episodes side by side; all
    # optional (docs/multi-turn.md)
    env: dict[str, Any] | None = None

    def build(self):
        """The task (``rollcorr.tasks.make_task``); ValueError / FileNotFoundError naming the problem."""
        from rollcorr.tasks import make_task

        return make_task(self.name, self.reward, prompt_key=self.prompt_key, answer_key=self.answer_key,
                         eval_file=self.eval_file, reward_weights=self.reward_weights,
                         reward_clip=self.reward_clip)

    def limits(self):
        """What bounds a trajectory and the user code it calls (``rollcorr.envs.Limits``): ``task.env``'s
        max_turns / max_tokens, ``task.reward_timeout`` / ``task.reward_clip``."""
        from rollcorr.envs import Limits

        env = self.env or {}
        return Limits(env.get("max_turns"), env.get("max_tokens"), self.reward_timeout, self.reward_clip,
                      env.get("workers", 1))

    def environment(self, task=None):
        """The run's environment over the task's items (``task``, default ``build()``'s; ``rollcorr.envs.make_env``):
        the task itself as a one-turn environment without ``env``."""
        from rollcorr.envs import make_env

        options = {k: v for k, v in (self.env or {}).items() if k not in ENV_LIMITS}
        return make_env(self.build() if task is None else task, options or None)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    group_size: int = 8  # G responses per prompt
    max_new_tokens: int = 5
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    # responses cut at max_new_tokens (no EOS) leave the loss, staying in their group's baseline (TRL's
    # mask_truncated_completions, DAPO's overlong filtering)
    mask_truncated: bool = False


KL_WHERE = ("loss", "reward")  # algorithm.kl.where


@dataclass
class KLConfig:
    """A KL term to a frozen reference policy, the run's starting weights (``rollcorr.losses.kl``,
    ``train/reference.py``): TRL's ``beta``, verl's ``use_kl_loss`` (``where: loss``) / ``use_kl_in_reward``
    (``where: reward``)."""

    coef: float = 0.0  # β; 0 = no reference, no term
    estimator: str = "low_var_kl"  # kl/k1 | abs | mse/k2 | low_var_kl/k3 (verl's kl_penalty names; + : k2's gradient)
    where: str = "loss"  # loss: coef · KL(π_θ ‖ π_ref) aggregated as the loss | reward: r − coef · Σ_t KL(π_old ‖ π_ref)


@dataclass
class ProximalConfig:
    """Where π_old comes from: a registered strategy (``rollcorr.proximal.STRATEGIES``) and its options.

    In YAML and overrides it is one mapping, ``{name: ewma, beta: 0.5}``; options the trainer fills from the run
    (temperature, max_staleness, ...: the strategy's ``run_defaults``) may be left out.
    """

    name: str = "recompute"
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def strategy(self) -> type:
        """The strategy class (its class attributes answer the trainer's questions before it is built)."""
        from rollcorr.proximal import STRATEGIES

        return STRATEGIES[self.name]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}


def _correction(data: Any, key: str) -> CorrectionConfig:
    """``algorithm.correction`` ({preset: name, <CorrectionConfig field>: value, ...}) → CorrectionConfig."""
    if isinstance(data, CorrectionConfig):
        return data
    try:
        config = resolve(data)
    except PresetError as err:
        raise ConfigError(f"{key}.{err}" if err.key else f"{key}: {err}") from None
    try:
        check_rules(config)  # the rules it names from outside: registered (by a plugin), with options they take
    except ValueError as err:
        raise ConfigError(f"{key}.{err}") from None
    return config


def _proximal(data: Any, key: str) -> ProximalConfig:
    """``algorithm.proximal`` ({name: strategy, <option>: value, ...}) → ProximalConfig (name and option names
    checked against the registered strategies; option values when the strategy is built)."""
    import inspect

    from rollcorr.proximal import STRATEGIES

    if isinstance(data, ProximalConfig):
        return data
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ConfigError(f"{key}.name: needs a strategy name, e.g. {{name: recompute}}")
    options = dict(data)
    name = options.pop("name")
    if name not in STRATEGIES:
        raise ConfigError(f"{key}.name: unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    params = inspect.signature(STRATEGIES[name]).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ConfigError(f"{key}: strategy {name!r} has no option {unknown[0]!r}; it takes {sorted(params)}")
    return ProximalConfig(name, options)


# sections held as typed objects but written as one mapping (their own parser and to_dict)
SECTIONS = {CorrectionConfig: _correction, ProximalConfig: _proximal}
# the key that selects a section's base: overriding it starts the section afresh ({preset: X} drops the old
# preset's field overrides, {name: X} the old strategy's options)
ADVANTAGE_LEVELS = ("trajectory", "turn")
ENV_LIMITS = ("max_turns", "max_tokens", "workers")  # task.env's keys for the trainer, not the environment
SELECTORS = {("algorithm", "correction"): "preset", ("algorithm", "proximal"): "name", ("task", "env"): "name"}


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # one of ALGORITHMS
    loss: str | None = None  # None = the algorithm's default (see ALGORITHMS)
    advantage: str | None = None
    norm_std: bool | None = None
    # multi-turn trajectories: "trajectory" (its reward over every model token) or "turn" (each turn the reward
    # still to come from it, compared with the same turn of its group: advantages.turn_advantages)
    advantage_level: str = "trajectory"
    aggregation: str | None = None  # None = the algorithm's own (GRPO: token-mean, GSPO: seq-mean-token-mean)
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None  # c > 1 for dual-clip PPO, None = off
    dynamic_sampling: bool | None = None  # drop groups whose rewards are all equal
    baseline_excludes_rejected: bool = True  # rejected sequences leave the group mean / std
    # OAPL regression coefficient β; default: the oapl loss's own (see docs/training.md for the sweep)
    oapl_beta: float = field(default_factory=lambda: loss_spec("oapl").options["oapl_beta"])
    oapl_beta1: float | None = None  # OAPL soft-value temperature β₁ (None = β)
    oapl_sync_every: int = 4  # OAPL: publish weights to the sampler every N learner steps
    kl: KLConfig = field(default_factory=KLConfig)  # a KL term to the starting weights (off by default)
    # DAPO's soft overlong punishment (verl's overlong_buffer): a response longer than max_new_tokens − buffer loses
    # (length − (max_new_tokens − buffer)) / buffer · overlong_penalty of its reward; 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # the loss's own hyper-parameters: {<LossConfig field of loss_arg_readers()>: value}, e.g. {"sapo_tau_pos": 1.0}
    loss_args: dict[str, Any] = field(default_factory=dict)
    # the correction, resolved when the config is read from {"preset": name, <CorrectionConfig field>: value}
    correction: CorrectionConfig = field(default_factory=lambda: resolve({"preset": "decoupled_token_is"}))
    # the π_old strategy, read from {"name": strategy, <option>: value, ...}
    proximal: ProximalConfig = field(default_factory=ProximalConfig)

    def resolved(self, key: str) -> Any:
        """The value of ``key`` after filling None from the algorithm's defaults (for the loss's own settings:
        from the loss's defaults when ``loss`` is not the algorithm's own)."""
        value = getattr(self, key)
        if value is not None:
            return value
        table = ALGORITHMS[self.name]
        if key == "loss":  # bypass_pg_*: the correction's weight min(π_θ/μ, C) is the ratio, so REINFORCE
            return "reinforce" if self.correction.loss_type == "reinforce" else table["loss"]
        loss = self.loss if self.loss is not None else table["loss"]
        if key in LOSS_SETTINGS and loss != table["loss"] and loss in LOSS_CATALOGUE:
            return getattr(LOSS_CATALOGUE[loss], LOSS_SETTINGS[key])
        return table[key]


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm, 0 = off
    warmup_steps: int = 0
    schedule: str = "cosine"  # constant | cosine (to min_lr_ratio · lr at trainer.steps)
    min_lr_ratio: float = 0.1
    # No optimizer step on a mini-batch whose gradient is exactly 0 (all tokens rejected, all advantages 0):
    # Adam would otherwise keep moving the weights by its momentum (docs/training.md, "Zero gradients").
    skip_zero_grad: bool = True


FSDP_DTYPES = ("fp32", "bf16", "fp16")
DATA_PARALLEL = LAYOUTS  # trainer.data_parallel


@dataclass
class FSDPConfig:
    """FSDP2's options for a data-parallel learner (``trainer.ranks > 1``; docs/distributed.md)."""

    reshard_after_forward: bool = True  # free a layer's gathered weights after its forward (false: keep them
    #                                     until its backward: one all-gather fewer per layer, more memory)
    param_dtype: str | None = None  # mixed precision, CUDA only: the dtype layers compute in (fp32 | bf16 |
    #                                 fp16); null: the weights' own
    reduce_dtype: str | None = None  # mixed precision, CUDA only: the dtype gradients are reduced in; null:
    #                                  param_dtype's


@dataclass
class TrainerConfig:
    mode: str = "sync"  # sync | simulated_async | async
    executor: str = (
        "local"  # local (in-process; async = a sampler process) | ray (sampler workers as Ray actors)
    )
    ray_workers: int = 2  # executor=ray: sampler actors
    ray_address: str | None = None  # executor=ray: an existing cluster (None = start a local one)
    lag: int = 1  # simulated_async: the sampler holds the weights of `lag` versions ago
    max_staleness: int = 4  # no token is trained on at a version lag above this
    queue_size: int = 2  # async: rollout batches waiting for the learner
    partial_rollouts: bool = False  # async: interrupted responses resume with the new weights
    partial_chunk_tokens: int = 2  # async + partial: tokens generated between weight-update checks
    steps: int = 600
    mini_batches: int = 2  # optimizer steps per rollout batch (per PPO epoch)
    micro_batch_size: int = 0  # sequences per forward/backward, 0 = the whole mini-batch
    ppo_epochs: int = 1
    seed: int = 0
    threads: int = 1  # torch intra-op threads (1 is fastest for the built-in model; 0 = torch's default)
    ranks: int = 1  # learner processes (data-parallel, FSDP2; docs/distributed.md); torchrun: its world size
    data_parallel: str = "auto"  # ranks > 1: replicate (whole model per rank, one gradient all-reduce per optimizer
    #                               step) | shard (FSDP2) | auto (replicate when it fits a rank's memory; docs/distributed.md)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # the sharding's options (data-parallel runs only)
    eval_every: int = 50  # greedy evaluation every N steps (and at start and end), 0 = only start/end
    checkpoint_every: int = 50  # 0 = only at the end
    keep_checkpoints: int = 2
    max_bad_steps: int = 3  # consecutive non-finite steps before the run stops
    out: str | None = None  # run folder; None = runs/<timestamp>-<random suffix>
    tensorboard: bool = True
    wandb: bool = False  # only when the wandb package is installed
    wandb_project: str = "rollcorr"  # the W&B project a run logs to (trainer.wandb=true)
    progress: bool = True  # rich progress bar in a terminal; otherwise one plain line per step (log_every_s)
    log_every_s: float = 10.0  # output not a terminal: a step line at most every this many seconds (0: every step)
    plot: bool = True


@dataclass
class TrainConfig:
    # modules imported before anything else is read (they register losses, rules, engines, strategies, rewards:
    # docs/plugins.md); installed plugins (entry-point group rollcorr.plugins) need no line here
    plugins: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML / JSON): the correction with every field explicit, the strategy as one mapping."""
        out = dataclasses.asdict(self)
        out["algorithm"]["correction"] = self.algorithm.correction.to_dict()
        out["algorithm"]["proximal"] = self.algorithm.proximal.to_dict()
        return out

    @property
    def batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size


# ---------------------------------------------------------------- building from dicts and overrides


def _from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in known:
            raise ConfigError(f"{dotted}: unknown key; known keys are {sorted(known)}")
        hint = hints[key]
        if hint in SECTIONS:
            kwargs[key] = SECTIONS[hint](value, dotted)
        elif dataclasses.is_dataclass(hint):
            kwargs[key] = _from_dict(hint, value or {}, dotted)
        else:
            kwargs[key] = _coerce(value, hint, dotted)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a simple type hint (int/float/bool/str/dict, optionally | None)."""
    if getattr(hint, "__origin__", None) is dict:
        hint = dict
    if getattr(hint, "__origin__", None) is list:
        hint = list
    args = getattr(hint, "__args__", ())
    numbers = [a for a in args if getattr(a, "__origin__", None) is list and a.__args__ == (float,)]
    if numbers and value is not None:  # a list of numbers (task.reward_weights)
        return _numbers(value, key)
    if isinstance(value, list) and any(getattr(a, "__origin__", None) is list for a in args):  # str | list[str]
        hint, args = list, ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    base = getattr(base, "__origin__", base)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: may not be null")
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {excerpt(value)}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {excerpt(value)}")
        return value
    if base is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {excerpt(value)}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {excerpt(value)}")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {excerpt(value)}")
        return value
    if base is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {excerpt(value)}")
        return dict(value)
    if base is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of names, e.g. [q_proj, v_proj], got {excerpt(value)}")
        return list(value)
    return value


def check_env(env: dict[str, Any] | None) -> None:
    """``task.env``: a mapping with a ``name``; its limits, when given, positive integers."""
    if env is None:
        return
    if not isinstance(env.get("name"), str) or not env["name"]:
        raise ConfigError(f"task.env: expected {{name: <environment>, ...}}, got {excerpt(env)}")
    for key in ENV_LIMITS:
        value = env.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"task.env.{key}: expected a positive integer, got {excerpt(value)}")


def _numbers(value: Any, key: str) -> list[float]:
    """A list of finite numbers, e.g. [1.0, 0.5]; ConfigError naming ``key`` otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                              and math.isfinite(v) for v in value):
        raise ConfigError(f"{key}: expected a list of finite numbers, e.g. [1.0, 0.5], got {excerpt(value)}")
    return [float(v) for v in value]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` → (["a", "b", "c"], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{text}: expected key=value, e.g. trainer.steps=50")
    if key.strip() == "trainer.out":  # a path, never YAML: "run #2", "null", "2024-01-01" are folder names
        return ["trainer", "out"], raw or None
    try:
        value = load_yaml(raw, f"{key}=") if raw.strip() else None
    except YamlError as err:
        raise ConfigError(str(err)) from None
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted key in a nested dict (new nested keys are checked later against the dataclasses)."""
    for text in overrides:
        path, value = parse_override(text)
        if len(path) == 3 and SELECTORS.get(tuple(path[:2])) == path[2]:
            data.setdefault(path[0], {})
            if isinstance(data[path[0]], dict):
                data[path[0]][path[1]] = {}  # a new preset / strategy starts its section afresh
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, cannot set {'.'.join(path)}")
            node = child
        node[path[-1]] = value
    return data


def preset_overrides(name: str) -> list[str]:
    """The dotted ``key=value`` overrides of a shipped preset (``configs/<name>.yaml``, a partial config
    that changes the default one), e.g. "chain": the long-response task, its model and settings."""
    path = DEFAULT_CONFIG.parent / f"{name}.yaml"
    if name == DEFAULT_CONFIG.stem or not path.is_file():
        presets = sorted(p.stem for p in DEFAULT_CONFIG.parent.glob("*.yaml") if p != DEFAULT_CONFIG)
        raise ConfigError(f"config file {name!r} does not exist (shipped presets: {presets})")

    def leaves(node: dict[str, Any], prefix: str) -> list[str]:
        out = []
        for key, value in node.items():
            if isinstance(value, dict) and value:
                out += leaves(value, f"{prefix}{key}.")
            else:
                out.append(
                    f"{prefix}{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
                )
        return out

    return leaves(load_yaml_file(path) or {}, "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                inside_run: bool = False) -> TrainConfig:
    """Read YAML (default: the shipped default.yaml; a bare name such as "chain" is a shipped
    preset applied over it), apply overrides, build and validate. ``inside_run``: ``path`` is a run
    folder's config.yaml (not followed if it is a link)."""
    presets = []
    if path is not None and not Path(path).is_file() and not Path(path).suffix and "/" not in str(path):
        presets, path = preset_overrides(str(path)), None
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:  # bounded: size, aliases, depth; a key twice is refused (rollcorr.config.yaml_io)
        data = load_yaml_file(path, inside_run=inside_run) or {}
    except YamlError as err:
        raise ConfigError(str(err)) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r}: expected a mapping of sections, got {type(data).__name__}"
        )
    data = apply_overrides(data, presets + list(overrides or []))
    data["plugins"] = import_plugins(data.get("plugins"), overrides or [], path if inside_run else None)
    config = _from_dict(TrainConfig, data, "")
    validate(config)
    return config


def missing_keys(path: Path) -> list[str]:
    """The keys a run writes to its config.yaml (all of them: ``save_config``) that the file at ``path`` lacks, as
    ``section.key``: a file cut short or edited, or written by an older rollcorr (their defaults are used)."""
    data = load_yaml_file(path, inside_run=True) or {}
    missing = []
    for section, values in TrainConfig().to_dict().items():
        given = data.get(section) if isinstance(data, dict) else None
        if not isinstance(values, dict):
            missing += [] if isinstance(data, dict) and section in data else [section]
            continue
        missing += [f"{section}.{key}" for key in values if not isinstance(given, dict) or key not in given]
    return missing


def import_plugins(value: Any, overrides: list[str], run_file: Path | None = None) -> list[str]:
    """The config's ``plugins``, imported (``rollcorr.plugins.load_plugins``, installed plugins first) before any
    name they register is read. A run folder's config.yaml (``run_file``) imports nothing by itself: its plugins
    are those the command line names again (``plugins=[...]``) or that this process imported already
    (``--plugins``, installed ones); any other is a ``ConfigError`` saying how to name it."""
    try:
        names = plugin_names(value)
        told = run_file is None or any(parse_override(text)[0] == ["plugins"] for text in overrides)
        load_plugins(names if told else ())
    except PluginError as err:
        raise ConfigError(str(err)) from None
    missing = not_loaded(names)
    if missing:
        listed = ",".join(missing)
        raise ConfigError(f"plugins: {run_file} names {listed}, not imported: a run folder's file never imports "
                          f"code; name them yourself (rollcorr train --resume RUN_DIR plugins=[{listed}]; rollcorr "
                          f"audit --plugins {listed})")
    return names


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    config = _from_dict(TrainConfig, data, "")
    validate(config)
    return config


def save_config(config: TrainConfig, path: Path) -> None:
    """Write the resolved config as YAML (a fresh temp file then rename: a link at ``path`` or at a temp
    name is never written through; a full disk leaves no temp file behind)."""
    from rollcorr.safe_io import atomic_write_bytes

    atomic_write_bytes(path, yaml.safe_dump(config.to_dict(), sort_keys=False).encode())


def config_differs(config: TrainConfig, path: Path, resuming: bool) -> bool:
    """Whether ``path`` (a run's config.yaml) must be rewritten for ``config``: always for a new run; on resume
    only when the command's overrides changed it. A read-only config.yaml that would change is a
    ``ConfigError`` before any work (the file is the user's: it is never replaced behind its mode)."""
    if not resuming:
        return True
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        return True
    if not path.stat().st_mode & 0o222:  # no write bit for anyone (checked by mode: root may write anyway)
        raise ConfigError(
            f"{path} is read-only and this resume's overrides would change it: make it writable, or resume "
            "without overrides"
        )
    return True


# ---------------------------------------------------------------- validation


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _positive(value: float, key: str, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    _check(ok, key, f"must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _validate_loss_args(loss: str, loss_args: dict[str, Any]) -> None:
    """Each key a ``loss_arg_readers`` field read by ``loss``, each value a number LossConfig accepts."""
    values = {}
    readers = loss_arg_readers()
    for key, value in loss_args.items():
        dotted = f"algorithm.loss_args.{key}"
        _check(key in readers, dotted, f"unknown loss argument; allowed: {sorted(readers)}")
        _check(
            loss in readers[key],
            dotted,
            f"only {' / '.join(readers[key])} read it; algorithm.loss is {loss!r}",
        )
        values[key] = _coerce(value, float, dotted)
    try:
        LossConfig(name=loss, **values)
    except ValueError as err:  # "LossConfig.<field> must be ..." names a field of loss_args
        key = str(err).removeprefix("LossConfig.").split(" ")[0]
        raise ConfigError(
            f"algorithm.loss_args.{key}: {str(err).removeprefix(f'LossConfig.{key} ')}"
        ) from None


def _validate_correction(a: AlgorithmConfig, loss: str) -> None:
    """The correction against the loss and the π_old strategy.

    Bypass mode sets π_old := μ. With ``loss_type=ppo_clip`` the ratio π_θ/μ lives in a ratio-based loss and the
    correction applies no weight; with ``loss_type=reinforce`` the correction's w = min(π_θ/μ, C) *is* the ratio,
    so the loss must be REINFORCE (−A·sg(w)·log π_θ): a PPO ratio on top would count π_θ/μ twice. An unset
    ``algorithm.loss`` follows the correction (``AlgorithmConfig.resolved``); an explicit one that disagrees is
    refused.
    """
    c = a.correction  # loss_type=reinforce is bypass-only: CorrectionConfig's own rule, checked when it was read
    if c.loss_type == "reinforce":
        if loss_spec(loss).has_ratio:  # gpg = REINFORCE without its metric
            raise ConfigError(f"algorithm.loss: {loss!r} has its own ratio, but the correction has loss_type=reinforce "
                              "(its weight min(π_θ/μ, C) is already the ratio, so it would count twice); leave "
                              "algorithm.loss unset or use a bypass_ppo_clip* preset")
    elif c.mode == "bypass" and not loss_spec(loss).has_ratio:
        raise ConfigError(f"algorithm.loss: {loss!r} has no ratio and a bypass_ppo_clip* correction applies no weight, "
                          "so nothing would correct for μ ≠ π_θ; use a bypass_pg_* preset")
    if c.mode == "bypass" and not a.proximal.strategy.old_is_rollout:
        raise ConfigError(f"algorithm.proximal.name: a bypass correction preset means π_old := μ; use "
                          f"algorithm.proximal.name=bypass, not {a.proximal.name!r}")
    if loss_spec(loss).regresses_on_rollout and c.mode == "bypass":
        raise ConfigError(
            "algorithm.correction: OAPL regresses on log μ itself; use a decoupled preset or 'disabled'"
        )


def _validate_shaping(a: AlgorithmConfig, r: RolloutConfig, loss: str) -> None:
    """``algorithm.kl`` and DAPO's overlong punishment."""
    from rollcorr.losses.kl import check_kl_estimator

    _positive(a.kl.coef, "algorithm.kl.coef", allow_zero=True)
    try:
        check_kl_estimator(a.kl.estimator)
    except ValueError as err:
        raise ConfigError(f"algorithm.kl.estimator: {err}") from None
    _check(a.kl.where in KL_WHERE, "algorithm.kl.where", f"expected one of {list(KL_WHERE)}, got {a.kl.where!r}")
    if a.kl.coef and a.kl.where == "loss" and loss_spec(loss).regresses_on_rollout:
        raise ConfigError("algorithm.kl.where: OAPL regresses on log μ and has no policy-gradient term to add a KL "
                          "loss to; use algorithm.kl.where=reward")
    _positive(a.overlong_buffer, "algorithm.overlong_buffer", allow_zero=True)
    _check(a.overlong_buffer < r.max_new_tokens, "algorithm.overlong_buffer",
           f"must be below rollout.max_new_tokens ({r.max_new_tokens}), got {a.overlong_buffer}")
    _positive(a.overlong_penalty, "algorithm.overlong_penalty", allow_zero=True)


def learner_processes(c: TrainConfig) -> int:
    """How many learner processes the run has, read in one place: in a process torchrun started, its world size
    (``trainer.ranks`` must then be 1 or the same: ``loop.run`` says so); else ``trainer.ranks``, the processes
    ``rollcorr train`` starts (``distributed/launch.py``)."""
    import os

    from rollcorr.distributed.group import LAUNCHER_KEYS

    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ and any(k in os.environ for k in LAUNCHER_KEYS)
    return int(os.environ["WORLD_SIZE"]) if launched else c.trainer.ranks


def validate(c: TrainConfig) -> None:
    """Self-consistency checks that need no model, section by section (the first problem found is said).
    Raises ConfigError naming the key."""
    _validate_rollout_and_task(c)
    _validate_model(c)
    loss = _validate_algorithm(c)
    _validate_optim(c.optim)
    _validate_trainer(c, loss)


def _validate_rollout_and_task(c: TrainConfig) -> None:
    """``rollout.*`` and ``task.*`` (with the environment and the advantages' level)."""
    r = c.rollout
    _positive(r.prompts_per_step, "rollout.prompts_per_step")
    _positive(r.group_size, "rollout.group_size")
    _positive(r.max_new_tokens, "rollout.max_new_tokens")
    _positive(r.temperature, "rollout.temperature")
    _positive(r.top_k, "rollout.top_k", allow_zero=True)
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _positive(c.task.eval_prompts, "task.eval_prompts", allow_zero=True)
    _check(c.task.reward_timeout is None or 0 < c.task.reward_timeout < float("inf"), "task.reward_timeout",
           f"must be a number of seconds > 0 (or null: no limit), got {c.task.reward_timeout}")
    check_env(c.task.env)
    _check(c.algorithm.advantage_level in ADVANTAGE_LEVELS, "algorithm.advantage_level",
           f"expected one of {list(ADVANTAGE_LEVELS)}, got {c.algorithm.advantage_level!r}")



def _validate_model(c: TrainConfig) -> None:
    """``model.*``: the device, LoRA, routing replay."""
    device = c.model.device
    _check(device is None or device in ("cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()),
           "model.device", f"expected cpu, cuda or cuda:<index> (or null: CUDA when available), got {device!r}")
    lora = c.model.lora
    _check(lora.r >= 0, "model.lora.r", f"must be >= 0 (0 = no LoRA), got {lora.r}")
    if lora.r:
        _positive(lora.alpha, "model.lora.alpha")
        _check(0 <= lora.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
        _check(bool(lora.target_modules), "model.lora.target_modules", "needs at least one module name")
        _check(learner_processes(c) == 1, "model.lora",
               "LoRA trains in one process; a data-parallel learner (trainer.ranks > 1) shards full weights")
    _check(c.model.routing_replay in ROUTING_REPLAY_MODES, "model.routing_replay",
           f"unknown routing replay {c.model.routing_replay!r}; use null or r3")
    if c.model.routing_replay is not None:
        from rollcorr.engines import backend_of
        from rollcorr.engines.spec import backends_that

        try:
            captures = backend_of(c.model.sampler).captures_routing
        except ValueError:  # an unknown engine: no routing to replay (model.sampler's own check names it)
            captures = False
        _check(captures, "model.routing_replay", f"r3 replays the routing the sampler captures, which the "
               f"{' / '.join(backends_that('captures_routing'))} sampler does; got {c.model.sampler!r}")



def _validate_algorithm(c: TrainConfig) -> str:
    """``algorithm.*`` with the correction and the reward shaping against the loss; returns the resolved loss."""
    r, a = c.rollout, c.algorithm
    _check(
        a.name in ALGORITHMS,
        "algorithm.name",
        f"unknown algorithm {a.name!r}; use one of {sorted(ALGORITHMS)}",
    )
    loss = a.resolved("loss")
    if loss in LOSS_CATALOGUE and loss_spec(loss).builds_own_weights:
        instead = REFUSED_LOSSES.get(loss, "algorithm.loss=ppo_clip with an algorithm.correction preset")
        raise ConfigError(f"algorithm.loss: {loss!r} weights by π_old/μ itself, which the trainer leaves to "
                          f"algorithm.correction; for the same loss use {instead}")
    accepted = accepted_losses()
    _check(loss in accepted, "algorithm.loss", f"unknown loss {loss!r}; use one of {accepted}")
    _validate_loss_args(loss, a.loss_args)
    _check(a.resolved("advantage") in ESTIMATORS, "algorithm.advantage",
           f"unknown advantage estimator {a.advantage!r}; use one of {ESTIMATORS}")
    _check(a.resolved("aggregation") in AGG_MODES, "algorithm.aggregation",
           f"unknown aggregation {a.aggregation!r}; use one of {AGG_MODES}")
    _positive(a.resolved("clip_low"), "algorithm.clip_low", allow_zero=True)
    _positive(a.resolved("clip_high"), "algorithm.clip_high", allow_zero=True)
    if a.dual_clip is not None:
        _check(a.dual_clip > 1, "algorithm.dual_clip", f"must be > 1, got {a.dual_clip}")
    _positive(a.oapl_beta, "algorithm.oapl_beta")
    if a.oapl_beta1 is not None:
        _positive(a.oapl_beta1, "algorithm.oapl_beta1")
    _positive(a.oapl_sync_every, "algorithm.oapl_sync_every")
    if loss_spec(loss).regresses_on_rollout != (a.resolved("advantage") == "oapl"):
        raise ConfigError("algorithm.loss: the oapl loss and the oapl advantage go together")
    if r.group_size < 2:  # every estimator's baseline is a group's
        raise ConfigError(
            f"rollout.group_size: {a.resolved('advantage')} needs groups of >= 2, got {r.group_size}"
        )
    _validate_correction(a, loss)
    _validate_shaping(a, r, loss)

    return loss


def _validate_optim(o: OptimConfig) -> None:
    """``optim.*``."""
    _positive(o.lr, "optim.lr")
    _positive(o.weight_decay, "optim.weight_decay", allow_zero=True)
    _check(0 <= o.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {o.beta1}")
    _check(0 <= o.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {o.beta2}")
    _positive(o.eps, "optim.eps")
    _positive(o.grad_clip, "optim.grad_clip", allow_zero=True)
    _positive(o.warmup_steps, "optim.warmup_steps", allow_zero=True)
    _check(
        o.schedule in SCHEDULES, "optim.schedule", f"unknown schedule {o.schedule!r}; use one of {SCHEDULES}"
    )
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")



def _validate_trainer(c: TrainConfig, loss: str) -> None:
    """``trainer.*`` (with the OAPL sync lag, which reads the algorithm, and the split, which reads the rollout)."""
    r, a, t = c.rollout, c.algorithm, c.trainer
    _check(t.mode in MODES, "trainer.mode", f"unknown mode {t.mode!r}; use one of {MODES}")
    _check(
        t.executor in EXECUTORS,
        "trainer.executor",
        f"unknown executor {t.executor!r}; use one of {EXECUTORS}",
    )
    _positive(t.ray_workers, "trainer.ray_workers")
    _positive(t.lag, "trainer.lag", allow_zero=True)
    _check(t.max_staleness >= 0, "trainer.max_staleness", f"must be >= 0, got {t.max_staleness}")
    if t.mode == "simulated_async":
        _check(t.lag <= t.max_staleness, "trainer.lag",
               f"lag {t.lag} exceeds trainer.max_staleness {t.max_staleness}")
    if loss_spec(loss).regresses_on_rollout and t.mode != "async":
        # the sampler lags by up to sync_every - 1 versions on top of the executor's own lag
        own = t.lag if t.mode == "simulated_async" else 0
        _check(own + a.oapl_sync_every - 1 <= t.max_staleness, "algorithm.oapl_sync_every",
               f"sync every {a.oapl_sync_every} steps lags the sampler by up to {own + a.oapl_sync_every - 1} "
               f"versions, above trainer.max_staleness {t.max_staleness}")
    _positive(t.queue_size, "trainer.queue_size")
    _check(not t.partial_rollouts or t.mode == "async", "trainer.partial_rollouts",
           f"partial rollouts need trainer.mode=async, got {t.mode!r}")
    _positive(t.partial_chunk_tokens, "trainer.partial_chunk_tokens")
    _positive(t.steps, "trainer.steps")
    for key, seed in (("trainer.seed", t.seed), ("task.eval_seed", c.task.eval_seed)):  # NumPy takes [0, 2³²)
        _check(0 <= seed < 2**32, key, f"must be in [0, 2**32), got {seed}")
    _positive(t.threads, "trainer.threads", allow_zero=True)
    _positive(t.mini_batches, "trainer.mini_batches")
    _positive(t.ranks, "trainer.ranks")
    problem = split_problem(r.prompts_per_step, t.mini_batches, learner_processes(c))  # whole groups per mini-batch, rank
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")
    _check(t.data_parallel in DATA_PARALLEL, "trainer.data_parallel",
           f"expected one of {list(DATA_PARALLEL)}, got {t.data_parallel!r}")
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(t.fsdp, key)
        _check(value is None or value in FSDP_DTYPES, f"trainer.fsdp.{key}",
               f"expected one of {list(FSDP_DTYPES)} or null, got {value!r}")
    _positive(t.micro_batch_size, "trainer.micro_batch_size", allow_zero=True)
    _positive(t.ppo_epochs, "trainer.ppo_epochs")
    _positive(t.eval_every, "trainer.eval_every", allow_zero=True)
    _positive(t.checkpoint_every, "trainer.checkpoint_every", allow_zero=True)
    _positive(t.keep_checkpoints, "trainer.keep_checkpoints")
    _positive(t.max_bad_steps, "trainer.max_bad_steps")
    _positive(t.log_every_s, "trainer.log_every_s", allow_zero=True)

