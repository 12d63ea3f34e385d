"""``interrupt``: exact old logits for partial rollouts by pausing the sampler before a version is dropped.

Guan et al. (arXiv 2605.12070), exact route 3. Setting: partial rollouts — the sampler's weights are refreshed mid-sequence, so one
response spans versions, and the weights of a version are gone once the learner moves past it. Protocol,
once per published version::

    strategy.before_publish(learner, in_flight)   # learner still holds v_out, the version the sampler ran
    learner.step(...)                              # weights move on: v_out + 1
    strategy.on_publish(v_out + 1, learner.model); sampler.load(...)

``before_publish`` scores every in-flight sequence (partial, or finished but not yet trained on) with the
learner's current weights and stores log π_train(v_out)(y_t) for the tokens generated at v_out. The sampler
must be paused for this: tokens it generated after the pause would have no stored old logit. The stall is the
wall time of ``before_publish`` (metric ``stall_seconds``): one no-grad forward over the in-flight rows that
hold tokens of v_out, once per version, plus the pause/resume in the sampler itself, which this module does
not see.

When the finished rollout comes back, ``old_log_prob`` uses the stored value for every token that has one
(exact) and scores the remaining tokens with the learner's current weights (exact for tokens generated at the
current version, recompute-like for others). Stored log-probs are keyed by content (``store.TokenStore``):
rows need no ids and can be re-batched freely. Entries older than ``max_staleness`` versions are dropped at
``on_publish``.

With a learner sharded over data-parallel ranks, every rank receives the same in-flight rollouts (rank 0's
executor broadcasts them, ``distributed.roles``); the stall's forward is split over the ranks (each scores
⌈B / N⌉ of the rows and the scores are gathered, ``scoring.score_split``), so every rank stores all of them
and finds the tokens of whatever rows it trains on.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import Tensor

from rollcorr.proximal.base import ProximalStrategy
from rollcorr.proximal.scoring import score, score_split
from rollcorr.proximal.store import TokenStore
from rollcorr.rollout import Rollout


def fill_missing(stored: Tensor, found: Tensor, rollout: Rollout, scorer) -> Tensor:
    """``stored`` where ``found``, else ``scorer(rows)`` (B', T) for the rows with a missing valid token.
    ``scorer`` is called once, with no rows too (``scoring.score`` then runs no forward unless the learner
    scores together with other ranks, which must all call it)."""
    missing = rollout.response_mask.bool().cpu() & ~found
    rows = missing.any(dim=1).nonzero().squeeze(1)
    live = torch.zeros_like(stored)
    live[rows] = scorer(rollout.select(rows)).cpu()
    return torch.where(found, stored, live)


class Interrupt(ProximalStrategy):
    """Exact old logits of interrupted tokens; live forward for the rest (see module docstring)."""

    name = "interrupt"
    exact = True
    pauses_sampler = True

    def __init__(self, max_staleness: int = 1, temperature: float = 1.0, measure_error: bool = False):
        super().__init__(temperature=temperature, max_staleness=max_staleness, measure_error=measure_error)
        self.store = TokenStore()
        self.current_version: int | None = None
        self.stall_seconds = 0.0
        self.last_stall_seconds = 0.0
        self.interrupts = 0
        self._interrupted_share = self._exact_share = 0.0
        self.steps_since_publish = 0
        self.skipped = 0

    def on_publish(self, version: int, model) -> None:
        super().on_publish(version, model)
        self.current_version = int(version)
        self.steps_since_publish = 0
        self.store.evict(self.current_version - self.max_staleness)

    def after_optimizer_step(self, model) -> None:
        self.steps_since_publish += 1

    @torch.no_grad()
    def before_publish(self, learner, in_flight: list[Rollout], version: int | None = None) -> float:
        """Store exact old log-probs of in-flight tokens generated at ``version`` (default: the last published).

        Call while the learner still holds the weights of ``version``. Returns the stall in seconds. Without
        ``version``, if the learner took optimizer steps since the last publish (e.g. OAPL publishes only
        every few versions) it no longer holds the sampler's weights: nothing is stored, the call is counted
        in the ``interrupt_skipped`` metric and a warning is issued once.
        """
        v = self.current_version if version is None else int(version)
        if v is None:
            raise ValueError(
                "before_publish needs a version: call on_publish(version, model) first or pass version="
            )
        if version is None and self.steps_since_publish > 0:
            if self.skipped == 0:
                warnings.warn(
                    "interrupt: the learner has moved past the published weights, so no exact old logits "
                    "can be stored (publish after every update to use this strategy)",
                    stacklevel=2,
                )
            self.skipped += 1
            return 0.0
        start = time.perf_counter()
        for rollout in in_flight:
            rows = self.store.missing_rows(rollout, v)
            if rows:
                part = rollout.select(rows)
                self.store.save(part, score_split(learner, part, self.temperature), v)
        self.last_stall_seconds = time.perf_counter() - start
        self.stall_seconds += self.last_stall_seconds
        self.interrupts += 1
        return self.last_stall_seconds

    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        stored, found = self.store.lookup(rollout)
        mask = rollout.response_mask.bool().cpu()
        n = max(int(mask.sum()), 1)
        self._interrupted_share = float(found.sum()) / n
        self._exact_share = float((found | (mask & (rollout.version.cpu() == current_version))).sum()) / n
        old = fill_missing(stored, found, rollout, lambda part: score(learner, part, self.temperature))
        return old.to(rollout.response_ids.device)

    @property
    def extra_bytes(self) -> int:
        return self.store.nbytes

    def metrics(self) -> dict[str, float]:
        return {
            "interrupted_token_fraction": self._interrupted_share,
            "exact_token_fraction": self._exact_share,
            "stall_seconds": self.stall_seconds,
            "last_stall_seconds": self.last_stall_seconds,
            "interrupts": float(self.interrupts),
            "stored_tokens": float(len(self.store)),
            "interrupt_skipped": float(self.skipped),
        }

    def state_dict(self) -> dict:
        d = super().state_dict()
        d.update(
            store=self.store.state_dict(),
            current_version=self.current_version,
            stall_seconds=self.stall_seconds,
            interrupts=self.interrupts,
        )
        return d

    def load_state_dict(self, d: dict) -> None:
        super().load_state_dict(d)
        self.store.load_state_dict(d["store"])
        self.current_version = d["current_version"]
        self.stall_seconds, self.interrupts = float(d["stall_seconds"]), int(d["interrupts"])
