"""The one object that travels: a batch of responses from the sampler to the optimizer.

Every stage reads the fields it needs and adds its own; nothing reaches back. Shapes:
B responses, P prompt positions (left-padded), T response positions (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


@dataclass
class Rollout:
    """A batch of sampled responses and everything later stages attach to it.

    Filled by the sampler:
      prompt_ids        (B, P) int64, left-padded prompt tokens (pad positions hold pad_token_id)
      prompt_mask       (B, P) bool, True on real prompt tokens
      response_ids      (B, T) int64, right-padded sampled tokens
      response_mask     (B, T) bool, True on valid response tokens
      rollout_log_prob  (B, T) float32, log μ(y_t) under the distribution actually sampled from
                        (after temperature / top-k / top-p), 0 on padding; None if the engine gives none
      log_kept_mass     (B, T) float32, log of the probability mass kept by top-k / top-p at each step
                        (0 when nothing was truncated), so log π_full = rollout_log_prob + log_kept_mass
      version           (B, T) int64, weight version that produced each token (partial rollouts span several)
      group_ids         (B,) int64, responses to the same prompt share a group id
      meta              per-response task items (e.g. the prompt text and expected answer), len B
      routed_experts    (B, T, L, k) compact int (uint8 below 256 experts), mixture-of-experts models only: the
                        top-k experts each of the L MoE layers chose at the position that predicts y_t (the
                        last prompt token for t = 0, y_{t-1} after); None for a dense model (rollcorr.moe)
      prompt_routed_experts  (B, P, L, k) the same for every prompt position (aligned with prompt_ids; its
                        last column is the routing of routed_experts[:, 0]), so a replay covers the context too
    Added later:
      rewards           (B,) float32                      (task)
      old_log_prob      (B, T) float32                    (proximal strategy)
      is_weights        (B, T) float32 or None            (correction: the IS weights w)
      kept_mask         (B, T) bool                       (correction: response_mask after rejection; the
                                                           trainer also drops dynamic sampling's groups)
      advantages        (B, T) float32                    (advantages)
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    rollout_log_prob: Tensor | None
    version: Tensor
    group_ids: Tensor
    log_kept_mass: Tensor | None = None
    routed_experts: Tensor | None = None
    prompt_routed_experts: Tensor | None = None
    meta: list[dict[str, Any]] = field(default_factory=list)
    rewards: Tensor | None = None
    old_log_prob: Tensor | None = None
    is_weights: Tensor | None = None
    kept_mask: Tensor | None = None
    advantages: Tensor | None = None

    def __post_init__(self) -> None:
        b, t = self.response_ids.shape
        if self.prompt_ids.shape[0] != b or self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(
                f"prompt_ids {tuple(self.prompt_ids.shape)} / prompt_mask {tuple(self.prompt_mask.shape)} "
                f"do not match {b} responses"
            )
        for name in ("response_mask", "rollout_log_prob", "version", "log_kept_mass"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {(b, t)}")
        for name, width in (("routed_experts", t), ("prompt_routed_experts", self.prompt_ids.shape[1])):
            value = getattr(self, name)
            if value is not None and (value.dim() != 4 or tuple(value.shape[:2]) != (b, width)):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({b}, {width}, layers, top_k)")
        if tuple(self.group_ids.shape) != (b,):
            raise ValueError(f"group_ids has shape {tuple(self.group_ids.shape)}, expected {(b,)}")

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        """(B, P + T) prompt and response concatenated (padding on both sides)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(B, P + T) bool, True on real tokens."""
        return torch.cat([self.prompt_mask.bool(), self.response_mask.bool()], dim=1)

    # ---- the version lag: its one home ---------------------------------------------------------------
    # lag_t = v_learner − v_gen(t): how many learner versions ago the weights that sampled token t were
    # published. "staleness" in rollcorr means this and nothing else (log π_θ − log π_old is the "drift").
    def lag(self, version: int) -> Tensor:
        """(B, T) int64 version lag ``version`` − v_gen of every token (meaningful on valid tokens only)."""
        return version - self.version

    def max_lag(self, version: int) -> int:
        """Largest version lag over valid tokens: learner ``version`` − the oldest valid token's (0 without
        any). The staleness bound (``trainer.max_staleness``) is checked against it."""
        mask = self.response_mask.bool()
        return version - int(self.version[mask].min()) if mask.any() else 0

    def mean_lag(self, version: int) -> float:
        """Mean version lag over valid tokens (0.0 without any)."""
        mask = self.response_mask.bool()
        return float(self.lag(version)[mask].float().mean()) if mask.any() else 0.0

    def lag_metrics(self, version: int) -> dict[str, float]:
        """The version-lag metrics logged once per step (``staleness/…``): mean and max lag over valid tokens,
        the oldest version in the batch, and the share of responses whose tokens span several versions
        (partial rollouts)."""
        mask = self.response_mask.bool()
        if not mask.any():
            return {"staleness/lag_mean": 0.0, "staleness/lag_max": 0.0, "staleness/mixed_version_fraction": 0.0}
        big = torch.iinfo(torch.int64).max
        newest = torch.where(mask, self.version, torch.full_like(self.version, -1)).max(1).values
        oldest = torch.where(mask, self.version, torch.full_like(self.version, big)).min(1).values
        mixed = ((newest > oldest) & mask.any(1)).float().mean()
        return {
            "staleness/lag_mean": self.mean_lag(version),
            "staleness/lag_max": float(self.max_lag(version)),
            "staleness/oldest_version": float(self.version[mask].min()),
            "staleness/mixed_version_fraction": float(mixed),
        }

    def keep_share(self) -> float:
        """Share of valid tokens the correction kept (``kept_mask`` / ``response_mask``; 1.0 without any)."""
        if self.kept_mask is None:
            raise ValueError("keep_share needs kept_mask: run the correction first")
        valid = int(self.response_mask.bool().sum())
        return float((self.kept_mask.bool() & self.response_mask.bool()).sum()) / valid if valid else 1.0

    def select(self, index: Tensor | list[int]) -> Rollout:
        """A new Rollout holding the rows in ``index`` (tensors indexed, ``meta`` picked)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                out[f.name] = value[idx]
            elif f.name == "meta":
                out[f.name] = [value[i] for i in idx.tolist()] if value else []
            else:
                out[f.name] = value
        return Rollout(**out)

    def replace(self, **changes: Any) -> Rollout:
        return replace(self, **changes)

    @staticmethod
    def concat(parts: list[Rollout], pad_token_id: int = 0) -> Rollout:
        """Stack rollouts, re-padding prompts (left) and responses (right) to common widths."""
        if not parts:
            raise ValueError("Rollout.concat needs at least one rollout")
        p = max(r.prompt_ids.shape[1] for r in parts)
        t = max(r.response_ids.shape[1] for r in parts)

        def pad_dim1(x: Tensor, before: int, after: int, value: float) -> Tensor:
            """Pad dimension 1 (positions) of a (B, W, ...) tensor."""
            widths = [0, 0] * (x.dim() - 2) + [before, after]
            return torch.nn.functional.pad(x, widths, value=value)

        def left(x: Tensor | None, width: int, value: float) -> Tensor | None:
            return None if x is None else pad_dim1(x, width - x.shape[1], 0, value)

        def right(x: Tensor | None, width: int, value: float) -> Tensor | None:
            return None if x is None else pad_dim1(x, 0, width - x.shape[1], value)

        out: dict[str, Any] = {}
        for f in fields(Rollout):
            values = [getattr(r, f.name) for r in parts]
            if f.name == "meta":
                out[f.name] = [m for v in values for m in v]
            elif all(v is None for v in values):
                out[f.name] = None
            elif any(v is None for v in values):
                raise ValueError(f"cannot concat rollouts where only some have {f.name}")
            elif f.name in ("prompt_ids", "prompt_mask", "prompt_routed_experts"):
                pad = pad_token_id if f.name == "prompt_ids" else 0
                out[f.name] = torch.cat([left(v, p, pad) for v in values])
            elif values[0].dim() >= 2:
                out[f.name] = torch.cat([right(v, t, 0) for v in values])
            else:
                out[f.name] = torch.cat(values)
        return Rollout(**out)
