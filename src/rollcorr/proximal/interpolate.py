"""``loglinear`` / ``linear``: AReaL / A-3PO interpolation between μ and π_θ by version distance.

AReaL's ``compute_prox_logp_approximations`` (A-3PO, arXiv 2512.06547), per token with v_θ the learner's current
version and v_behav the token's generation version::

    v_prox = v_θ − 1
    α      = clamp((v_prox − v_behav) / (v_θ − v_behav), 0, 1)      (α = 0 where v_θ == v_behav)
    loglinear: log π_prox = log μ + α (log π_θ − log μ)
    linear:    log π_prox = log((1 − α) μ + α π_θ)

log π_θ is a detached learner forward at the current version (its cost is counted). Naming follows
AReaL's later code: AReaL's Nov-2025 docs called the log-space form "linear" and the prob-space one "harmonic".
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollcorr.proximal.base import ProximalStrategy
from rollcorr.proximal.scoring import score
from rollcorr.rollout import Rollout


def interpolation_alpha(version: Tensor, current_version: int) -> Tensor:
    """(B, T) α = clamp((v_θ − 1 − v_behav) / (v_θ − v_behav), 0, 1), 0 where v_behav == v_θ."""
    gap = (current_version - version).double()
    alpha = torch.where(gap > 0, (gap - 1) / gap.clamp(min=1), torch.zeros_like(gap))
    return alpha.clamp(0, 1).float()


def loglinear_prox(rollout_log_prob: Tensor, log_prob: Tensor, alpha: Tensor) -> Tensor:
    """log π_prox = log μ + α (log π_θ − log μ)."""
    return rollout_log_prob + alpha * (log_prob - rollout_log_prob)


def linear_prox(rollout_log_prob: Tensor, log_prob: Tensor, alpha: Tensor) -> Tensor:
    """log π_prox = log((1 − α) μ + α π_θ), computed as a log-sum-exp (exact at α = 0 and α = 1)."""
    log_a = torch.log(alpha)  # -inf at α = 0: logaddexp then returns the other term
    log_1ma = torch.log1p(-alpha)
    return torch.logaddexp(log_1ma + rollout_log_prob, log_a + log_prob)


class _Interpolate(ProximalStrategy):
    needs_rollout_log_prob = True
    _alpha_mean = 0.0
    _combine = staticmethod(loglinear_prox)

    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        log_prob = score(learner, rollout, self.temperature)
        mu = rollout.rollout_log_prob.detach().float().to(log_prob.device)
        alpha = interpolation_alpha(rollout.version.to(log_prob.device), current_version)
        mask = rollout.response_mask.bool().to(log_prob.device)
        self._alpha_mean = float(alpha[mask].mean()) if mask.any() else 0.0
        return self._combine(mu, log_prob, alpha)

    def metrics(self) -> dict[str, float]:
        return {"alpha_mean": self._alpha_mean}


class LogLinear(_Interpolate):
    """AReaL ``loglinear``: interpolation in log space (see module docstring)."""

    name = "loglinear"
    _combine = staticmethod(loglinear_prox)


class Linear(_Interpolate):
    """AReaL ``linear`` (A-3PO prob-space, "harmonic" in AReaL's Nov-2025 docs)."""

    name = "linear"
    _combine = staticmethod(linear_prox)
