"""``ewma``: π_old = forward of an exponentially weighted average of the learner's weights (PPO-EWMA).

Hilton, Cobbe, Schulman (arXiv 2110.00641), ``EwmaModel`` in openai/ppo-ewma, after *every* optimizer step::

    w' = β w + 1
    θ̄  ← (β w / w') θ̄ + θ / w'        (bias-corrected: θ̄ is the weighted mean Σ_j β^j θ_{n−j} / Σ_j β^j)
    w  ← w'
    reset: the same update with β = 0  →  θ̄ = θ, w = 1

Guan et al. (arXiv 2605.12070) revise it for asynchronous RL in two ways, both implemented here:

1. β tied to the asynchronous window. The EWMA's centre of mass (mean age of the averaged weights, in
   optimizer steps) is β/(1−β). The paper puts it in the middle of a window of k versions, k·s/2 optimizer
   steps with s steps per published version — the mean age of tokens whose lags spread evenly over the
   window. rollcorr measures the window instead of assuming it: after each correction the trainer hands over
   the batch (``after_correction``) and β is set from its mean version lag l̄ over valid tokens::

       β/(1−β) = l̄·s     →     β = l̄·s / (1 + l̄·s)                  (``lag_beta``)

   so the average's centre sits at the mean age of the weights that generated the batch (l̄ = k/2 for
   lags spread evenly over k versions: the paper's rule). Sync training has l̄ = 0 → β = 0, the live
   weights (π_old = recompute). Until a batch is seen β = 0. ``beta=`` fixes β instead.
2. Auto-reset. ``after_correction`` also reads the share of valid tokens kept by the train/infer mask
   (``rollout.kept_mask``, the correction's own result); when it falls below ``reset_keep_ratio`` the
   average is reset to the live weights at the next optimizer step (or the next ``old_log_prob``, whichever
   comes first). Resets are counted (metric ``ewma_resets``). The threshold default (0.9) is rollcorr's
   choice: the paper gives no number.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rollcorr.proximal.base import ProximalStrategy
from rollcorr.proximal.scoring import copy_state, copy_tensors, score, tensor_bytes
from rollcorr.rollout import Rollout
from rollcorr.shards import local_tensor


def lag_beta(mean_lag: float, steps_per_version: int = 1) -> float:
    """β whose centre of mass β/(1−β) is the measured mean lag in optimizer steps: l̄·s (0 → β = 0)."""
    if not mean_lag >= 0 or steps_per_version < 1:
        raise ValueError(f"need mean_lag >= 0 and steps_per_version >= 1, got {mean_lag}, {steps_per_version}")
    com = mean_lag * steps_per_version
    return com / (1 + com)


class EWMA(ProximalStrategy):
    """π_old = forward of θ̄, the bias-corrected EWMA of the learner's weights (see module docstring).

    β follows the measured lag (``after_correction``) unless ``beta`` fixes it. θ̄ is one weight copy
    (``average``, a ``scoring.copy_state`` dict: ``extra_bytes``; with a sharded learner this rank's shards,
    1/N), initialised from the first model it sees (``on_publish`` or ``after_optimizer_step``), updated in
    place after every optimizer step, and put into the learner's model for the π_old forward
    (``score(..., weights=)``). Floating-point parameters and buffers are averaged; other buffers are copied.
    The update is elementwise, so each rank updates its own shards with no communication.
    """

    name = "ewma"

    @classmethod
    def run_defaults(cls, temperature: float, max_staleness: int, steps_per_version: int) -> dict:
        """The base options plus ``steps_per_version``: the lag is counted in optimizer steps."""
        return {**super().run_defaults(temperature, max_staleness, steps_per_version),
                "steps_per_version": steps_per_version}

    def __init__(
        self,
        max_staleness: int = 1,
        steps_per_version: int = 1,
        beta: float | None = None,
        reset_keep_ratio: float | None = 0.9,
        temperature: float = 1.0,
        measure_error: bool = False,
    ):
        super().__init__(temperature=temperature, max_staleness=max_staleness, measure_error=measure_error)
        if steps_per_version < 1:
            raise ValueError(f"steps_per_version must be >= 1, got {steps_per_version}")
        if beta is not None and not 0.0 <= beta < 1.0:
            raise ValueError(f"EWMA beta must be in [0, 1), got {beta}")
        self.steps_per_version = int(steps_per_version)
        self.fixed_beta = None if beta is None else float(beta)
        self.beta = 0.0 if beta is None else float(beta)  # the live weights until a lag is measured
        self.last_lag: float | None = None  # mean version lag of the last batch
        if reset_keep_ratio is not None and not 0.0 <= reset_keep_ratio <= 1.0:
            raise ValueError(f"reset_keep_ratio must be in [0, 1] or None, got {reset_keep_ratio}")
        self.reset_keep_ratio = reset_keep_ratio
        self.average: dict[str, Tensor] | None = None  # θ̄, keyed like the learner's state_dict
        self.weight = 1.0  # w
        self.resets = 0
        self.updates = 0
        self.pending_reset = False
        self.last_keep_ratio: float | None = None

    # ---- the average ------------------------------------------------------------------------------------
    def _init(self, model: nn.Module) -> None:
        if self.average is None:
            self.average = copy_state(model, device=None)
            self.weight = 1.0

    @torch.no_grad()
    def update(self, model: nn.Module, beta: float | None = None) -> None:
        """One EWMA step towards ``model``'s weights: w' = βw + 1, θ̄ ← (βw/w')θ̄ + θ/w' (β=0: reset)."""
        self._init(model)
        beta = self.beta if beta is None else beta
        new_weight = beta * self.weight + 1.0
        keep, take = beta * self.weight / new_weight, 1.0 / new_weight
        live = model.state_dict()
        seen: set[int] = set()  # tied weights appear under several names: update each storage once
        for name, avg in self.average.items():
            avg, cur = local_tensor(avg), local_tensor(live[name]).detach()
            if avg.untyped_storage().data_ptr() in seen:
                continue
            seen.add(avg.untyped_storage().data_ptr())
            if avg.is_floating_point():
                avg.mul_(keep).add_(cur.to(avg.device, avg.dtype), alpha=take)
            else:
                avg.copy_(cur)
        self.weight = new_weight
        self.updates += 1

    def reset(self, model: nn.Module) -> None:
        """θ̄ ← θ, w ← 1 (Hilton's update with decay 0) and count it."""
        self.update(model, beta=0.0)
        self.resets += 1
        self.pending_reset = False

    # ---- hooks --------------------------------------------------------------------------------------------
    def on_publish(self, version: int, model: nn.Module) -> None:
        super().on_publish(version, model)
        self._init(model)

    def after_optimizer_step(self, model: nn.Module) -> None:
        if self.pending_reset:
            self.reset(model)
        else:
            self.update(model)

    def after_correction(self, rollout: Rollout, current_version: int) -> None:
        """β from the batch's measured mean lag; a reset when the correction kept too few tokens."""
        if not rollout.response_mask.any():
            return
        self.last_lag = rollout.mean_lag(current_version)
        if self.fixed_beta is None:
            self.beta = lag_beta(self.last_lag, self.steps_per_version)
        self.observe_keep_share(rollout.keep_share())

    def observe_keep_share(self, keep: float) -> None:
        """Share of valid tokens the train/infer mask kept; below ``reset_keep_ratio`` → reset pending."""
        self.last_keep_ratio = float(keep)
        if self.reset_keep_ratio is not None and self.last_keep_ratio < self.reset_keep_ratio:
            self.pending_reset = True

    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        if self.average is None or self.pending_reset:
            self._init(learner.model)
            if self.pending_reset:
                self.reset(learner.model)
        return score(learner, rollout, self.temperature, weights=self.average)

    # ---- reporting / checkpoints ------------------------------------------------------------------------
    @property
    def extra_bytes(self) -> int:
        return 0 if self.average is None else tensor_bytes(self.average.values())

    def held_weights(self) -> dict[str, dict[str, Tensor]]:
        return {**super().held_weights(), **({} if self.average is None else {"average": self.average})}

    def metrics(self) -> dict[str, float]:
        out = {"ewma_resets": float(self.resets), "ewma_beta": self.beta, "ewma_weight": self.weight}
        if self.last_keep_ratio is not None:
            out["ewma_keep_ratio"] = self.last_keep_ratio
        if self.last_lag is not None:
            out["ewma_lag"] = self.last_lag
        return out

    def state_dict(self) -> dict:
        d = super().state_dict()
        d.update(
            beta=self.beta,
            last_lag=self.last_lag,
            weight=self.weight,
            resets=self.resets,
            updates=self.updates,
            pending_reset=self.pending_reset,
            average=None if self.average is None else copy_tensors(self.average),
        )
        return d

    def load_state_dict(self, d: dict) -> None:
        super().load_state_dict(d)
        self.beta, self.weight = float(d["beta"]), float(d["weight"])
        self.last_lag = d.get("last_lag")  # absent in checkpoints written before β was measured
        self.resets, self.updates, self.pending_reset = (
            int(d["resets"]),
            int(d["updates"]),
            bool(d["pending_reset"]),
        )
        self.average = None if d["average"] is None else dict(d["average"])
