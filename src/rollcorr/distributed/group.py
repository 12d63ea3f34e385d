"""The process group a data-parallel learner runs in, set up from the environment torch's launcher writes.

``torchrun`` (``python -m torch.distributed.run``) starts one process per rank and sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``init_from_env`` reads them:

    backend   gloo on CPU; NCCL when the device is CUDA (imported and selected only then)
    device    cpu, or cuda:<LOCAL_RANK> (one GPU per process)
    mesh      a 1-D ``DeviceMesh`` over every rank, built for the device type explicitly
              (``init_device_mesh("cpu", (N,))``: on a machine with GPUs, a CPU run that let the mesh guess its
              device type has been reported to crash inside ``fully_shard``, pytorch issue 132471)
    host      CPU ranks all on one host: the trainer's collectives (``all_reduce``, ``gather_rows``,
              ``all_gather_object``, a replicated learner's gradients) through shared memory, a spin barrier
              between writing and reading (``host_memory.py``); ``ROLLCORR_HOST_MEMORY=0`` keeps them on gloo

``ProcessGroup`` is one rank of that group as the rest of rollcorr sees it: the ``Ranks`` surface (``ranks.py``:
rank, world size, device, mesh, the few collectives the trainer needs) over torch.distributed, a learner sharded
with FSDP2 (``shard.py``) and checkpointed by every rank (``checkpoint.py``). ``join`` is the one place a process
learns its ranks: torchrun's group, or the group of one process (``ranks.ONE_PROCESS``).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rollcorr.distributed.ranks import LAYOUTS, ONE_PROCESS, DistributedError, Ranks

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# How long a collective may wait. Ranks > 0 wait in a broadcast while rank 0 alone samples, evaluates or starts a
# Ray cluster (minutes for a large model), so this is long; a rank that *dies* does not rely on it: torch's
# elastic agent stops every worker within seconds, and a peer's closed connection fails a collective at once.
COLLECTIVE_TIMEOUT_S = 1800.0


@dataclass
class ProcessGroup(Ranks):
    """One of torchrun's N processes (N ≥ 1): rank ``rank`` of ``world``, collectives over torch.distributed, the
    learner replicated on every rank or sharded over ``mesh`` with FSDP2 (``layout``, chosen by ``shard``)."""

    layout: str = "shard"  # how ``shard`` laid out the learner: replicate | shard
    host: Any = None  # ``host_memory.HostMemory`` when every rank is a CPU rank of this host, else None (gloo)
    _averager: Any = field(default=None, repr=False)  # a replicated learner's ``GradientAverager`` (its buffers)

    # ---- collectives (all ranks call them, in the same order) ------------------------------------
    def all_reduce(self, x: Tensor, op: str = "sum", out: Tensor | None = None) -> Tensor:
        if self.host is not None:
            return self.host.all_reduce(x, op, out)
        reduced = x.detach().clone().to(self.device) if out is None or out.device != self.device else out.copy_(x)
        dist.all_reduce(
            reduced, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        )
        return reduced.to(x.device) if out is None else out.copy_(reduced)

    def all_true(self, flag: bool) -> bool:
        return bool(self.all_reduce(torch.tensor([1.0 if flag else 0.0]), "min").item() > 0)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.host is not None:
            return self.host.all_gather_object(obj, fallback=self._gloo_all_gather_object)
        return self._gloo_all_gather_object(obj)

    def _gloo_all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_rows(self, x: Tensor) -> Tensor:
        if self.host is not None:
            return self.host.all_gather(x).flatten(0, 1).to(x.device)
        local = x.detach().contiguous().to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts, 0).to(x.device)

    def barrier(self) -> None:
        dist.barrier()

    @property
    def transport(self) -> str:
        return "shared memory" if self.host is not None else self.backend

    # ---- the learner on these ranks ---------------------------------------------------------------
    @property
    def holds_whole_model(self) -> bool:
        return self.layout == "replicate"

    def learner_device(self, model_device: str | None) -> str | None:
        """Host memory: ``shard`` moves each FSDP unit to ``device`` as it shards it, so no GPU ever holds more
        than its shards and one unit's full weights while the model is built."""
        return "cpu"

    def shard(self, learner, layout: str = "shard", **fsdp: Any):
        """``learner`` (an ``HFLearner``; a skeleton on ranks > 0) laid out over the group by ``layout``
        (``trainer.data_parallel``): ``replicate`` — ``ReplicatedLearner``, whole on every rank; ``shard`` —
        ``ShardedLearner`` with ``fsdp_options(**fsdp)`` (``reshard_after_forward``, ``param_dtype``,
        ``reduce_dtype``); ``auto`` — replicate when every rank fits the whole training state
        (``replicate.fits_replicated``) or the learner cannot be sharded (``can_shard``) and no FSDP option is set,
        else shard. Sets ``self.layout``."""
        from rollcorr.distributed import replicate
        from rollcorr.distributed.shard import ShardedLearner, fsdp_options

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        options = fsdp_options(**fsdp)
        if layout == "auto":  # a learner that cannot be sharded (``can_shard``) is replicated
            fits = replicate.fits_replicated(replicate.training_state_bytes(learner.model),
                                             replicate.rank_memory_bytes(self))
            fits = fits or not getattr(learner, "can_shard", True)
            layout = "replicate" if self.all_true(fits and options == fsdp_options()) else "shard"
        self.layout = layout
        if layout == "replicate":
            return replicate.ReplicatedLearner(learner, self)
        return ShardedLearner(learner, self, **options)

    @property
    def backward_is_collective(self) -> bool:
        return self.layout == "shard"

    def reduce_gradients(self, params: list[Tensor], finite: bool = True) -> bool:
        """A replicated learner's gradients: their mean over the ranks, one all-reduce per dtype that also
        carries ``finite`` (a sharded learner's were reduce-scattered during the backward, its ranks agreed on
        ``finite`` before it)."""
        if self.layout != "replicate":
            return finite
        if self._averager is None:
            from rollcorr.distributed.replicate import GradientAverager

            self._averager = GradientAverager()
        return self._averager(params, self, finite)

    def checkpointer(self, learner, optimizer: torch.optim.Optimizer):
        """Replicated: rank 0 writes one process's checkpoint (``ReplicatedCheckpointer``). Sharded: every rank
        writes its shards (DCP), rank 0 the rest (``ShardedCheckpointer``)."""
        if self.layout == "replicate":
            from rollcorr.distributed.replicate import ReplicatedCheckpointer

            return ReplicatedCheckpointer(learner, optimizer, self)
        from rollcorr.distributed.checkpoint import ShardedCheckpointer

        return ShardedCheckpointer(learner, optimizer, self)


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
                               "--nproc-per-node N -m rollcorr train ...` or trainer.ranks=N")
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@functools.cache
def join() -> Ranks:
    """This process's ranks, made once: one of torchrun's processes (``init_from_env``), or, started without
    torchrun, the group of one process (``ONE_PROCESS``). ``joined`` and ``agree`` are the run's first
    collectives (``train.loop.run``)."""
    return init_from_env() if launched() else ONE_PROCESS


def init_from_env(device: str | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> ProcessGroup:
    """Join the group torchrun describes in the environment (the process group is set up once per process).

    ``device``: "cpu", "cuda" or None (cuda when available and ``LOCAL_RANK`` < the GPU count, else cpu).
    ``timeout_s`` bounds every collective (a live but stuck peer; see ``COLLECTIVE_TIMEOUT_S``).
    """
    missing = [key for key in ENV_KEYS if key not in os.environ]
    if missing:
        raise DistributedError(f"not started by torchrun: {', '.join(missing)} not set (start it with "
                               "`torchrun --nproc-per-node N -m rollcorr train ...` or trainer.ranks=N)")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device is None:
        device = "cuda" if torch.cuda.is_available() and local < torch.cuda.device_count() else "cpu"
    dev = torch.device(f"cuda:{local}") if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend_for(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None,
                                timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_leave_at_exit)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    group = ProcessGroup(rank=rank, world=world, local_rank=local, device=dev, mesh=mesh, backend=backend)
    if dev.type == "cpu" and world > 1 and os.environ.get("ROLLCORR_HOST_MEMORY", "1") != "0":
        from rollcorr.distributed.host_memory import HostMemory

        group.host = HostMemory.open(rank, world, group.broadcast, group.all_true, dist.barrier, timeout_s)
    return group


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
                               "started with other arguments); every rank stopped") from None


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
                                       "get the same command line and files (nothing was trained)")


LEAVE_TIMEOUT_S = 10.0  # how long leaving the group at exit may take (a peer stuck in a collective never holds it)


def _leave_at_exit() -> None:
    """Leave the group while the interpreter is still whole. A worker that exits with gloo's group alive (held
    by the device mesh) aborts now and then as its threads are torn down — "terminate called without an active
    exception", SIGABRT — which the launcher then reports as a failed rank with a resume hint, after a refusal
    that had said why in one line. References to the mesh are dropped first: destroying the group under a live
    mesh still aborts (``close`` drops them)."""
    import threading

    leaving = threading.Thread(target=close, name="rollcorr-leave-group", daemon=True)
    leaving.start()
    leaving.join(LEAVE_TIMEOUT_S)


def close() -> None:
    """Leave the group (idempotent); a later ``join`` joins afresh. The cached group and whatever cycles still
    reach the device mesh are dropped first: destroying the group under a live mesh aborts now and then."""
    join.cache_clear()
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
