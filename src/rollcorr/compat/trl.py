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

Mixture-of-experts models: ``routing_replay="r3"`` replays the sampler's experts in every forward of the policy
(π_old and the loss's π_θ, through the backward pass's recomputation under gradient checkpointing;
rollcorr.moe.attach_replay). The ``rollout_func`` returns them per completion as
``routed_experts`` (one (layers, top_k) list per completion token: the routing of the position that predicts
it) and, optionally, ``prompt_routed_experts`` (one per prompt token), as rollcorr's hf sampler records them.

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
from rollcorr.moe import attach_replay, sequence_routing

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

    correction      a preset name (``rollcorr.config.presets``) or a ``CorrectionConfig`` (decoupled mode)
    dump_path       JSONL file that every generated batch is appended to (None: no dump)
    routing_replay  None, or "r3": replay the rollout_func's ``routed_experts`` (see the module docstring)
    """

    def __init__(
        self,
        *args: Any,
        correction: str | CorrectionConfig = "decoupled_token_is",
        dump_path: str | Path | None = None,
        routing_replay: str | None = None,
        **kwargs: Any,
    ) -> None:
        if routing_replay not in (None, "r3"):
            raise ValueError(f"routing_replay must be None or 'r3', got {routing_replay!r}")
        self.routing_replay, self._replay = routing_replay, None
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

    def _generate(self, prompts: list):
        result = super()._generate(prompts)
        if self.routing_replay:  # from here on, TRL's scoring forwards replay the sampler's experts
            prompt_ids, completion_ids, extra = result[0], result[1], result[5]
            self._replay.set(trl_routing(prompt_ids, completion_ids, extra.pop("routed_experts", None),
                                         extra.pop("prompt_routed_experts", None)))  # fmt: skip
        return result

    def _generate_and_score_completions(self, inputs):
        if not self.routing_replay:
            return self._score_and_correct(inputs)
        if self._replay is None:  # installed once, kept for the backward passes' recomputed forwards
            self._replay = attach_replay(self.accelerator.unwrap_model(self.model))
        self._replay.set(None)  # generation routes freely; _generate hands the sampler's routing over
        out = self._score_and_correct(inputs)
        out["routed_experts"] = self._replay.expert_ids  # (B, P + T, L, k), for the loss's forward
        return out

    def _score_and_correct(self, inputs):
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
        if "routed_experts" in inputs:  # stays set through the backward pass (gradient checkpointing re-runs it)
            self._replay.set(inputs["routed_experts"])
        return self._corrected_loss(model, inputs)

    def _corrected_loss(self, model, inputs):
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


def trl_routing(prompt_ids: list[list[int]], completion_ids: list[list[int]], routed, prompt_routed) -> torch.Tensor:
    """A ``rollout_func``'s per-completion routing → (B, P + T, L, k) int64 expert ids over TRL's layout
    (prompts left-padded to P, completions right-padded to T), −1 where the router keeps its own choice."""
    if routed is None:
        raise ValueError("routing_replay='r3' needs the rollout_func to return routed_experts per completion")
    routes = [torch.as_tensor(r, dtype=torch.long) for r in routed]
    p, t = max(map(len, prompt_ids)), max(map(len, completion_ids))
    layers, k = routes[0].shape[1:]
    prompt_mask = torch.tensor([[i >= p - len(ids) for i in range(p)] for ids in prompt_ids])
    response_mask = torch.tensor([[i < len(ids) for i in range(t)] for ids in completion_ids])
    response = torch.zeros(len(routes), t, layers, k, dtype=torch.long)
    for i, r in enumerate(routes):
        response[i, : len(r)] = r[: t]
    prompt = None
    if prompt_routed is not None:
        prompt = torch.zeros(len(routes), p, layers, k, dtype=torch.long)
        for i, r in enumerate(prompt_routed):
            r = torch.as_tensor(r, dtype=torch.long)
            prompt[i, p - len(r) :] = r
    return sequence_routing(prompt_mask, response_mask, response, prompt)
