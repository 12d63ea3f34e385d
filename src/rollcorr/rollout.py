"""The one object that travels: a batch of responses from the sampler to the optimizer.

Every stage reads the fields it needs and adds its own; nothing reaches back. Shapes:
B responses, P prompt positions (left-padded), T response positions (right-padded).

One turn or many, one type: a multi-turn trajectory is a response whose positions alternate the model's turns
and what the environment said between them (tool results, feedback). ``response_mask`` marks the tokens the
model wrote — the only ones any loss, correction or metric reads —, ``observation_mask`` the environment's,
which every forward attends to as context (``token_mask``: both). A single-turn rollout is the case with no
observation tokens (``observation_mask`` None), so nothing downstream of the sampler branches on it.
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
      kept_ids          (B, T, K) int32, the token ids top-k / top-p kept at each step (most likely first, −1
                        after the step's own count and on padding; K = the batch's largest kept set), when the
                        sampler was asked for them (``SamplingParams.record_kept_ids``): the learner scores
                        over the same set (``sampler_distribution="keep_mask"``); None otherwise
      version           (B, T) int64, weight version that produced each token (partial rollouts span several)
      group_ids         (B,) int64, responses to the same prompt share a group id
      meta              per-response task items (e.g. the prompt text and expected answer), len B
      routed_experts    (B, T, L, k) compact int (uint8 below 256 experts), mixture-of-experts models only: the
                        top-k experts each of the L MoE layers chose at the position that predicts y_t (the
                        last prompt token for t = 0, y_{t-1} after); None for a dense model (rollcorr.moe)
      prompt_routed_experts  (B, P, L, k) the same for every prompt position (aligned with prompt_ids; its
                        last column is the routing of routed_experts[:, 0]), so a replay covers the context too
      observation_mask  (B, T) bool, True on tokens the environment wrote between the model's turns (the ids as the
                        sampler appended them: never re-tokenised); rollout_log_prob and log_kept_mass hold 0
                        there; None: a single-turn batch (no such token)
      turn              (B, T) int64, the model turn each token belongs to (0, 1, ...: an observation carries the
                        index of the turn it answers); None: a single-turn batch (every token in turn 0)
    Added later:
      rewards           (B,) float32                      (task)
      old_log_prob      (B, T) float32                    (proximal strategy)
      ref_log_prob      (B, T) float32 or None            (the frozen reference of ``algorithm.kl``)
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
    kept_ids: Tensor | None = None
    routed_experts: Tensor | None = None
    prompt_routed_experts: Tensor | None = None
    observation_mask: Tensor | None = None
    turn: Tensor | None = None
    meta: list[dict[str, Any]] = field(default_factory=list)
    rewards: Tensor | None = None
    old_log_prob: Tensor | None = None
    ref_log_prob: Tensor | None = None
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
        for name in ("response_mask", "rollout_log_prob", "version", "log_kept_mass", "observation_mask", "turn"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {(b, t)}")
        if self.kept_ids is not None and (self.kept_ids.dim() != 3 or tuple(self.kept_ids.shape[:2]) != (b, t)):
            raise ValueError(f"kept_ids has shape {tuple(self.kept_ids.shape)}, expected ({b}, {t}, kept)")
        for name, width in (("routed_experts", t), ("prompt_routed_experts", self.prompt_ids.shape[1])):
            value = getattr(self, name)
            if value is not None and (value.dim() != 4 or tuple(value.shape[:2]) != (b, width)):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({b}, {width}, layers, top_k)")
        if tuple(self.group_ids.shape) != (b,):
            raise ValueError(f"group_ids has shape {tuple(self.group_ids.shape)}, expected {(b,)}")
        if self.observation_mask is not None and (self.observation_mask.bool() & self.response_mask.bool()).any():
            raise ValueError("a token is marked both as the model's (response_mask) and the environment's "
                             "(observation_mask)")

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        """(B, P + T) prompt and response concatenated (padding on both sides)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def token_mask(self) -> Tensor:
        """(B, T) bool: every real token of the response side, the model's and the environment's."""
        if self.observation_mask is None:
            return self.response_mask.bool()
        return self.response_mask.bool() | self.observation_mask.bool()

    @property
    def attention_mask(self) -> Tensor:
        """(B, P + T) bool, True on real tokens (the environment's included)."""
        return torch.cat([self.prompt_mask.bool(), self.token_mask], dim=1)

    @property
    def turns(self) -> Tensor:
        """(B,) int64: the number of model turns of each response (1 for a single-turn batch)."""
        if self.turn is None:
            return torch.ones(self.batch_size, dtype=torch.long)
        mask = self.response_mask.bool()
        last = torch.where(mask, self.turn, torch.full_like(self.turn, -1)).max(1).values
        return last + 1

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

    def next_turn(self) -> list[int]:
        """Per row, the turn index of the next token the model writes: the turn after an observation when the
        row ends with one (the environment has spoken), else the row's current turn (0 for an empty row)."""
        if self.turn is None:
            return [0] * self.batch_size
        valid, observed = self.token_mask, self.observation_mask
        out = []
        for i in range(self.batch_size):
            n = int(valid[i].sum())
            out.append(0 if n == 0 else int(self.turn[i, n - 1]) + bool(observed is not None and observed[i, n - 1]))
        return out

    def with_observations(self, observations: dict[int, list[int]], version: int) -> Rollout:
        """Row i's ``observations[i]`` (token ids) appended after its last real token as the environment's:
        ``observation_mask`` True, ``response_mask`` False, log-probs 0, ``version``, the turn of the model turn
        they answer; the row is marked unfinished (``meta[i]["finished"] = False``) so that the sampler continues
        it, and what later stages computed is dropped. Rows not in ``observations`` are untouched."""
        if self.routed_experts is not None:
            raise ValueError("observations between turns are not supported with a mixture of experts' routing")
        valid = self.token_mask
        turn = self.turn if self.turn is not None else torch.zeros_like(self.response_ids)
        observed = self.observation_mask if self.observation_mask is not None else torch.zeros_like(valid)
        log_mu = self.rollout_log_prob if self.rollout_log_prob is not None else torch.zeros(valid.shape)
        kept = self.log_kept_mass if self.log_kept_mass is not None else torch.zeros(valid.shape)
        columns = {"response_ids": (self.response_ids, 0), "response_mask": (self.response_mask.bool(), False),
                   "rollout_log_prob": (log_mu, 0.0), "log_kept_mass": (kept, 0.0), "version": (self.version, version),
                   "observation_mask": (observed.bool(), True), "turn": (turn, None)}
        rows = {name: [col[i][valid[i]].tolist() for i in range(self.batch_size)] for name, (col, _) in columns.items()}
        for i, ids in observations.items():
            current = rows["turn"][i][-1] if rows["turn"][i] else 0
            for name, (_, fill) in columns.items():
                rows[name][i] += list(ids) if name == "response_ids" else [current if fill is None else fill] * len(ids)
        width = max(len(r) for r in rows["response_ids"])
        out = {name: _right_pad(rows[name], col.dtype, width) for name, (col, _) in columns.items()}
        for name in ("rollout_log_prob", "log_kept_mass"):  # what the sampler gave none of stays None
            if getattr(self, name) is None:
                out[name] = None
        if self.kept_ids is not None:  # the environment's tokens were drawn from no kept set: −1
            sets = [self.kept_ids[i][valid[i]] for i in range(self.batch_size)]
            for i, ids in observations.items():
                sets[i] = torch.cat([sets[i], sets[i].new_full((len(ids), sets[i].shape[1]), -1)])
            out["kept_ids"] = torch.stack([torch.nn.functional.pad(r, [0, 0, 0, width - r.shape[0]], value=-1)
                                           for r in sets])
        meta = [dict(m) for m in self.meta] if self.meta else [{} for _ in range(self.batch_size)]
        for i in observations:
            meta[i]["finished"] = False
        return self.replace(**out, meta=meta, rewards=None, old_log_prob=None, is_weights=None, kept_mask=None,
                            advantages=None)

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
            elif f.name in ("observation_mask", "turn"):  # None is its zero: no observation, every token turn 0
                kinds = {"observation_mask": torch.bool, "turn": torch.long}
                values = [torch.zeros(r.response_ids.shape, dtype=kinds[f.name]) if v is None else v
                          for r, v in zip(parts, values)]
                out[f.name] = torch.cat([right(v, t, 0) for v in values])
            elif any(v is None for v in values):
                raise ValueError(f"cannot concat rollouts where only some have {f.name}")
            elif f.name == "kept_ids":  # −1 pads both the positions and the kept sets
                k = max(v.shape[2] for v in values)
                out[f.name] = torch.cat([torch.nn.functional.pad(v, [0, k - v.shape[2], 0, t - v.shape[1]], value=-1)
                                         for v in values])
            elif f.name in ("prompt_ids", "prompt_mask", "prompt_routed_experts"):
                pad = pad_token_id if f.name == "prompt_ids" else 0
                out[f.name] = torch.cat([left(v, p, pad) for v in values])
            elif values[0].dim() >= 2:
                out[f.name] = torch.cat([right(v, t, 0) for v in values])
            else:
                out[f.name] = torch.cat(values)
        return Rollout(**out)


def _right_pad(rows: list[list], dtype: torch.dtype, width: int) -> Tensor:
    """Per-row lists → a (B, width) tensor of ``dtype``, zero after each row's entries."""
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out
