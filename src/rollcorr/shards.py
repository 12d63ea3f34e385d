"""Tensors of a sharded learner (FSDP2 holds each weight as a ``DTensor``: this rank's shard of a whole tensor),
and every other tensor unchanged, so the same code reads both.

    local_tensor(x)   this rank's shard of a ``DTensor``; any other tensor as it is
    is_sharded(x)     whether ``x`` is a ``DTensor`` (a sharded learner's weight, or a strategy's copy of one)

Pure functions of torch alone, on the math floor: the π_old strategies (which hold weight copies), the step guard
and the sharded learner all read a tensor's local part through them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def is_sharded(x: Any) -> bool:
    """A ``DTensor`` (a sharded learner's weights, or a strategy's copy of them)."""
    return isinstance(x, Tensor) and hasattr(x, "device_mesh")


def local_tensor(x: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor``; any other tensor unchanged."""
    to_local = getattr(x, "to_local", None)
    return to_local() if to_local is not None else x
