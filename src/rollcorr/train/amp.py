"""Dynamic loss scaling for an fp16 mixed-precision learner (``model.learner=hf:amp-fp16``).

fp16 has 5 exponent bits: gradients below 6e-8 flush to zero and the backward pass of a small loss loses most
of them. The loss is multiplied by a scale S before the backward pass, every gradient divided by S after it
(float32 master gradients, so nothing is lost there), and S adapts (the scheme of NVIDIA's mixed-precision
training and of ``torch.amp.GradScaler``):

- a gradient that is inf or NaN after unscaling means S overflowed fp16: the optimizer step is skipped — not a
  bad step of the run, it is counted in ``train/amp_overflow_skips`` — and S is halved;
- after ``growth_interval`` finite steps in a row, S doubles.

One ``LossScaler`` per run; its state (S and the streak) is part of the checkpoint, so a resumed run scales as
the uninterrupted one would have. bf16 has fp32's exponent range and needs none (``for_learner`` gives None).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


@dataclass
class LossScaler:
    scale: float = INITIAL_SCALE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = GROWTH_INTERVAL
    good_steps: int = 0  # finite steps since the last change of scale
    overflows: int = 0  # optimizer steps skipped for an overflow, over the run

    @classmethod
    def for_learner(cls, learner_spec: str) -> LossScaler | None:
        """A scaler for an fp16 mixed-precision learner, None for any other."""
        from rollcorr.engines import parse_spec

        return cls() if parse_spec(learner_spec).dtype == "amp-fp16" else None

    def unscale(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; True when all of them are finite (this rank's shards: the
        caller agrees over ranks)."""
        finite = True
        for p in params:
            if p.grad is None:
                continue
            p.grad.div_(self.scale)
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            finite &= bool(torch.isfinite(local).all())
        return finite

    def update(self, finite: bool) -> None:
        """After one optimizer step's gradients: back off on an overflow (the step is skipped), grow after a streak."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
