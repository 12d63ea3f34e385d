"""rollcorr inside TRL's ``GRPOTrainer`` (TRL 1.16).

``RollcorrGRPOTrainer`` is ``GRPOTrainer`` with one change: after TRL generates and scores a batch, the
sampler's log-probs (``sampling_per_token_logps``: vLLM's, or a ``rollout_func``'s ``logprobs``) and the
learner's (``old_per_token_logps``, computed here when TRL skipped it) go through
``rollcorr.correction.compute_correction`` with any rollcorr preset or ``CorrectionConfig``. The
resulting weights replace TRL's ``importance_sampling_ratio`` (TRL's ``vllm_importance_sampling_*`` options
are not used), rejected tokens leave ``completion_mask`` (or, with ``denominator="original"``, keep their
place in the denominator with weight 0, as TRL's mask modes do), the ``rollout_corr/*`` metrics go through
TRL's own logger, and with ``dump_path`` every batch is appended to a dump that ``rollcorr analyze`` reads.

    trainer = RollcorrGRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                  correction="decoupled_token_is", dump_path="runs/trl/rollouts.jsonl")

A token whose sampling log-prob is NaN (vLLM reports None) gets ratio 1 (its learner log-prob stands in),
as TRL does. TRL's ``vespo`` loss reads the ratio its own way and is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer

from rollcorr.analyze.dumps import write_dump
from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.presets import preset
from rollcorr.correction.api import compute_correction
from rollcorr.correction.metrics import metrics_to_floats

__all__ = ["RollcorrGRPOTrainer", "correct_trl_batch"]


def correct_trl_batch(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    config: CorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(importance_sampling_ratio (B, T), completion_mask after rejection, ``rollout_corr/*`` floats) for
    TRL's tensors. Weights are 1 where the config applies none; with ``denominator="original"`` rejected
    tokens keep the mask and get weight 0 (TRL's convention), otherwise they leave the mask."""
    sampling = torch.where(
        torch.isnan(sampling_per_token_logps), old_per_token_logps, sampling_per_token_logps
    )
    result = compute_correction(old_per_token_logps, sampling, completion_mask, config)
    keep = result.kept_mask.bool()
    valid = completion_mask.bool()
    weights = torch.ones_like(old_per_token_logps) if result.is_weights is None else result.is_weights
    weights = weights.to(old_per_token_logps.dtype)
    if config.denominator == "original":
        weights = torch.where(keep, weights, 0.0)
        mask = completion_mask
    else:
        mask = completion_mask * keep.to(completion_mask.dtype)
    return torch.where(valid, weights, 0.0), mask, metrics_to_floats(result.metrics)


class RollcorrGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose off-policy correction is rollcorr's (see the module docstring).

    correction  a preset name (``rollcorr.config.presets``) or a ``CorrectionConfig`` (decoupled mode)
    dump_path   JSONL file that every generated batch is appended to (None: no dump)
    """

    def __init__(
        self,
        *args: Any,
        correction: str | CorrectionConfig = "decoupled_token_is",
        dump_path: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        self.correction = preset(correction) if isinstance(correction, str) else correction
        if not isinstance(self.correction, CorrectionConfig):
            raise ValueError(f"correction must be a preset name or a CorrectionConfig, got {correction!r}")
        if self.correction.mode != "decoupled":
            raise ValueError(
                "RollcorrGRPOTrainer: TRL's old_per_token_logps is π_old; use a decoupled correction"
            )
        self.dump_path = None if dump_path is None else Path(dump_path)
        super().__init__(*args, **kwargs)
        if self.loss_type == "vespo":
            raise ValueError(
                "RollcorrGRPOTrainer: loss_type='vespo' reads TRL's own ratio; choose another loss"
            )
        self._rollcorr_step = 0

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        sampling = out.get("sampling_per_token_logps")
        if sampling is None:  # no sampler log-probs (plain HF generation): nothing to correct
            return out
        old = out.get("old_per_token_logps")
        if old is None:
            old = self._learner_logps(out)
            out["old_per_token_logps"] = old
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        weights, kept, metrics = correct_trl_batch(old, sampling, mask, self.correction)
        out["importance_sampling_ratio"] = weights
        if "tool_mask" in out:
            out["tool_mask"] = out["tool_mask"] * kept
        else:
            out["completion_mask"] = kept
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        if self.dump_path is not None and self.accelerator.is_main_process:
            b = mask.shape[0]
            write_dump(
                self.dump_path, sampling, old, mask, advantages=out["advantages"], tokens=out["completion_ids"],
                extras={"step": [self.state.global_step] * b, "batch": [self._rollcorr_step] * b},
            )  # fmt: skip
        self._rollcorr_step += 1
        return out

    @torch.no_grad()
    def _learner_logps(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        """log π_old of the completion tokens, scored by the current model (TRL skips this when it needs
        no ratio: no vLLM, generation aligned with the optimizer step)."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, ids, attention, out["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
        )  # fmt: skip
        return logps

    def _compute_loss(self, model, inputs):
        # TRL multiplies the per-token loss by inputs["importance_sampling_ratio"] only on its vLLM path
        # (use_vllm and vllm_importance_sampling_correction); open that path for rollcorr's weights.
        if "importance_sampling_ratio" not in inputs:
            return super()._compute_loss(model, inputs)
        saved = self.use_vllm, self.vllm_importance_sampling_correction
        self.use_vllm = self.vllm_importance_sampling_correction = True
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm, self.vllm_importance_sampling_correction = saved
