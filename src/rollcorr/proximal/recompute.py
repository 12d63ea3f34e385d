"""The two strategies that need no extra state: ``recompute`` (classic decoupled PPO) and ``bypass`` (μ)."""

from __future__ import annotations

from torch import Tensor

from rollcorr.proximal.base import ProximalResult, ProximalStrategy
from rollcorr.proximal.scoring import score
from rollcorr.rollout import Rollout


def _share_at(rollout: Rollout, version: int) -> float:
    mask = rollout.response_mask.bool()
    n = int(mask.sum())
    return float(((rollout.version == version) & mask).sum()) / n if n else 0.0


class Recompute(ProximalStrategy):
    """π_old = learner forward at the current version, before the update (Hilton et al.; AReaL's π_prox).

    log π_old(y_t) = log π_train(v_cur)(y_t). Exact only for tokens generated at v_cur; for stale tokens it is
    the policy one step before the update, not π_train(v_gen). Cost: one no-grad forward per batch.
    Metric ``exact_token_fraction``: share of valid tokens with version == current version.
    """

    name = "recompute"
    _exact_share = 0.0

    def is_exact(self, rollout: Rollout, current_version: int) -> bool:
        """Exact when every valid token was generated at the current version (sync mode)."""
        return bool((rollout.version[rollout.response_mask.bool()] == current_version).all())

    def current_log_prob(self, result: ProximalResult) -> Tensor:
        """π_old is the learner before the update: log π_θ comes for free."""
        return result.old_log_prob

    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        self._exact_share = _share_at(rollout, current_version)
        return score(learner, rollout, self.temperature)

    def metrics(self) -> dict[str, float]:
        return {"exact_token_fraction": self._exact_share}


class Bypass(ProximalStrategy):
    """π_old := μ, the sampler's own log-probs (``rollout.rollout_log_prob``).

    Free, but the PPO ratio π_θ/μ then carries discrepancy × drift together (docs/spec.md §1); its error against
    the exact old logits is the discrepancy factor log π_train(v_gen) − log μ.
    """

    name = "bypass"
    needs_rollout_log_prob = True
    old_is_rollout = True

    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        return rollout.rollout_log_prob.detach().float().clone()
