"""Scoring helpers shared by the strategies: run the learner's own scoring code with other weights.

The learner (``rollcorr.engines``) owns the forward pass: ``learner.log_prob(rollout, temperature=...,
grad=False) -> (B, T)`` scores response tokens with ``learner.model``. A strategy that needs log-probs
under *other* weights never re-implements the forward. It holds them as a weight copy — ``copy_state(model)``,
a dict mirroring ``model.state_dict()`` — and scores with ``score(..., weights=copy)``, which exchanges the
copy's contents with the live model's in place for one no-grad forward (``swapped_in``) and back. That works
unchanged for a learner sharded over data-parallel ranks (``rollcorr.distributed``, FSDP2): there the live
weights are ``DTensor`` shards, so the copy holds this rank's shards only (1/N of the memory) and each rank
exchanges its own. A strategy that scores from another thread while the learner trains (``old_logit_model``)
keeps a module of its own instead and hands it over with ``with_model`` (one process only).

A sharded learner's forward is a collective: every rank must score the same number of times, with no rows as
well (``scores_together``; ``score`` then still runs the forward). Rows that every rank holds alike (the
in-flight rollouts) are scored split over the ranks and gathered (``score_split``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from rollcorr.rollout import Rollout
from rollcorr.shards import local_tensor  # a DTensor's shard; other tensors as they are


def with_model(learner, model: nn.Module):
    """A shallow copy of ``learner`` whose ``.model`` is ``model`` (everything else shared).

    The original learner is untouched, so this is safe to use from a background thread while the
    training thread keeps using ``learner.model``.
    """
    view = copy.copy(learner)
    view.model = model
    return view


def scores_together(learner) -> bool:
    """Whether ``learner``'s forward is a collective over data-parallel ranks (a sharded learner says so with
    ``collective = True``): then every rank scores the same number of times, a rank with no rows too."""
    return bool(getattr(learner, "collective", False))


@torch.no_grad()
def score(learner, rollout: Rollout, temperature: float = 1.0, model: nn.Module | None = None,
          weights: Mapping[str, Tensor] | None = None) -> Tensor:
    """(B, T) float32 detached log π(y_t) of the response tokens under ``weights`` (a ``copy_state`` copy, put
    into the learner's model for the call: ``swapped_in``) or ``model`` (a module of its own); default: the
    learner's current weights.

    Padding positions are set to 0 so every strategy returns the same layout. No rows: (0, T) without a
    forward, unless the learner scores together with other ranks (``scores_together``).
    """
    if rollout.batch_size == 0 and not scores_together(learner):
        return torch.zeros(rollout.response_ids.shape, dtype=torch.float32, device=rollout.response_ids.device)
    if weights is not None:
        with swapped_in(learner.model, weights):
            log_prob = learner.log_prob(rollout, temperature=temperature, grad=False)
    else:
        scorer = learner if model is None else with_model(learner, model)
        log_prob = scorer.log_prob(rollout, temperature=temperature, grad=False)
    if isinstance(log_prob, tuple):  # (log_prob, entropy) from learners that always return both
        log_prob = log_prob[0]
    log_prob = log_prob.detach().float()
    if tuple(log_prob.shape) != tuple(rollout.response_ids.shape):
        raise ValueError(
            f"learner.log_prob returned shape {tuple(log_prob.shape)}, expected {tuple(rollout.response_ids.shape)}"
        )
    mask = rollout.response_mask.bool().to(log_prob.device)
    return torch.where(mask, log_prob, torch.zeros_like(log_prob))


@torch.no_grad()
def score_split(learner, rollout: Rollout, temperature: float = 1.0) -> Tensor:
    """(B, T) like ``score`` with the learner's current weights, for a rollout that every rank holds alike (the
    in-flight rollouts rank 0 broadcasts). A learner that scores together with the other ranks of its group
    (``scores_together``: sharded over its ``ranks``, N of them) scores rows r, r + N, r + 2N, … on rank r and
    gathers the others' scores, so each rank runs the forward over ⌈B / N⌉ rows instead of B; any other learner
    scores them all (``score``). Every rank gets the same (B, T)."""
    batch = rollout.batch_size
    if not scores_together(learner) or batch == 0:
        return score(learner, rollout, temperature)
    ranks = learner.ranks
    per_rank = -(-batch // ranks.world)
    mine = list(range(ranks.rank, batch, ranks.world))
    padded = torch.zeros((per_rank, *rollout.response_ids.shape[1:]), dtype=torch.float32)
    padded[: len(mine)] = score(learner, rollout.select(mine), temperature).cpu()
    gathered = ranks.gather_rows(padded)  # (N · per_rank, T): rank r's rows at r · per_rank
    out = torch.zeros(rollout.response_ids.shape, dtype=torch.float32)
    for rank in range(ranks.world):
        rows = list(range(rank, batch, ranks.world))
        out[rows] = gathered[rank * per_rank : rank * per_rank + len(rows)]
    return out.to(rollout.response_ids.device)


def _storage_key(t: Tensor) -> tuple[int, int]:
    local = local_tensor(t)
    return local.untyped_storage().data_ptr(), local.storage_offset()


def unique_tensors(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Tensors with distinct storage (tied weights such as embed/lm_head appear once)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for t in tensors:
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes this process holds for ``tensors`` (a ``DTensor``: its local shard), shared (tied) ones once."""
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in unique_tensors(tensors))


def model_bytes(model: nn.Module) -> int:
    """Bytes of a module's state (parameters and persistent buffers), tied weights counted once."""
    return tensor_bytes(model.state_dict().values())


def copy_state(model: nn.Module, device: str | torch.device | None = "cpu") -> dict[str, Tensor]:
    """A detached copy of ``model.state_dict()`` on ``device`` (None: where each tensor is); tied tensors stay
    shared in the copy. A sharded model's ``DTensor`` weights are copied as ``DTensor`` s: this rank's shards."""
    return copy_tensors(model.state_dict(), device)


def copy_tensors(tensors: Mapping[str, Tensor], device: str | torch.device | None = None) -> dict[str, Tensor]:
    """A detached copy of a name → tensor mapping on ``device`` (None: where each is), shared tensors shared."""
    copies: dict[tuple[int, int], Tensor] = {}
    out = {}
    for name, t in tensors.items():
        key = _storage_key(t)
        if key not in copies:
            copies[key] = t.detach().to(t.device if device is None else device, copy=True)
        out[name] = copies[key]
    return out


@contextmanager
def swapped_in(model: nn.Module, weights: Mapping[str, Tensor]) -> Iterator[nn.Module]:
    """``model`` holding ``weights`` (a ``copy_state`` copy of it) inside the block, its own weights after.

    The contents are exchanged in place, one tensor at a time through a temporary of that tensor's size
    (tied tensors once), and exchanged back on the way out, exceptions included: no second model, and the
    learner's own scoring code runs on the copy. A sharded model (``DTensor`` weights) exchanges this rank's
    shards; its learner must not keep gathered weights between calls (``distributed.shard.ShardedLearner``
    reshards every unit after a no-grad forward), so the forward inside gathers the copy's shards. Not for a
    model another thread is using at the same time.
    """
    live = model.state_dict()
    if live.keys() != weights.keys():
        missing, extra = sorted(live.keys() - weights.keys()), sorted(weights.keys() - live.keys())
        raise KeyError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    seen: set[tuple[int, int]] = set()
    pairs = []
    for name, t in live.items():
        if _storage_key(t) not in seen:
            seen.add(_storage_key(t))
            pairs.append((local_tensor(t), local_tensor(weights[name])))

    def exchange() -> None:
        for a, b in pairs:
            held = b.clone()
            b.copy_(a)
            a.copy_(held)

    with torch.no_grad():
        exchange()
        try:
            yield model
        finally:
            exchange()


def clone_model(model: nn.Module) -> nn.Module:
    """An independent copy of ``model`` for no-grad scoring (no gradients, eval mode)."""
    twin = copy.deepcopy(model)
    twin.requires_grad_(False)
    twin.eval()
    return twin


def check_versions(rollout: Rollout, current_version: int) -> Tensor:
    """(B, T) int64 token versions; raises if a valid token claims a version newer than ``current_version``."""
    version = rollout.version
    if version.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"rollout.version must be an integer tensor, got {version.dtype}")
    mask = rollout.response_mask.bool()
    if mask.any():
        newest = int(version[mask].max())
        if newest > current_version:
            raise ValueError(
                f"rollout has tokens of version {newest}, newer than the learner's current version {current_version}"
            )
    return version.long()


def masked_versions(rollout: Rollout) -> list[int]:
    """Sorted distinct versions of the valid tokens."""
    mask = rollout.response_mask.bool()
    return sorted(int(v) for v in torch.unique(rollout.version[mask]).tolist())
