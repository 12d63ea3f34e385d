"""Scoring helpers shared by the strategies: run the learner's own scoring code with other weights.

The learner (``rollcorr.engines``) owns the forward pass: ``learner.log_prob(rollout, temperature=...,
grad=False) -> (B, T)`` scores response tokens with ``learner.model``. A strategy that needs log-probs
under *other* weights (a stored version, the EWMA average, a dedicated old-logit model) hands the learner a
different module through ``with_model`` instead of re-implementing the forward.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from rollcorr.rollout import Rollout


def with_model(learner, model: nn.Module):
    """A shallow copy of ``learner`` whose ``.model`` is ``model`` (everything else shared).

    The original learner is untouched, so this is safe to use from a background thread while the
    training thread keeps using ``learner.model``.
    """
    view = copy.copy(learner)
    view.model = model
    return view


@torch.no_grad()
def score(learner, rollout: Rollout, temperature: float = 1.0, model: nn.Module | None = None) -> Tensor:
    """(B, T) float32 detached log π(y_t) of the response tokens under ``model`` (default: ``learner.model``).

    Padding positions are set to 0 so every strategy returns the same layout.
    """
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


def unique_tensors(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Tensors with distinct storage (tied weights such as embed/lm_head appear once)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes held by ``tensors``, counting shared (tied) tensors once."""
    return sum(t.numel() * t.element_size() for t in unique_tensors(tensors))


def model_bytes(model: nn.Module) -> int:
    """Bytes of a module's state (parameters and persistent buffers), tied weights counted once."""
    return tensor_bytes(model.state_dict().values())


def copy_state(model: nn.Module, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """A detached copy of ``model.state_dict()`` on ``device``; tied tensors stay shared in the copy."""
    copies: dict[tuple[int, int], Tensor] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in copies:
            copies[key] = t.detach().to(device, copy=True)
        out[name] = copies[key]
    return out


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
