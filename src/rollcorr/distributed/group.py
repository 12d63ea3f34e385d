"""The process group a data-parallel learner runs in, set up from the environment torch's launcher writes.

``torchrun`` (``python -m torch.distributed.run``) starts one process per rank and sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``init_from_env`` reads them:

    backend   gloo on CPU; NCCL when the device is CUDA (imported and selected only then)
    device    cpu, or cuda:<LOCAL_RANK> (one GPU per process)
    mesh      a 1-D ``DeviceMesh`` over every rank, built for the device type explicitly
              (``init_device_mesh("cpu", (N,))``: on a machine with GPUs, a CPU run that let the mesh guess its
              device type has been reported to crash inside ``fully_shard``, pytorch issue 132471)

``Ranks`` is what the rest of rollcorr sees: rank, world size, device, mesh, plus the few collectives the
trainer needs (every rank must call them in the same order, like any collective).
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# How long a collective may wait. Ranks > 0 wait in a broadcast while rank 0 alone samples, evaluates or starts a
# Ray cluster (minutes for a large model), so this is long; a rank that *dies* does not rely on it: torch's
# elastic agent stops every worker within seconds, and a peer's closed connection fails a collective at once.
COLLECTIVE_TIMEOUT_S = 1800.0


class DistributedError(RuntimeError):
    """A rank could not join the group, or the launcher's environment is incomplete."""


@dataclass
class Ranks:
    """One rank's view of the data-parallel group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, evaluates, publishes to samplers and writes the run folder."""
        return self.rank == 0

    # ---- collectives (all ranks call them, in the same order) ------------------------------------
    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """A copy of ``x`` reduced over every rank (op: sum | max | min)."""
        out = x.detach().clone().to(self.device)
        dist.all_reduce(
            out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        )
        return out.to(x.device)

    def all_true(self, flag: bool) -> bool:
        """True when ``flag`` holds on every rank (so all ranks take the same branch around a collective)."""
        return bool(self.all_reduce(torch.tensor([1.0 if flag else 0.0]), "min").item() > 0)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled; tensors arrive on the CPU)."""
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def gather_rows(self, x: Tensor) -> Tensor:
        """(B_r, T) per rank → (Σ B_r, T) on every rank, rank 0's rows first. Every rank must pass the same
        number of rows (the batch is split evenly, ``split.rank_rows``)."""
        local = x.detach().contiguous().to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts, 0).to(x.device)


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors; NCCL for CUDA (the only backend with GPU-direct collectives)."""
    return "nccl" if device.type == "cuda" else "gloo"


LAUNCHER_KEYS = ("TORCHELASTIC_RUN_ID",)  # set by torchrun / rollcorr's own launcher for each worker, not by a shell
JOIN_TIMEOUT_S = 120.0  # how long the ranks wait for each other at the start (then the missing ones are named)


def launched() -> bool:
    """True inside a process started by torchrun (``WORLD_SIZE`` and ``RANK`` set); DistributedError when they are
    set but the process was not started by a launcher — variables left in the user's shell, which would make the
    run wait for peers that never come."""
    present = [key for key in ENV_KEYS if key in os.environ]
    if not present:
        return False
    if not any(key in os.environ for key in LAUNCHER_KEYS):
        raise DistributedError(f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} set in the environment, "
                               "but this process was not started by torchrun (no TORCHELASTIC_RUN_ID): unset "
                               f"{' '.join(present)} (left over from another job?), or start the run with `torchrun "
                               "--nproc-per-node N -m rollcorr train ...` or trainer.ranks=N")  # fmt: skip
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_from_env(device: str | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Ranks:
    """Join the group torchrun describes in the environment (or return the one already joined).

    ``device``: "cpu", "cuda" or None (cuda when available and ``LOCAL_RANK`` < the GPU count, else cpu).
    ``timeout_s`` bounds every collective (a live but stuck peer; see ``COLLECTIVE_TIMEOUT_S``).
    """
    missing = [key for key in ENV_KEYS if key not in os.environ]
    if missing:
        raise DistributedError(f"not started by torchrun: {', '.join(missing)} not set (start it with "
                               "`torchrun --nproc-per-node N -m rollcorr train ...` or trainer.ranks=N)")  # fmt: skip
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device is None:
        device = "cuda" if torch.cuda.is_available() and local < torch.cuda.device_count() else "cpu"
    dev = torch.device(f"cuda:{local}") if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend_for(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None,
                                timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    ranks = Ranks(rank=rank, world=world, local_rank=local, device=dev, mesh=mesh, backend=backend)
    joined(ranks)
    return ranks


def joined(ranks: Ranks, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Every rank is here: a barrier that names the ranks that did not arrive within ``timeout_s`` (gloo's
    monitored barrier; NCCL has none, its own timeout applies)."""
    if ranks.world == 1 or ranks.backend != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as err:
        missing = sorted({int(r) for r in re.findall(r"[Rr]anks? (\d+)", str(err))} - {ranks.rank})
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "a rank"
        raise DistributedError(f"{who} of {ranks.world} did not join within {timeout_s:.0f} s (stopped, crashed, or "
                               "started with other arguments); every rank stopped") from None  # fmt: skip


def agree(ranks: Ranks, facts: dict[str, Any]) -> None:
    """DistributedError naming the first key where a rank's ``facts`` (its resolved config, the model's files,
    rollcorr's version, the run folder arguments: flat "key": value) differ from rank 0's — before any rank
    trains. Ranks that disagree would otherwise train silently apart (another lr moves that rank's shards) or
    fail later at a collective that names nothing."""
    if ranks.world == 1:
        return
    gathered: list[Any] = [None] * ranks.world
    dist.all_gather_object(gathered, facts)
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        for key in sorted(set(reference) | set(other)):
            if reference.get(key) != other.get(key):
                raise DistributedError(f"rank {rank} was started differently from rank 0: {key} is "
                                       f"{other.get(key)!r} there, {reference.get(key)!r} on rank 0; every rank must "
                                       "get the same command line and files (nothing was trained)")  # fmt: skip


def close() -> None:
    """Leave the group (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
