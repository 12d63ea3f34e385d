"""The frozen reference policy π_ref of ``algorithm.kl``: the run's starting weights, scored once per step.

What it costs (said when the run starts): a full learner keeps one more copy of its starting weights beside the
model (``proximal.scoring.copy_state``: parameters and buffers, on the model's device; a sharded learner its own
shards) and runs one more no-grad forward per step; a LoRA learner keeps nothing — its reference is the base model,
scored with the adapters switched off — and pays the forward only. No gradient, no optimizer state.

Under the keep mask (``Rollout.kept_ids``) the reference is scored over the same kept sets as π_old and π_θ, so
the KL estimate between two equal policies is 0 (scored over the whole vocabulary it would carry the kept mass,
as the correction's ratios did).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from rollcorr.engines.lora import is_lora, lora_layers
from rollcorr.proximal.scoring import copy_state, score, tensor_bytes
from rollcorr.rollout import Rollout


@contextmanager
def adapters_off(model: nn.Module):
    """Inside: every LoRA layer of ``model`` computes its base layer only (PEFT's ``enable_adapters(False)``)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class FrozenReference:
    """π_ref: the learner's weights when it is built (a LoRA learner's base), scored with the learner's own code."""

    def __init__(self, learner) -> None:
        self.lora = is_lora(learner.model)
        self.weights = None if self.lora else copy_state(learner.model, device=None)
        self.bytes = 0 if self.weights is None else tensor_bytes(self.weights.values())

    def describe(self, coef: float, estimator: str, where: str) -> str:
        """The start-of-run line: what the reference holds and what it costs."""
        held = ("the base model with the LoRA adapters off: no extra weights" if self.lora
                else f"a frozen copy of the starting weights, {self.bytes / 1e9:.2f} GB beside the model")
        return (f"algorithm.kl: coef {coef:g} × {estimator} against a reference policy in the {where}; the reference "
                f"is {held}, and one more no-grad forward per step")

    @torch.no_grad()
    def log_prob(self, learner, rollout: Rollout, temperature: float) -> Tensor:
        """(B, T) log π_ref of the response tokens (0 on padding), over the rollout's kept sets when it has them."""
        if self.lora:
            with adapters_off(learner.model):
                return score(learner, rollout, temperature)
        return score(learner, rollout, temperature, weights=self.weights)
