"""``Ranks``: what one learner process knows of the data-parallel group it trains in, and the few collectives
the trainer calls (every rank calls them in the same order, like any collective).

A run is data-parallel from its first line, and one process is a group of one: ``Ranks`` itself is that group,
rank 0 of 1 (a run started without torchrun). Its collectives return their input, its learner stays whole
(``shard`` returns it as built) and is checkpointed in state.pt (``rollcorr.checkpoint.Checkpointer``).
``group.ProcessGroup`` is one of torchrun's N processes (N ≥ 1): the same surface over torch.distributed, the
learner sharded with FSDP2 and checkpointed in DCP's format. ``group.join()`` gives a process its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

LAYOUTS = ("auto", "replicate", "shard")  # how ``shard`` may lay a learner out (``trainer.data_parallel``)


class DistributedError(RuntimeError):
    """A rank could not join the group, the launcher's environment is incomplete, or the ranks disagree."""


@dataclass
class Ranks:
    """One rank's view of the data-parallel group; this class itself is the group of one process."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # where this rank's collectives run (cuda:<LOCAL_RANK> with NCCL)
    mesh: Any = None  # the DeviceMesh over the group that FSDP2 shards the learner over (a ProcessGroup's)
    backend: str = "none"  # gloo | nccl (a ProcessGroup's)

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, evaluates, publishes to samplers and writes the run folder."""
        return self.rank == 0

    # ---- collectives (all ranks call them, in the same order); one process: the input itself -------------
    def all_reduce(self, x: Tensor, op: str = "sum", out: Tensor | None = None) -> Tensor:
        """``x`` reduced over every rank (op: sum | max | min): into ``out`` (like ``x``; ``x`` itself may be
        it), or a new tensor."""
        return x.detach().clone() if out is None else out.copy_(x)

    def all_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank (so all ranks take the same branch around a collective)."""
        return bool(flag)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled; tensors arrive on the CPU)."""
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (pickled), in rank order, on every rank."""
        return [obj]

    def gather_rows(self, x: Tensor) -> Tensor:
        """(B_r, T) per rank → (Σ B_r, T) on every rank, rank 0's rows first. Every rank must pass the same
        number of rows (the batch is split evenly, ``split.rank_share``)."""
        return x.detach()

    def barrier(self) -> None:
        """Every rank waits here until all have arrived."""

    @property
    def transport(self) -> str:
        """What carries the trainer's collectives: "none" (one process), "shared memory", "gloo" or "nccl"."""
        return "none"

    # ---- the learner on these ranks ---------------------------------------------------------------------
    @property
    def holds_whole_model(self) -> bool:
        """Whether this rank's learner holds the whole model (one process; a replicated learner), so that a
        sampler on this rank can take its weights without gathering them."""
        return True

    def learner_device(self, model_device: str | None) -> str | None:
        """Where this rank builds the learner before ``shard``: ``model.device`` (None: CUDA when available)."""
        return model_device

    def shard(self, learner, layout: str = "shard", **fsdp: Any):
        """This rank's learner: ``learner`` as built (a ``ProcessGroup`` lays it out over its ranks by
        ``layout``, ``trainer.data_parallel``: replicated, or sharded with FSDP2 with ``fsdp``, the
        ``trainer.fsdp`` keys)."""
        return learner

    @property
    def backward_is_collective(self) -> bool:
        """Whether the learner's forward and backward run collectives (a sharded learner's all-gathers and
        reduce-scatters), so that every rank must agree to run them before any does."""
        return False

    def reduce_gradients(self, params: list[Tensor], finite: bool = True) -> bool:
        """After a mini-batch's backward, on every rank (one whose loss was not finite too): the gradients as
        the optimizer must see them; returns whether the loss was finite on every rank. Nothing to reduce here
        (one process; a sharded learner's gradients are reduce-scattered during the backward, and its ranks
        agreed on ``finite`` before it)."""
        return finite

    def checkpointer(self, learner, optimizer: torch.optim.Optimizer):
        """What writes and reads the learner's weights and optimizer state in the run's checkpoints."""
        from rollcorr.checkpoint import Checkpointer

        return Checkpointer(learner, optimizer)


ONE_PROCESS = Ranks()  # a run started without torchrun: rank 0 of 1
