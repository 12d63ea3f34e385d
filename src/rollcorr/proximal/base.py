"""The proximal-policy protocol (docs/spec.md §7): where π_old comes from when training is asynchronous.

Every hook a strategy may need is a method of ``ProximalStrategy`` with a no-op default, and every question the
trainer asks is a class attribute with a default, so the trainer calls the same surface for every strategy
and never probes for methods or compares names. Once per training step, in this order::

    strategy.on_publish(0, learner.model)                       # weights the sampler starts with
    for step ...:
        rollout = sampler.generate(...)                         # rollout.version: (B, T) v_gen per token
        # follows_sampler: on_sampler_load(v, weights) at every sampler load, submit(chunk) per chunk
        stall = strategy.before_publish(learner, in_flight)     # pauses_sampler: exact logits of in-flight tokens
        res = strategy.old_log_prob(rollout, learner, current_version)
        rollout.old_log_prob = res.old_log_prob                 # (B, T) detached, 0 on padding
        corr = compute_correction(...)                          # rollout.kept_mask: response_mask after rejection
        strategy.after_correction(rollout, current_version)     # e.g. EWMA: keep share and measured lag
        ... loss, learner.step ...; strategy.after_optimizer_step(learner.model)
        version += 1; strategy.on_publish(version, learner.model); sampler.load(...)
    strategy.wait()                                             # background work done (before a checkpoint)

With ``measure_error=True`` every strategy also keeps a snapshot store of the published weights as a
reference and reports how far its π_old is from the exact one, π_train(v_gen) (``ProximalResult.error``).

Data-parallel learners (``trainer.ranks > 1``, docs/distributed.md): every rank calls every hook with the
same arguments except ``old_log_prob``, which gets the rank's own rows. A strategy that holds weights keeps
them as ``scoring.copy_state`` copies and scores with ``scoring.score(..., weights=)`` or
``store.score_by_version``: with a sharded learner the copies are this rank's shards and the forward puts them
into the sharded model, so the strategy is the same code at any N. It names its copies in ``held_weights``
(the trainer checkpoints them with the sharded weights and shards a one-process checkpoint's copies), and
whether it can run sharded is ``data_parallel`` (default: unless it follows the sampler).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from rollcorr.config.correction import LOG_RATIO_CLAMP
from rollcorr.proximal.scoring import check_versions, scores_together
from rollcorr.proximal.store import SnapshotStore, score_by_version
from rollcorr.rollout import Rollout


@dataclass
class ProximalResult:
    """Old log-probs and what they cost.

    old_log_prob  (B, T) float32, detached, 0 on padding
    seconds       wall time this call cost the training path
    extra_bytes   memory the strategy holds beyond the learner (weight copies, stored logits)
    error         vs exact old logits π_train(v_gen) when a reference is kept (``measure_error=True``):
                  logp_abs_err_mean, logp_abs_err_max, p_abs_err_mean over valid tokens; else None
    metrics       strategy-specific numbers (exact token share, EWMA resets, stall seconds, ...)
    """

    old_log_prob: Tensor
    seconds: float
    extra_bytes: int
    error: dict[str, float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def to_metrics(self, prefix: str = "proximal/") -> dict[str, float]:
        """Flat dict for logging: seconds, extra_bytes, error/*, and the strategy metrics."""
        out = {f"{prefix}seconds": self.seconds, f"{prefix}extra_bytes": float(self.extra_bytes)}
        for k, v in (self.error or {}).items():
            out[f"{prefix}error/{k}"] = v
        for k, v in self.metrics.items():
            out[f"{prefix}{k}"] = v
        return out


class ProximalStrategy:
    """Base class: timing, input checks and error measurement; subclasses implement ``_old_log_prob``.

    Class attributes (the questions the trainer asks):
      name                    the ``make_proximal`` name
      needs_rollout_log_prob  True when the strategy reads μ (``rollout.rollout_log_prob``)
      exact                   True when π_old is the learner at v_gen for every token (see ``is_exact``)
      follows_sampler         True when the strategy takes its weights from the sampler's loads
                              (``on_sampler_load``) and scores chunks as they are generated (``submit``)
                              instead of being told about the learner's publishes (``on_publish``)
      pauses_sampler          True when ``before_publish`` needs the sampler paused and its in-flight rollouts
      old_is_rollout          True when π_old := μ (bypass: the correction's bypass mode needs it)
    """

    name = "base"
    needs_rollout_log_prob = False
    exact = False
    follows_sampler = False
    pauses_sampler = False
    old_is_rollout = False

    @classmethod
    def run_defaults(cls, temperature: float, max_staleness: int, steps_per_version: int) -> dict:
        """Constructor options the trainer fills from the run's settings (an explicit option wins)."""
        return {"temperature": temperature, "max_staleness": max_staleness}

    def __init__(self, temperature: float = 1.0, max_staleness: int = 1, measure_error: bool = False):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.temperature = float(temperature)
        self.max_staleness = int(max_staleness)
        self.reference: SnapshotStore | None = SnapshotStore(max_staleness) if measure_error else None

    # ---- what the trainer asks -----------------------------------------------------------------------
    @property
    def data_parallel(self) -> bool:
        """Whether the strategy runs with a learner sharded over several ranks. Default: every strategy except
        one that follows the sampler, whose weight loads and chunks reach rank 0 alone and are scored on a
        background thread (a sharded forward is a collective every rank must join in the same order)."""
        return not self.follows_sampler

    def held_weights(self) -> dict[str, dict[str, Tensor]]:
        """The weight copies the strategy holds, by a name of its own: each a ``scoring.copy_state`` dict keyed
        like the learner's ``state_dict`` (with a sharded learner: ``DTensor`` shards). The same dict objects
        its ``state_dict`` returns copies of. Default: the measurement reference's versions."""
        if self.reference is None:
            return {}
        return {f"reference/{v}": self.reference.get(v) for v in self.reference.versions}

    def is_exact(self, rollout: Rollout, current_version: int) -> bool:
        """Whether π_old of this batch is π_train(v_gen) for every valid token (default: ``exact``)."""
        return self.exact

    def current_log_prob(self, result: ProximalResult) -> Tensor | None:
        """log π_θ before the update (B, T) when π_old already *is* it (recompute), so the caller saves a
        forward; None otherwise (the default)."""
        return None

    # ---- hooks the trainer calls (no-op defaults) ----------------------------------------------------
    def on_publish(self, version: int, model: nn.Module) -> None:
        """The learner just published weights ``version`` (the sampler will generate with them)."""
        if self.reference is not None:
            self.reference.put(version, model)

    def on_sampler_load(self, version: int, model: nn.Module) -> None:
        """The sampler just loaded weights ``version`` (``model`` holds them). Called instead of ``on_publish``
        for strategies that follow the sampler; the default forwards to ``on_publish``."""
        self.on_publish(version, model)

    def submit(self, rollout: Rollout, learner) -> None:
        """A chunk (finished or partial) the sampler just generated; default: nothing."""

    def before_publish(self, learner, in_flight: list[Rollout], version: int | None = None) -> float:
        """The learner still holds the sampler's weights and the sampler is paused (``pauses_sampler``) with
        ``in_flight`` rollouts not yet trained on. Returns the stall in seconds; default: nothing, 0.0."""
        return 0.0

    def after_correction(self, rollout: Rollout, current_version: int) -> None:
        """The correction just ran: ``rollout.kept_mask`` is its train/infer mask (``response_mask`` after
        rejection) and ``current_version − rollout.version`` the measured version lag. Default: nothing."""

    def after_optimizer_step(self, model: nn.Module) -> None:
        """The learner's weights just changed (one optimizer step)."""

    def wait(self) -> None:
        """Block until background work is done (before a checkpoint or the end of the run); default: nothing."""

    def old_log_prob(self, rollout: Rollout, learner, current_version: int) -> ProximalResult:
        """π_old for every response token of ``rollout``; the learner holds weights ``current_version``."""
        check_versions(rollout, current_version)
        if self.needs_rollout_log_prob:
            _check_finite("rollout.rollout_log_prob", rollout.rollout_log_prob, rollout.response_mask)
        start = time.perf_counter()
        old = self._old_log_prob(rollout, learner, current_version).detach()
        seconds = time.perf_counter() - start
        mask = rollout.response_mask.bool().to(old.device)
        if tuple(old.shape) != tuple(mask.shape):
            raise ValueError(
                f"{self.name}: old_log_prob has shape {tuple(old.shape)}, expected {tuple(mask.shape)}"
            )
        _check_finite(f"{self.name} old_log_prob", old, mask)
        old = torch.where(mask, old, torch.zeros_like(old))
        error = None
        metrics = self.metrics()
        if self.reference is not None and (mask.any() or scores_together(learner)):
            # measurement only: a token older than the reference window leaves the error unmeasured
            try:
                error = old_logit_error(old, self._reference_log_prob(rollout, learner, old), mask)
            except KeyError:
                metrics["reference_missing"] = 1.0
            metrics["reference_bytes"] = float(self.reference.nbytes)
        return ProximalResult(old, seconds, self.extra_bytes, error, metrics)

    # ---- what subclasses provide --------------------------------------------------------------------
    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        raise NotImplementedError

    @property
    def extra_bytes(self) -> int:
        """Memory held by the strategy itself (the measurement reference is not counted)."""
        return 0

    def metrics(self) -> dict[str, float]:
        """Strategy-specific counters, reported in every ``ProximalResult``."""
        return {}

    def _reference_log_prob(self, rollout: Rollout, learner, old: Tensor) -> Tensor:
        """Exact old log-probs from the reference store (scored with each token's own version)."""
        return score_by_version(self.reference, learner, rollout, self.temperature).to(old.device)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "name": self.name,
            "reference": None if self.reference is None else self.reference.state_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("name") != self.name:
            raise ValueError(f"state dict is for proximal strategy {d.get('name')!r}, not {self.name!r}")
        if d.get("reference") is not None:
            if self.reference is None:
                self.reference = SnapshotStore(self.max_staleness)
            self.reference.load_state_dict(d["reference"])


def _check_finite(name: str, x: Tensor | None, mask: Tensor) -> None:
    if x is None:
        raise ValueError(f"{name} is None: this strategy needs the sampler's log-probs")
    if tuple(x.shape) != tuple(mask.shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(mask.shape)}")
    bad = ~torch.isfinite(x) & mask.bool().to(x.device)
    if bad.any():
        raise ValueError(f"{name} has {int(bad.sum())} non-finite values on valid tokens")


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return x[mask.bool()]


def old_logit_error(old_log_prob: Tensor, exact_old_log_prob: Tensor, mask: Tensor) -> dict[str, float]:
    """How far a proxy π_old is from the exact one over valid tokens.

    logp_abs_err_mean = mean |log π_old − log π_exact|, logp_abs_err_max = max of the same,
    p_abs_err_mean = mean |π_old − π_exact| (probability space).
    """
    for name, x in (("old_log_prob", old_log_prob), ("exact_old_log_prob", exact_old_log_prob)):
        _check_finite(name, x, mask)
    if not mask.bool().any():
        raise ValueError("response_mask selects no token: cannot measure the old-logit error")
    a, b = _masked(old_log_prob.float(), mask), _masked(exact_old_log_prob.float(), mask)
    d = (a - b).abs()
    return {
        "logp_abs_err_mean": float(d.mean()),
        "logp_abs_err_max": float(d.max()),
        "p_abs_err_mean": float((a.exp() - b.exp()).abs().mean()),
    }


def discrepancy_drift(
    rollout_log_prob: Tensor, exact_old_log_prob: Tensor, log_prob: Tensor, mask: Tensor
) -> dict[str, float]:
    """The two factors of docs/spec.md §1, for logging: π_θ/μ = (π_old/μ) · (π_θ/π_old) with π_old = π_train(v_gen).

    Per valid token: discrepancy d_t = log π_old − log μ (sampler vs learner at the same weights), drift
    s_t = log π_θ − log π_old (how far the learner moved since those weights; its cause is the version lag,
    "staleness"), both clamped to ±20, total d_t + s_t = log π_θ − log μ. Returns masked means, standard
    deviations and mean absolute values of d and s, the mean total, and the mean ratios exp(d), exp(s). All
    inputs (B, T); ``log_prob`` is detached here.
    """
    mask = mask.bool()
    for name, x in (
        ("rollout_log_prob", rollout_log_prob),
        ("exact_old_log_prob", exact_old_log_prob),
        ("log_prob", log_prob),
    ):
        _check_finite(name, x, mask)
    if not mask.any():
        raise ValueError("response_mask selects no token: cannot compute discrepancy/drift")
    mu, old, theta = (
        _masked(x.detach().float(), mask) for x in (rollout_log_prob, exact_old_log_prob, log_prob)
    )
    d = (old - mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = (theta - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "discrepancy_log_mean": float(d.mean()),
        "discrepancy_log_std": float(d.std(correction=0)),
        "discrepancy_log_abs_mean": float(d.abs().mean()),
        "discrepancy_ratio_mean": float(d.exp().mean()),
        "drift_log_mean": float(s.mean()),
        "drift_log_std": float(s.std(correction=0)),
        "drift_log_abs_mean": float(s.abs().mean()),
        "drift_ratio_mean": float(s.exp().mean()),
        "total_log_mean": float((d + s).mean()),
    }
