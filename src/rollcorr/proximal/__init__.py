"""Where π_old comes from when training is asynchronous (docs/spec.md §7).

``make_proximal(name, **kw)`` builds one of: recompute, bypass, snapshot, old_logit_model, interrupt,
loglinear, linear, ewma — or a strategy added with ``register(cls)``. Each is a ``ProximalStrategy`` (the protocol and its hooks: ``base.py``) returning a
``ProximalResult``; see docs/proximal.md.
"""

from __future__ import annotations

from rollcorr.proximal.base import (
    ProximalResult,
    ProximalStrategy,
    discrepancy_drift,
    old_logit_error,
)
from rollcorr.proximal.ewma import EWMA, lag_beta
from rollcorr.proximal.interpolate import (
    Linear,
    LogLinear,
    interpolation_alpha,
    linear_prox,
    loglinear_prox,
)
from rollcorr.proximal.interrupt import Interrupt
from rollcorr.proximal.old_logit_model import OldLogitModel
from rollcorr.proximal.recompute import Bypass, Recompute
from rollcorr.proximal.snapshot import Snapshot
from rollcorr.proximal.store import SnapshotStore, TokenStore, prefix_keys, score_by_version

STRATEGIES: dict[str, type[ProximalStrategy]] = {
    cls.name: cls for cls in (Recompute, Bypass, Snapshot, OldLogitModel, Interrupt, LogLinear, Linear, EWMA)
}


def register(cls: type[ProximalStrategy]) -> type[ProximalStrategy]:
    """Make ``cls`` (a ``ProximalStrategy`` subclass) a strategy under ``cls.name``: ``make_proximal`` and the
    trainer's ``algorithm.proximal.name`` then know it. Usable as a class decorator; returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, ProximalStrategy)):
        raise TypeError(f"register needs a ProximalStrategy subclass, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name or cls.name == ProximalStrategy.name:
        raise ValueError(f"{cls.__name__}.name must be the strategy's own name, got {cls.name!r}")
    if cls.name in STRATEGIES and STRATEGIES[cls.name] is not cls:
        raise ValueError(f"a strategy named {cls.name!r} exists already ({STRATEGIES[cls.name].__name__})")
    STRATEGIES[cls.name] = cls
    return cls


def make_proximal(name: str, **kw) -> ProximalStrategy:
    """Build the strategy ``name`` with keyword options (e.g. ``max_staleness``, ``temperature``,
    ``measure_error``; ewma: ``beta``, ``steps_per_version``, ``reset_keep_ratio``)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown proximal strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    try:
        return STRATEGIES[name](**kw)
    except TypeError as e:
        raise TypeError(f"bad options for proximal strategy {name!r}: {e}") from None


__all__ = [
    "EWMA",
    "STRATEGIES",
    "Bypass",
    "Interrupt",
    "Linear",
    "LogLinear",
    "OldLogitModel",
    "ProximalResult",
    "ProximalStrategy",
    "Recompute",
    "Snapshot",
    "SnapshotStore",
    "TokenStore",
    "prefix_keys",
    "register",
    "discrepancy_drift",
    "interpolation_alpha",
    "lag_beta",
    "linear_prox",
    "loglinear_prox",
    "make_proximal",
    "old_logit_error",
    "score_by_version",
]
