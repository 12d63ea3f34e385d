"""Outcome advantages from per-response rewards (docs/spec.md §6).

Every estimator takes rewards (B,) and group ids (B,) (responses to the same prompt share an id) and
returns advantages (B,); `broadcast` turns them into the (B, T) tensor the losses take. Formulas, for a
group G of kept responses with rewards r_j, n = |G|:

  GRPO      A_i = (r_i − mean_G r) / (std_G r + eps)     std unbiased (torch.std), as verl / TRL
  Dr.GRPO   A_i =  r_i − mean_G r                        (GRPO with norm_std=False)
  RLOO      A_i =  r_i − mean_{j∈G, j≠i} r_j = n/(n−1) · (r_i − mean_G r)
  OAPL      A_i =  r_i − V̂(x),  V̂(x) = β₁ · log mean_{j∈G} exp(r_j / β₁)   (soft value; β₁ → ∞ gives the mean)

Multi-turn trajectories take the trajectory's reward (the sum of its turns') broadcast over every model token,
or, per turn (``turn_advantages``), the reward still to come from each turn, R_{i,k} = Σ_{j ≥ k} r_{i,j},
compared within the group among the trajectories that reached turn k: GRPO's A_{i,k} = (R_{i,k} − mean_{G_k} R)
/ (std_{G_k} R + eps), each estimator alike, and A_{i,k} given to the model tokens of turn k.

`keep` (B,) bool removes responses from every baseline (rejected by the correction: docs/spec.md §3, "rejected
tokens are invisible downstream"); removed responses get advantage 0. A group with a single
kept response gets advantage 0 (no baseline information), where verl instead uses mean 0 / std 1.
`uniform_group_filter` is DAPO's dynamic-sampling filter (drop groups whose rewards are all equal).
All functions are pure and differentiable-free (rewards carry no gradient); no `.item()` calls.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "broadcast",
    "compute_advantages",
    "drgrpo_advantages",
    "grpo_advantages",
    "oapl_advantages",
    "oapl_value",
    "rloo_advantages",
    "rewards_to_go",
    "turn_advantages",
    "uniform_group_filter",
]

ESTIMATORS = ("grpo", "drgrpo", "rloo", "oapl")


def _check(rewards: Tensor, group_ids: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Validate shapes; return (float rewards, dense group index (B,), keep as float (B,))."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if tuple(group_ids.shape) != tuple(rewards.shape):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected {tuple(rewards.shape)}")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    if keep is None:
        keep_f = torch.ones_like(rewards)
    else:
        if tuple(keep.shape) != tuple(rewards.shape):
            raise ValueError(f"keep has shape {tuple(keep.shape)}, expected {tuple(rewards.shape)}")
        keep_f = keep.to(rewards.dtype)
    _, index = torch.unique(group_ids, return_inverse=True)
    return rewards, index, keep_f


def _group_sum(values: Tensor, index: Tensor) -> Tensor:
    """Σ of `values` over each row's group, gathered back to (B,)."""
    sums = torch.zeros(int(index.max()) + 1, dtype=values.dtype, device=values.device)
    return sums.index_add(0, index, values)[index]


def _group_stats(rewards: Tensor, index: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (count, mean, unbiased std) of the kept rewards of the row's group."""
    n = _group_sum(keep, index)
    mean = _group_sum(rewards * keep, index) / n.clamp_min(1)
    var = _group_sum((rewards - mean) ** 2 * keep, index) / (n - 1).clamp_min(1)
    return n, mean, var.sqrt()


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    keep: Tensor | None = None,
) -> Tensor:
    """GRPO: (r − group mean) / (group std + eps); Dr.GRPO with norm_std=False. Returns (B,)."""
    rewards, index, keep_f = _check(rewards, group_ids, keep)
    n, mean, std = _group_stats(rewards, index, keep_f)
    adv = rewards - mean
    if norm_std:
        adv = adv / (std + eps)
    return torch.where((keep_f > 0) & (n > 1), adv, torch.zeros_like(adv))


def drgrpo_advantages(rewards: Tensor, group_ids: Tensor, *, keep: Tensor | None = None) -> Tensor:
    """Dr.GRPO: r − group mean, no std division. Returns (B,)."""
    return grpo_advantages(rewards, group_ids, norm_std=False, keep=keep)


def rloo_advantages(rewards: Tensor, group_ids: Tensor, *, keep: Tensor | None = None) -> Tensor:
    """RLOO: r_i − mean of the other kept responses of the group. Returns (B,)."""
    rewards, index, keep_f = _check(rewards, group_ids, keep)
    n = _group_sum(keep_f, index)
    total = _group_sum(rewards * keep_f, index)
    adv = rewards - (total - rewards) / (n - 1).clamp_min(1)
    return torch.where((keep_f > 0) & (n > 1), adv, torch.zeros_like(adv))


def oapl_value(rewards: Tensor, group_ids: Tensor, *, beta1: float, keep: Tensor | None = None) -> Tensor:
    """OAPL soft value V̂(x) = β₁ · log mean_j exp(r_j / β₁) over the kept responses of the group. (B,).

    β₁ = inf gives the plain group mean. Computed with a per-group max shift (stable for small β₁).
    """
    if not beta1 > 0:
        raise ValueError(f"beta1 must be > 0 (use math.inf for the plain mean), got {beta1}")
    rewards, index, keep_f = _check(rewards, group_ids, keep)
    if math.isinf(beta1):
        return _group_sum(rewards * keep_f, index) / _group_sum(keep_f, index).clamp_min(1)
    scaled = torch.where(keep_f > 0, rewards / beta1, torch.full_like(rewards, -math.inf))
    groups = int(index.max()) + 1
    shift = torch.full((groups,), -math.inf, dtype=rewards.dtype, device=rewards.device)
    shift = shift.scatter_reduce(0, index, scaled, reduce="amax")[index]
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # groups with no kept row
    n = _group_sum(keep_f, index).clamp_min(1)
    mean_exp = _group_sum(torch.exp(scaled - shift) * keep_f, index) / n
    return beta1 * (shift + torch.log(mean_exp.clamp_min(torch.finfo(rewards.dtype).tiny)))


def oapl_advantages(
    rewards: Tensor, group_ids: Tensor, *, beta1: float, keep: Tensor | None = None
) -> Tensor:
    """OAPL advantage r_i − V̂(x) (no std normalisation); 0 for rows not kept. Returns (B,)."""
    value = oapl_value(rewards, group_ids, beta1=beta1, keep=keep)
    adv = rewards.to(value.dtype) - value
    return adv if keep is None else torch.where(keep, adv, torch.zeros_like(adv))


def uniform_group_filter(rewards: Tensor, group_ids: Tensor, *, keep: Tensor | None = None) -> Tensor:
    """DAPO dynamic sampling: (B,) bool, False for rows whose group's kept rewards are all equal."""
    rewards, index, keep_f = _check(rewards, group_ids, keep)
    groups = int(index.max()) + 1
    big = torch.finfo(rewards.dtype).max
    lo = torch.full((groups,), big, dtype=rewards.dtype, device=rewards.device)
    hi = torch.full((groups,), -big, dtype=rewards.dtype, device=rewards.device)
    lo = lo.scatter_reduce(0, index, torch.where(keep_f > 0, rewards, torch.full_like(rewards, big)), "amin")
    hi = hi.scatter_reduce(0, index, torch.where(keep_f > 0, rewards, torch.full_like(rewards, -big)), "amax")
    return (hi > lo)[index]


def broadcast(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) advantages → (B, T), zero on padding / rejected positions of `response_mask`."""
    if advantages.dim() != 1 or response_mask.dim() != 2 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and response_mask {tuple(response_mask.shape)} "
            "must be (B,) and (B, T)"
        )
    return advantages[:, None] * response_mask.to(advantages.dtype)


def compute_advantages(
    estimator: str,
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    keep: Tensor | None = None,
    norm_std: bool = True,
    eps: float = 1e-6,
    beta1: float = 1.0,
    filter_uniform_groups: bool = False,
) -> tuple[Tensor, Tensor]:
    """One entry point: returns ((B, T) advantages, (B,) bool rows used).

    `keep` removes rows from baselines (e.g. sequences the correction rejected); with
    `filter_uniform_groups` rows of all-equal-reward groups are dropped too (advantage 0, used False).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    used = torch.ones_like(rewards, dtype=torch.bool) if keep is None else keep.bool()
    if filter_uniform_groups:
        used = used & uniform_group_filter(rewards, group_ids, keep=used)
    if estimator == "grpo":
        adv = grpo_advantages(rewards, group_ids, norm_std=norm_std, eps=eps, keep=used)
    elif estimator == "drgrpo":
        adv = drgrpo_advantages(rewards, group_ids, keep=used)
    elif estimator == "rloo":
        adv = rloo_advantages(rewards, group_ids, keep=used)
    else:
        adv = oapl_advantages(rewards, group_ids, beta1=beta1, keep=used)
    return broadcast(adv, response_mask), used


def rewards_to_go(turn_rewards: Tensor, turns: Tensor) -> Tensor:
    """(B, K) per-turn rewards r_{i,k}, (B,) the number of turns of each row → (B, K) R_{i,k} = Σ_{k ≤ j < turns_i}
    r_{i,j}, 0 from a row's last turn on."""
    present = torch.arange(turn_rewards.shape[1])[None] < turns[:, None]
    r = torch.where(present, turn_rewards.float(), 0.0)
    return torch.where(present, r.flip(1).cumsum(1).flip(1), 0.0)


def turn_advantages(estimator: str, turn_rewards: Tensor, turns: Tensor, group_ids: Tensor, turn: Tensor,
                    response_mask: Tensor, **options) -> tuple[Tensor, Tensor]:
    """Per-turn advantages of multi-turn trajectories: ((B, T) advantages, (B,) bool rows used).

    ``turn_rewards`` (B, K) each row's turn rewards (anything past its ``turns``), ``turn`` (B, T) the turn of
    each token. Each (row, turn k) is one entry of ``compute_advantages`` with reward R_{i,k}
    (``rewards_to_go``) in group (group id, k), so a turn is compared with the same turn of its group; the
    tokens of turn k get A_{i,k}. ``options``: ``compute_advantages``'s (``keep`` per row)."""
    k = turn_rewards.shape[1]
    rows, ks = (torch.arange(k)[None] < turns[:, None]).nonzero(as_tuple=True)
    togo = rewards_to_go(turn_rewards, turns)[rows, ks]
    keep = options.pop("keep", None)
    flat_keep = None if keep is None else keep.bool()[rows]
    cell_adv, cell_used = compute_advantages(estimator, togo, group_ids[rows] * k + ks, torch.ones(len(rows), 1),
                                             keep=flat_keep, **options)
    by_turn = torch.zeros(turn_rewards.shape, dtype=cell_adv.dtype)
    by_turn[rows, ks] = cell_adv[:, 0]
    used = torch.zeros(turns.shape, dtype=torch.bool).index_put_((rows,), cell_used, accumulate=True)
    adv = by_turn.gather(1, turn.clamp(0, k - 1)) * response_mask.to(by_turn.dtype)
    return adv, used
