"""``old_logit_model``: a dedicated second model that follows the sampler's weights (Guan et al., arXiv 2605.12070, exact route 2).

The dedicated model always holds the weights of the version the sampler runs: it receives them at every
``on_publish``, like the sampler. Samples — finished or partial — are handed over as soon as they are
generated (``submit``); a background thread scores them with the dedicated model while the learner keeps
training and stores the log-probs of the tokens generated at the model's version (``store.TokenStore``,
keyed by content). ``old_log_prob`` looks the tokens up and scores only what is missing, with the weights
the dedicated model holds at that moment. All work (scoring, lookups, weight loads) runs in order on one
worker thread, so a rollout submitted before ``on_publish(v + 1, ...)`` is scored with the weights of v.

What is exact: every token submitted before the version that generated it was replaced, i.e. if the
trainer submits each generation chunk (partial rollouts included) before the next publish, every token is
exact — the same result as ``interrupt`` without stalling the sampler. Tokens never submitted in time are
scored with the dedicated model's newer weights (recompute-like); ``exact_token_fraction`` reports the share
of tokens that were stored or generated at the model's current version.

Cost: one extra model (``extra_bytes`` also counts the stored float32 log-probs), one weight copy per publish
on the training path (``publish_seconds``), forwards in the background (``background_seconds``).
``ProximalResult.seconds`` is only the time the training path waited (including queued work).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn

from rollcorr.proximal.base import ProximalStrategy
from rollcorr.proximal.interrupt import fill_missing
from rollcorr.proximal.scoring import clone_model, copy_state, model_bytes, score
from rollcorr.proximal.store import TokenStore
from rollcorr.rollout import Rollout


class OldLogitModel(ProximalStrategy):
    """π_old = forward of a dedicated model holding the sampler's weights (see module docstring)."""

    name = "old_logit_model"
    exact = True
    follows_sampler = True

    def __init__(
        self,
        temperature: float = 1.0,
        max_staleness: int = 1,
        measure_error: bool = False,
        background: bool = True,
    ):
        super().__init__(temperature=temperature, max_staleness=max_staleness, measure_error=measure_error)
        self.model: nn.Module | None = None
        self.model_version: int | None = None
        self.store = TokenStore()
        self.background = background
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="old-logit-model")
        self.background_seconds = 0.0  # written by the worker only
        self.publish_seconds = 0.0
        self._exact_share = 0.0
        self._restored: dict[str, Tensor] | None = None  # checkpoint weights waiting for a model

    def _run(self, fn, *args) -> Future:
        """Queue ``fn(*args)`` on the worker (or run it now when ``background=False``)."""
        if self.background:
            return self._executor.submit(fn, *args)
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    # ---- weights follow the sampler ------------------------------------------------------------------
    def on_publish(self, version: int, model: nn.Module) -> None:
        super().on_publish(version, model)
        start = time.perf_counter()
        if self.model is None and self._restored is None:
            self.model, self.model_version = clone_model(model), int(version)
        else:
            self._ensure_model(model)
            state = copy_state(model, device=next(self.model.parameters()).device)  # the learner moves on
            self._run(self._load, state, int(version))  # queued after the rollouts already submitted
        self.publish_seconds += time.perf_counter() - start

    def _load(self, state: dict[str, Tensor], version: int) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)
        self.model_version = version
        self.store.evict(version - self.max_staleness)

    # ---- scoring ------------------------------------------------------------------------------------------
    def submit(self, rollout: Rollout, learner) -> Future:
        """Queue ``rollout`` (finished or partial): store its tokens generated at the model's version."""
        self._ensure_model(learner.model)
        return self._run(self._store, rollout, learner)

    def _store(self, rollout: Rollout, learner) -> int:
        start = time.perf_counter()
        rows = self.store.missing_rows(rollout, self.model_version)
        n = 0
        if rows:
            part = rollout.select(rows)
            n = self.store.save(
                part, score(learner, part, self.temperature, model=self.model), self.model_version
            )
        self.background_seconds += time.perf_counter() - start
        return n

    def _lookup(self, rollout: Rollout, learner) -> tuple[Tensor, float]:
        stored, found = self.store.lookup(rollout)
        mask = rollout.response_mask.bool().cpu()
        exact = found | (mask & (rollout.version.cpu() == self.model_version))
        share = float(exact.sum()) / max(int(mask.sum()), 1)
        old = fill_missing(
            stored, found, rollout, lambda part: score(learner, part, self.temperature, model=self.model)
        )
        return old, share

    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        self._ensure_model(learner.model)
        old, self._exact_share = self._run(self._lookup, rollout, learner).result()
        return old.to(rollout.response_ids.device)

    def wait(self) -> None:
        """Block until every queued job (scoring, weight loads) is done."""
        self._run(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # ---- reporting / checkpoints --------------------------------------------------------------------------
    @property
    def extra_bytes(self) -> int:
        return (0 if self.model is None else model_bytes(self.model)) + self.store.nbytes

    def metrics(self) -> dict[str, float]:
        return {
            "exact_token_fraction": self._exact_share,
            "background_seconds": self.background_seconds,
            "publish_seconds": self.publish_seconds,
            "stored_tokens": float(len(self.store)),
        }

    def state_dict(self) -> dict:
        self.wait()
        d = super().state_dict()
        d.update(
            model_version=self.model_version,
            store=self.store.state_dict(),
            weights=None
            if self.model is None
            else {k: v.clone() for k, v in self.model.state_dict().items()},
        )
        return d

    def load_state_dict(self, d: dict, model: nn.Module | None = None) -> None:
        """Restore. The weights go into the dedicated model; if there is none yet they are kept until one is
        built from ``model`` (here) or from the first model seen (``on_publish`` / ``submit`` / ``old_log_prob``)."""
        super().load_state_dict(d)
        self.wait()
        self.store.load_state_dict(d["store"])
        self.model_version = d["model_version"]
        if d["weights"] is None:
            return
        if self.model is None:
            self._restored = d["weights"]
            if model is not None:
                self._ensure_model(model)
            return
        with torch.no_grad():
            self.model.load_state_dict(d["weights"])

    def _ensure_model(self, model: nn.Module) -> None:
        """Build the dedicated model from ``model``'s architecture if needed, with restored weights if any."""
        if self.model is not None:
            return
        if self._restored is None:
            raise RuntimeError("old_logit_model: call on_publish(version, model) first")
        self.model = clone_model(model)
        with torch.no_grad():
            self.model.load_state_dict(self._restored)
        self._restored = None
