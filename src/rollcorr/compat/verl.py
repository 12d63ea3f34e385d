"""A verl drop-in: verl's names and signatures (verl 0.9.1), rollcorr's math.

Policy losses (``verl.trainer.ppo.core_algos``)::

    compute_policy_loss_<mode>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=<verl's>,
                               config=None, rollout_is_weights=None)          -> (loss, metrics)
    compute_policy_loss_reinforce(rollout_log_prob, log_prob, ...)  (verl's names; seq-mean-token-sum)
    POLICY_LOSS_REGISTRY / register_policy_loss / get_policy_loss_fn,  agg_loss,  kl_penalty
    compute_policy_loss = compute_policy_loss_vanilla (verl's registered signature)

Rollout correction (``verl.trainer.ppo.rollout_corr_helper``)::

    compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask, ...)
    compute_rollout_correction_weights(log_ratio, response_mask, ...)   compute_rollout_rejection_mask(...)
    compute_offpolicy_metrics(...)   compute_rollout_correction_and_add_to_batch(batch, cfg)
    apply_bypass_mode(batch, cfg, policy_loss_config)

``config`` may be verl's dataclass (``ActorConfig`` / ``RolloutCorrectionConfig``), an OmegaConf node or a
dict (a ``_target_`` key is allowed); missing fields take verl's dataclass defaults. ``install()`` puts
these implementations into verl's own registry and helper module, so a verl run uses them by name.

Where rollcorr deliberately differs from verl (docs/verl.md), ``strict_verl=True`` gives verl's result:
positive log-probs are accepted instead of raising, an all-masked mean is NaN instead of 0, and the
log-ratio is left unclamped where verl leaves it (gspo's ``actor/ppo_kl``, geo_mean, clip_cov, kl_cov).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from rollcorr.compat.verl_correction import (
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from rollcorr.compat.verl_losses import LOSS_MODES, agg_loss, kl_penalty, policy_loss_by_mode, verl_modes
from rollcorr.losses import LOSSES, LossConfig, policy_loss

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "agg_loss",
    "apply_bypass_mode",
    "compute_offpolicy_metrics",
    "compute_policy_loss",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "get_policy_loss_fn",
    "install",
    "kl_penalty",
    "register_policy_loss",
]

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Any]]]


# ---- verl config objects ---------------------------------------------------------------------------
def cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` for a verl dataclass, an OmegaConf node or a dict; ``default`` when absent or None."""
    value = cfg_raw(config, key)
    return default if value is None else value


def cfg_raw(config: Any, key: str, default: Any = None) -> Any:
    """``config.get(key, default)`` as verl reads it: ``default`` only when the key is absent (an explicit
    None stays None)."""
    if config is None:
        return default
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def _actor_fields(config: Any) -> dict[str, Any]:
    """verl ``ActorConfig`` / ``PolicyLossConfig`` fields with verl's defaults, as policy_loss_by_mode's
    keyword arguments."""
    clip = cfg_get(config, "clip_ratio", 0.2)
    pl = cfg_get(config, "policy_loss")
    return {
        "clip_ratio_low": cfg_get(config, "clip_ratio_low", clip),
        "clip_ratio_high": cfg_get(config, "clip_ratio_high", clip),
        "tau_pos": cfg_get(config, "tau_pos", 1.0),
        "tau_neg": cfg_get(config, "tau_neg", 1.05),
        "clip_cov_ratio": cfg_get(pl, "clip_cov_ratio", 2e-4),
        "clip_cov_lb": cfg_get(pl, "clip_cov_lb", 1.0),
        "clip_cov_ub": cfg_get(pl, "clip_cov_ub", 5.0),
        "kl_cov_ratio": cfg_get(pl, "kl_cov_ratio", 2e-4),
        "ppo_kl_coef": cfg_get(pl, "ppo_kl_coef", 1.0),  # verl's kl_cov reads None as 1.0
        "dro_beta": cfg_get(pl, "dro_beta"),  # verl's default None: its dro raises, so does rollcorr's
        "global_batch_info": dict(cfg_get(config, "global_batch_info", {})),
    }


# verl's default loss_agg_mode where it is not "token-mean"
DEFAULT_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "reinforce": "seq-mean-token-sum"}


def _registered(mode: str) -> PolicyLossFn:
    def loss_fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = DEFAULT_AGG.get(mode, "token-mean"),
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
        *,
        strict_verl: bool = False,
    ) -> tuple[Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError(f"verl loss {mode!r} needs the actor config (verl asserts config is not None)")
        kwargs = _actor_fields(config)
        # verl's dual clip defaults to 3.0, its DPPO ratio cap to 20.0
        clip_c = cfg_get(config, "clip_ratio_c", 20.0 if mode.startswith("dppo") else 3.0)
        return policy_loss_by_mode(
            mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
            clip_ratio_c=clip_c, rollout_is_weights=rollout_is_weights, strict_verl=strict_verl, **kwargs,
        )

    loss_fn.__name__ = loss_fn.__qualname__ = f"compute_policy_loss_{mode}"
    loss_fn.__doc__ = f"verl's registered ``{mode}`` policy loss (rollcorr.compat.verl_losses)."
    return loss_fn


# compute_policy_loss_<mode> for every loss of the catalogue with a verl_name, made from the catalogue: the built-in
# ones here, one registered later on first access (module __getattr__, POLICY_LOSS_REGISTRY)
for _mode in LOSS_MODES:
    globals()[f"compute_policy_loss_{_mode}"] = _registered(_mode)
_reinforce = globals()["compute_policy_loss_reinforce"]
compute_policy_loss_vanilla = globals()["compute_policy_loss_vanilla"]
compute_policy_loss = compute_policy_loss_vanilla


def compute_policy_loss_reinforce(
    rollout_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
    *,
    strict_verl: bool = False,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's REINFORCE loss −A·w·log π (bypass mode, π_old := μ), under verl's argument names; its
    ``actor/ppo_kl`` metric is the mean of log μ − log π."""
    return _reinforce(
        rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
        strict_verl=strict_verl,
    )


def compute_policy_loss_bypass_mode(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
    *,
    strict_verl: bool = False,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's ``bypass_mode`` loss: π_old := μ (``old_log_prob`` is the rollout log-prob). The correction
    (config.policy_loss.rollout_correction) is computed from π_θ/μ; ``loss_type`` ``ppo_clip`` clips that
    ratio and applies no weight, ``reinforce`` applies the weights. Rollout metrics are merged in."""
    corr = cfg_get(cfg_get(config, "policy_loss"), "rollout_correction")
    if corr is None:
        raise ValueError("bypass_mode loss needs config.policy_loss.rollout_correction (verl raises too)")
    # read as verl reads it (``corr.get(key, default)``): an explicit None stays None, e.g.
    # rollout_is_threshold=None turns IS off
    loss_type = cfg_raw(corr, "loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    with torch.no_grad():
        proto, mask, rollout_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach(),
            rollout_log_prob=old_log_prob,
            response_mask=response_mask,
            rollout_is=cfg_raw(corr, "rollout_is"),
            rollout_is_threshold=cfg_raw(corr, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=bool(cfg_raw(corr, "rollout_is_batch_normalize", False)),
            rollout_rs=cfg_raw(corr, "rollout_rs"),
            rollout_rs_threshold=cfg_raw(corr, "rollout_rs_threshold"),
            strict_verl=strict_verl,
        )
    if loss_type == "reinforce":
        weights = None if proto is None else proto.batch["rollout_is_weights"]
        loss, metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, weights, strict_verl=strict_verl
        )
    else:
        loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, None, strict_verl=strict_verl
        )
    metrics.update(rollout_metrics)
    return loss, metrics


def __getattr__(name: str):
    """``compute_policy_loss_<mode>`` for a loss registered in the catalogue after this module was imported."""
    mode = name.removeprefix("compute_policy_loss_")
    if name.startswith("compute_policy_loss_") and mode in verl_modes():
        fn = globals()[name] = _registered(mode)
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _PolicyLosses(dict):
    """verl's ``POLICY_LOSS_REGISTRY``: the losses registered here (``register_policy_loss``, bypass_mode), and
    every loss mode of the catalogue and every ``rollcorr_<name>``, read when asked (a loss registered later is
    found by name too)."""

    def _catalogue(self) -> dict[str, PolicyLossFn]:
        found = {mode: getattr(sys.modules[__name__], f"compute_policy_loss_{mode}") for mode in verl_modes()
                 if mode != "reinforce"}
        found.update({f"rollcorr_{name}": _rollcorr_loss(name) for name in extra_losses()})
        return {name: fn for name, fn in found.items() if not dict.__contains__(self, name)}

    def __missing__(self, key: str) -> PolicyLossFn:
        found = self._catalogue()
        if key in found:
            return found[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self._catalogue()

    def __iter__(self):
        yield from dict.__iter__(self)
        yield from self._catalogue()

    def __len__(self) -> int:
        return dict.__len__(self) + len(self._catalogue())

    def keys(self):
        return list(iter(self))

    def items(self):
        return [(k, self[k]) for k in self]

    def values(self):
        return [self[k] for k in self]


# ---- the registry ----------------------------------------------------------------------------------
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = _PolicyLosses(bypass_mode=compute_policy_loss_bypass_mode)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name`` (verl's ``register_policy_loss``)."""

    def decorator(func: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSS_REGISTRY[name] = func
        return func

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The registered loss ``name`` (verl's error for an unknown one)."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: {list(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


def extra_losses() -> tuple[str, ...]:
    """The catalogue's losses served under verl's signature as ``rollcorr_<name>`` now: every loss but those that
    need μ or rewards and group ids (ppo_is, vanilla_is, tis, areal, oapl), which verl's signature does not
    pass."""
    return tuple(name for name, spec in LOSSES.items() if not (spec.needs_rollout_log_prob or spec.needs_rewards))


_EXTRA_FNS: dict[str, PolicyLossFn] = {}  # one function per rollcorr_<name>, made when first asked


def _rollcorr_loss(name: str) -> PolicyLossFn:
    """``rollcorr_<name>``: the catalogue's loss ``name`` under verl's signature."""
    if name not in _EXTRA_FNS:
        _EXTRA_FNS[name] = _verl_signature(name)
    return _EXTRA_FNS[name]


def _verl_signature(name: str) -> PolicyLossFn:
    def loss_fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        f = _actor_fields(config)
        beta = {} if f["dro_beta"] is None else {"dro_beta": f["dro_beta"]}  # None: rollcorr's default β
        loss_config = LossConfig(  # no config: the loss's own defaults (rollcorr.losses)
            name=name,
            clip_low=None if config is None else f["clip_ratio_low"],
            clip_high=None if config is None else f["clip_ratio_high"],
            clip_c=cfg_get(config, "clip_ratio_c"),
            agg=loss_agg_mode,
            sapo_tau_pos=f["tau_pos"],
            sapo_tau_neg=f["tau_neg"],
            **beta,
        )
        loss, metrics = policy_loss(
            loss_config, log_prob, old_log_prob, advantages, response_mask, weights=rollout_is_weights
        )
        return loss, {k: float(v) for k, v in metrics.items()}

    loss_fn.__name__ = loss_fn.__qualname__ = f"rollcorr_{name}"
    loss_fn.__doc__ = f"rollcorr's ``{name}`` loss (rollcorr.losses) under verl's registered signature."
    return loss_fn


# ---- DataProto-level helpers -----------------------------------------------------------------------
def compute_rollout_correction_and_add_to_batch(
    batch: Any, rollout_corr_config: Any, *, strict_verl: bool = False
) -> tuple[Any, dict]:
    """verl's batch-level entry: reads ``old_log_probs``, ``rollout_log_probs``, ``response_mask`` from
    ``batch.batch``, writes the rejected ``response_mask`` and (when IS is on) ``rollout_is_weights``.
    Returns (batch, ``rollout_corr/*`` metrics)."""
    from rollcorr.config.dialects import verl_mapping

    cfg = verl_mapping(rollout_corr_config)
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=batch.batch["old_log_probs"],
        rollout_log_prob=batch.batch["rollout_log_probs"],
        response_mask=batch.batch["response_mask"],
        rollout_is=cfg["rollout_is"],
        rollout_is_threshold=cfg["rollout_is_threshold"],
        rollout_is_batch_normalize=cfg["rollout_is_batch_normalize"],
        rollout_rs=cfg["rollout_rs"],
        rollout_rs_threshold=cfg["rollout_rs_threshold"],
        strict_verl=strict_verl,
    )
    batch.batch["response_mask"] = mask
    if weights is not None:
        batch.batch["rollout_is_weights"] = weights.batch["rollout_is_weights"]
    return batch, metrics


def apply_bypass_mode(batch: Any, rollout_corr_config: Any = None, policy_loss_config: Any = None) -> None:
    """verl's bypass setup: ``old_log_probs := rollout_log_probs`` and the policy loss becomes
    ``bypass_mode`` with the rollout-correction config attached."""
    if "rollout_log_probs" not in batch.batch:
        raise ValueError(
            "bypass_mode=True requires rollout_log_probs in batch. "
            "Ensure rollout worker is configured to calculate_log_probs=true."
        )
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    _set(policy_loss_config, "rollout_correction", rollout_corr_config)
    _set(policy_loss_config, "loss_mode", "bypass_mode")


def _set(config: Any, key: str, value: Any) -> None:
    """Set a field on a dict, an OmegaConf node (struct mode lifted, like verl's ``open_dict``) or a
    dataclass."""
    if dataclasses.is_dataclass(config) and not isinstance(config, Mapping):
        object.__setattr__(config, key, value)
        return
    try:
        from omegaconf import DictConfig, open_dict
    except ImportError:  # no OmegaConf: a plain mapping
        config[key] = value
        return
    if isinstance(config, DictConfig):
        with open_dict(config):
            config[key] = value
    else:
        config[key] = value


# ---- install into verl -----------------------------------------------------------------------------
def install(*, strict_verl: bool = False) -> list[str]:
    """Put rollcorr into the installed verl: every registered verl loss name (and ``rollcorr_<name>`` for
    rollcorr's extra losses) in ``core_algos.POLICY_LOSS_REGISTRY`` maps to rollcorr's implementation, and
    ``rollout_corr_helper``'s correction entry points are rollcorr's. Call it once in the driver and in
    each worker process (e.g. from a module named in ``VERL_USE_EXTERNAL_MODULES``). Returns the
    registered loss names. Raises ImportError when verl is not installed."""
    import functools

    from verl.trainer.ppo import core_algos, rollout_corr_helper

    names = []
    for name, fn in POLICY_LOSS_REGISTRY.items():
        wrapped = functools.partial(fn, strict_verl=strict_verl) if name in (*verl_modes(), "bypass_mode") else fn
        core_algos.POLICY_LOSS_REGISTRY[name] = wrapped
        names.append(name)
    strict = functools.partial(functools.partial, strict_verl=strict_verl)
    replacements = {
        (rollout_corr_helper, "compute_rollout_correction_and_rejection_mask"): strict(
            compute_rollout_correction_and_rejection_mask
        ),
        (rollout_corr_helper, "compute_rollout_correction_weights"): compute_rollout_correction_weights,
        (rollout_corr_helper, "compute_rollout_rejection_mask"): compute_rollout_rejection_mask,
        (rollout_corr_helper, "compute_offpolicy_metrics"): strict(compute_offpolicy_metrics),
        (rollout_corr_helper, "compute_rollout_corr_metrics_from_logprobs"): strict(
            compute_rollout_corr_metrics_from_logprobs
        ),
        (rollout_corr_helper, "compute_rollout_correction_and_add_to_batch"): strict(
            compute_rollout_correction_and_add_to_batch
        ),
        (rollout_corr_helper, "apply_bypass_mode"): apply_bypass_mode,
        (core_algos, "agg_loss"): agg_loss,
    }
    rebind = {}
    for (module, attr), fn in replacements.items():
        for previous in (_verl_original(module, attr), getattr(module, attr, None)):  # verl's, an earlier install's
            if previous is not None:
                rebind[id(previous)] = fn
        setattr(module, attr, fn)
    # verl modules imported before install() hold the functions by name (`from ... import agg_loss` in
    # verl/trainer/ppo/ray_trainer.py, v1/trainer_base.py, workers/utils/losses.py): rebind those names too
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("verl.") and module is not None:
            for attr, value in list(vars(module).items()):
                if id(value) in rebind and module not in (rollout_corr_helper, core_algos):
                    setattr(module, attr, rebind[id(value)])
    return names


_ORIGINALS: dict[tuple[str, str], Any] = {}


def _verl_original(module: Any, attr: str) -> Any:
    """verl's own function ``module.attr``, remembered the first time install() replaces it (so a second
    install() still finds the names that verl modules bound to it)."""
    return _ORIGINALS.setdefault((module.__name__, attr), getattr(module, attr, None))
