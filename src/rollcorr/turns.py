"""Per-turn views of trajectories: each model token's turn and its place in the turn, and the mismatch summed by
either — one implementation for the live audit, a dump read whole or chunk by chunk, and ``rollcorr analyze``.

A multi-turn trajectory's response side alternates the model's turns with the environment's tokens
(docs/multi-turn.md); only the model's tokens are scored (the mask). A token's turn comes from a per-token turn
field when there is one (``Rollout.turn``, a dump's ``turn``), else from the mask alone — a turn is a maximal
run of mask-1 tokens, as in verl's agent loop (``response_mask`` 1 on the model's tokens, 0 on a tool's):

    turn_t  = (runs of mask-1 tokens started at or before t) − 1      (−1 off the mask)
    place_t = model tokens of turn_t before t                          (0 at a turn's first token)

Per group g (a turn, or a place in the turn) the sums over its model tokens give the audit's keys, with the
correction library's names and formulas (``rollcorr.correction.metrics``; ℓ = log π_old − log μ):

    prob_diff_mean = Σ|Δp| / N_g,   prob_diff_frac_ge_x = #{|Δp| ≥ x} / N_g,   prob_diff_frac_lt_1e-3
    kl = −Σℓ / N_g  (k1 of KL(μ‖π_old)),      k3_kl = Σ(ρ − 1 − ℓ̄) / N_g,  ℓ̄ = clamp(ℓ, ±20), ρ = exp ℓ̄

so the token-weighted mean of a key over the groups is the key over all tokens. Every sum is additive, so a
dump read in chunks gives what it gives read whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollcorr.config.correction import LOG_RATIO_CLAMP
from rollcorr.correction.metrics import PROB_SHARES

SMALL = 1e-3  # prob_diff_frac_lt_1e-3
PLACE_BUCKETS = 20  # the places in a turn are shown in at most this many buckets


def turn_index(mask: Tensor, turn: Tensor | None = None) -> Tensor:
    """(B, T) int64: each model token's turn (``turn`` where given, else its run of mask-1 tokens), −1 off
    ``mask`` (B, T)."""
    mask = mask.bool()
    if turn is not None:
        return torch.where(mask, turn.long(), torch.full_like(turn.long(), -1))
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    starts = (mask & ~before).long().cumsum(dim=1)
    return torch.where(mask, starts - 1, torch.full_like(starts, -1))


def place_in_turn(mask: Tensor, turns: Tensor) -> Tensor:
    """(B, T) int64: how many model tokens of the same turn come before each model token, −1 off ``mask``."""
    mask = mask.bool()
    if not mask.any():
        return torch.full(mask.shape, -1, dtype=torch.long)
    count = mask.long().cumsum(dim=1)  # model tokens up to and including t
    k = int(turns.max()) + 1
    key = torch.arange(mask.shape[0])[:, None] * k + turns.clamp(min=0)
    first = torch.full((mask.shape[0] * k,), torch.iinfo(torch.long).max, dtype=torch.long)
    first = first.scatter_reduce(0, key[mask], count[mask], "amin")  # the count at each turn's first token
    return torch.where(mask, count - first[key], torch.full_like(count, -1))


def token_values(log_mu: Tensor, log_old: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The per-token terms the sums read, (B, T) float64 each, 0 off ``mask``."""
    mask = mask.bool()
    log_mu = torch.where(mask, log_mu.double(), 0.0)
    log_old = torch.where(mask, log_old.double(), 0.0)
    lr = log_old - log_mu
    clamped = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    abs_diff = (log_mu.exp() - log_old.exp()).abs()
    out = {"abs_diff": abs_diff, "neg_log_ratio": -lr, "k3": clamped.exp() - 1.0 - clamped,
           "small": (abs_diff < SMALL).double()}
    for x in PROB_SHARES:
        out[f"ge_{x}"] = (abs_diff >= x).double()
    return {k: v * mask for k, v in out.items()}


class GroupSums:
    """Per-token values summed by group (a non-negative int per token; −1: in no group), batch after batch:
    ``tokens`` per group, ``responses`` (rows with a token in the group), each value's sum and ``abs_diff``'s
    maximum."""

    def __init__(self) -> None:
        self.tokens = np.zeros(0, np.int64)
        self.responses = np.zeros(0, np.int64)
        self.sums: dict[str, np.ndarray] = {}
        self.max_abs_diff = np.zeros(0)

    def _grow(self, size: int) -> None:
        if size <= len(self.tokens):
            return
        grow = lambda a: np.concatenate([a, np.zeros(size - len(a), a.dtype)])  # noqa: E731
        self.tokens, self.responses, self.max_abs_diff = grow(self.tokens), grow(self.responses), grow(self.max_abs_diff)
        self.sums = {k: grow(v) for k, v in self.sums.items()}

    def add(self, group: Tensor, values: dict[str, Tensor]) -> None:
        """Add a (B, T) batch: ``group`` int64, ``values`` name → (B, T) float64 (``abs_diff`` among them)."""
        sel = group >= 0
        if not sel.any():
            return
        g = group[sel].numpy()
        size = int(g.max()) + 1
        self._grow(size)
        self.tokens[:size] += np.bincount(g, minlength=size)
        rows = torch.arange(group.shape[0])[:, None].expand_as(group)[sel].numpy()
        self.responses[:size] += np.bincount(np.unique(rows * size + g) % size, minlength=size)
        for name, v in values.items():
            if name not in self.sums:
                self.sums[name] = np.zeros(len(self.tokens))
            self.sums[name][:size] += np.bincount(g, weights=v[sel].numpy(), minlength=size)
        np.maximum.at(self.max_abs_diff, g, values["abs_diff"][sel].numpy())

    def keys(self, lo: int, hi: int, extra: dict[str, str]) -> dict[str, float | int]:
        """The module docstring's keys over groups [lo, hi), and ``extra`` (key → a value's name) as means."""
        n = int(self.tokens[lo:hi].sum())
        s = {k: float(v[lo:hi].sum()) for k, v in self.sums.items()}
        out: dict[str, float | int] = {"tokens": n, "prob_diff_frac_lt_1e-3": s["small"] / n}
        for x in PROB_SHARES:
            out[f"prob_diff_frac_ge_{x}"] = s[f"ge_{x}"] / n
        out.update(prob_diff_mean=s["abs_diff"] / n, prob_diff_max=float(self.max_abs_diff[lo:hi].max()),
                   kl=s["neg_log_ratio"] / n, k3_kl=s["k3"] / n)
        out.update({key: s[name] / n for key, name in extra.items() if name in s})
        return out


class TurnStats:
    """The mismatch by turn and by place in the turn, fed batch by batch (``feed``), summed up by ``result``.
    ``extra``: key → name of an extra per-token value given to ``feed`` (``rollcorr analyze``: the rejected
    share, the mean weight), reported as its mean per group."""

    def __init__(self, extra: dict[str, str] | None = None) -> None:
        self.by_turn, self.by_place = GroupSums(), GroupSums()
        self.extra = dict(extra or {})
        self.sources: set[str] = set()

    def feed(self, log_mu: Tensor, log_old: Tensor, mask: Tensor, turn: Tensor | None = None,
             extra: dict[str, Tensor] | None = None) -> None:
        """A (B, T) batch: the sampler's and the learner's log-probs, the model's tokens, the turn field if any,
        the extra per-token values (0 off the mask)."""
        mask = mask.bool()
        turns = turn_index(mask, turn)
        self.sources.add("the turn field" if turn is not None else "runs of mask-1 tokens")
        values = token_values(log_mu, log_old, mask)
        values.update({k: torch.where(mask, v.double(), 0.0) for k, v in (extra or {}).items()})
        self.by_turn.add(turns, values)
        self.by_place.add(place_in_turn(mask, turns), values)

    @property
    def multi_turn(self) -> bool:
        """Whether some trajectory has two turns or more (else there is nothing per turn to say)."""
        return len(self.by_turn.tokens) > 1

    def result(self, scale: dict[str, float] | None = None) -> dict[str, Any]:
        """{"turns_from", "turns": [per turn: turn, responses, the keys], "position_in_turn": per bucket of
        places: start, end (exclusive) and the keys}. ``scale``: extra keys divided by a number (a weight
        normalised once the whole dump is read)."""
        scale = scale or {}
        turns = []
        for k in range(len(self.by_turn.tokens)):
            if self.by_turn.tokens[k]:
                keys = self.by_turn.keys(k, k + 1, self.extra)
                turns.append({"turn": k, "responses": int(self.by_turn.responses[k]), **_scaled(keys, scale)})
        places = len(self.by_place.tokens)
        width = -(-places // PLACE_BUCKETS) if places else 1
        profile: dict[str, list] = {}
        for start in range(0, places, width):
            end = min(start + width, places)
            if not self.by_place.tokens[start:end].sum():
                continue
            for key, value in {"start": start, "end": end, **_scaled(self.by_place.keys(start, end, self.extra),
                                                                      scale)}.items():
                profile.setdefault(key, []).append(value)
        return {"turns_from": " and ".join(sorted(self.sources)), "turns": turns, "position_in_turn": profile}


def _scaled(keys: dict[str, Any], scale: dict[str, float]) -> dict[str, Any]:
    return {k: v / scale[k] if k in scale else v for k, v in keys.items()}


def turn_summary(log_mu: Tensor, log_old: Tensor, mask: Tensor, turn: Tensor | None = None) -> dict[str, Any] | None:
    """``TurnStats.result`` of one (B, T) batch; None when no trajectory has a second turn."""
    stats = TurnStats()
    stats.feed(log_mu, log_old, mask, turn)
    return stats.result() if stats.multi_turn else None
